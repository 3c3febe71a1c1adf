"""A one-line progress bar on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    """`Progress(n, "sweep")`; `.step("label")` before each of the n items; `.done()` at the end."""

    def __init__(self, total: int, name: str, width: int = 24):
        self.total, self.name, self.width, self.i, self.t0 = total, name, width, 0, time.perf_counter()

    def step(self, label: str) -> None:
        filled = self.width * self.i // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.name} [{bar}] {self.i}/{self.total} {elapsed:6.0f}s {label[:60]:<60}")
        sys.stderr.flush()
        self.i += 1

    def done(self) -> None:
        self.i = self.total
        self.step("done")
        sys.stderr.write("\n")
