"""experiments.ncu_stalls on a small source page written here: the split at the memory warpgroup's setmaxnreg,
the shares, and a one-line error for a file that is not a source page. Through the command line only: the module
defines absl flags that other experiment modules imported by the tests define too."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys

import pytest

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_long_sb"]


def page(kernels: list[list[tuple[str, int, int]]]) -> str:
    """A source page: per kernel, (SASS, barrier samples, long_sb samples) rows."""
    out = []
    for rows in kernels:
        out.append('"Kernel Name","anonymous_mosaic_gpu_kernel",')
        out.append(",".join(f'"{h}"' for h in HEADER))
        for i, (sass, bar, lsb) in enumerate(rows):
            out.append(",".join(f'"{v}"' for v in (hex(16 * i), f"      {sass}", bar + lsb, bar, lsb)))
    return "\n".join(out) + "\n"


def random_kernel(rng: random.Random) -> tuple[list[tuple[str, int, int]], int, int, int]:
    """Compute rows, then the memory part from USETMAXREG.DEALLOC; returns rows and the compute barrier, long_sb
    and memory totals."""
    compute = [("WARPGROUP.DEPBAR.LE gsb0, 0x0", rng.randint(0, 50), 0) for _ in range(5)]
    compute += [(f"@!P1  BRA 0x{i:x}", 0, rng.randint(0, 50)) for i in range(3)]
    memory = [("USETMAXREG.DEALLOC.CTAPOOL 0x28", 0, rng.randint(1, 9)), ("@!P0  BRA 0x10", 0, rng.randint(1, 99))]
    rows = compute + memory
    return rows, sum(r[1] for r in compute), sum(r[2] for r in compute), sum(r[1] + r[2] for r in memory)


def run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.ncu_stalls", f"--out_dir={tmp_path}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_summary_splits_at_the_memory_warpgroup(tmp_path):
    rng = random.Random(1)
    made = [random_kernel(rng) for _ in range(2)]
    src = tmp_path / "page.csv.gz"
    src.write_bytes(gzip.compress(page([m[0] for m in made]).encode()))
    done = run_cli(tmp_path, f"--csv={src}", "--labels=a,b", "--top=3")
    assert done.returncode == 0, done.stderr
    records = json.loads((tmp_path / "ncu_mla_stalls.json").read_text())["records"]
    assert [r["kernel"] for r in records] == ["a", "b"]
    for rec, (_, bar, lsb, mem) in zip(records, made, strict=True):
        assert rec["compute_samples"] == bar + lsb and rec["memory_samples"] == mem
        share = round(100.0 * bar / max(bar + lsb, 1), 1)
        assert f"barrier {share}" in rec["reasons_%"] and f"WARPGROUP.DEPBAR {share}" in rec["opcodes_%"]
        assert rec["top_%"].count("#") == 3


@pytest.mark.parametrize("content", ["not,a,page\n1,2,3\n", None])
def test_cli_refuses_what_is_not_a_page(tmp_path, content):
    src = tmp_path / "bad.csv"
    if content is not None:
        src.write_text(content)
    done = run_cli(tmp_path, f"--csv={src}")
    assert done.returncode == 2 and not (tmp_path / "ncu_mla_stalls.json").exists()
    assert "--csv" in done.stderr.strip().splitlines()[-1]
