"""The cost table `method="auto"` chooses by, and the choice.

A table holds, for each candidate program (`ar`, the DFlash chain `dflash`, DDTree at a node budget `ddtree-<b>`),
at a grid of batch sizes x contexts (prompt tokens), measured on one machine (`ddtree-calibrate`,
`ddtree_jax.calibration`): its round time in ms (the batch's time per round of its mean row, which includes waiting
for the batch's slowest row), its call time in ms (a 1-token run: the prefill, the drafter's context and what
else a run pays once) and its acceptance, tokens committed per round (`ar`: 1), at each grid point: acceptance
moves with the context, and not alike for every candidate (the shipped pair's chain commits 4.6 tokens a round at
context 60 and 3.3 at 1888, DDTree 8 5.0 and 4.1), so one figure pooled over the grid misleads the choice.

For a batch of B rows whose longest prompt has C tokens, generating N tokens, `CostTable.choose` expects each
candidate's rate B x N / (call_ms + (N - 1) / tokens_per_round x round_ms): all three interpolated linearly in batch
and in context between grid points, clamped at the grid's ends; tokens_per_round as `Acceptance` has it (the table's
there, scaled by how the batches served so far accepted against the table). It picks the drafting candidate with the
highest expected rate only when that rate beats `ar`'s by more than `AR_MARGIN` (5%), else `ar` (a table without
`ar`: the highest rate). The table is JSON (`calibration.json`, next to the drafter by default) and names the device
kind and count, the dtype, the exact switch, the jax version and the pair it was measured with; a table from another
device, dtype or switch setting is refused (`CostTable.check`).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddtree_jax.engine import DEFAULT_BUDGET, METHODS, GenSpec, tree_size
from ddtree_jax.errors import UserError
from ddtree_jax.prompts import atomic_write

FILE_NAME = "calibration.json"  # the table's name beside the drafter checkpoint
FORMAT = "ddtree-cost-table/3"
FORMAT_POOLED = "ddtree-cost-table/2"  # read too: one acceptance per candidate, held at every grid point
DEFAULT_CANDIDATES = ("ar", "dflash", "ddtree-4", "ddtree-8", "ddtree-16", "ddtree-32")
FROM_TABLE, NO_DRAFTER = "cost table", "no drafter"  # a `Choice`'s reasons
# A drafting candidate replaces ar only when expected more than this fraction faster: a table measured over few
# rounds mispredicts by a few percent. Below the margin ar loses at most the margin to the best when the table is
# right (issue 37's within 5% of the best), and is never slower than ar against table errors up to the margin.
AR_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A program `auto` may run: a method and, for ddtree only, its node budget."""

    method: str
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"candidate method {self.method!r} not one of {METHODS}")
        if (self.method == "ddtree") != (self.budget is not None) or (self.budget is not None and self.budget < 1):
            raise ValueError(f"a ddtree candidate takes a budget >= 1 (ddtree-8), ar and dflash none: {self}")

    @property
    def name(self) -> str:
        """ "ar", "dflash" or "ddtree-<budget>"."""
        return self.method if self.budget is None else f"{self.method}-{self.budget}"

    @property
    def spec_budget(self) -> int:
        """The `GenSpec.budget` of its program (unused by ar and dflash)."""
        return DEFAULT_BUDGET if self.budget is None else self.budget

    @classmethod
    def parse(cls, name: str) -> Candidate:
        """ "ar", "dflash" or "ddtree-<budget>" -> the candidate; a ValueError otherwise."""
        method, dash, budget = name.strip().partition("-")
        if dash and not budget.isdigit():
            raise ValueError(f"candidate {name!r}: not ar, dflash or ddtree-<budget>")
        return cls(method, int(budget) if dash else None)


def largest(candidates: Sequence[Candidate], num_draft: int) -> Candidate:
    """The candidate verifying the most tokens per round (`engine.tree_size`): the one whose run needs the most
    memory (`memory.plan`)."""
    return max(candidates, key=lambda c: tree_size(GenSpec(c.method, 1, 1, 1, budget=c.spec_budget), num_draft))


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `auto` ran for one batch, and why."""

    candidate: Candidate
    batch: int  # the program's (padded) batch size
    context: int  # the batch's longest prompt, in tokens
    expected_tokens_per_s: Mapping[str, float]  # each candidate's expected aggregate rate; empty without a table
    reason: str  # FROM_TABLE, or NO_DRAFTER (auto is then ar)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.candidate.name,
            "reason": self.reason,
            "batch": self.batch,
            "context": self.context,
            "expected_tokens_per_s": dict(self.expected_tokens_per_s),
        }


def _segment(grid: Sequence[int], x: float) -> tuple[int, int, float]:
    """(i, j, w): x lies between grid[i] and grid[j] with weight w on grid[j]; outside the grid, its nearest end."""
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        return len(grid) - 1, len(grid) - 1, 0.0
    j = bisect.bisect_right(grid, x)
    return j - 1, j, (x - grid[j - 1]) / (grid[j] - grid[j - 1])


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Each candidate's round and call times in ms and tokens per round, each `[len(batches)][len(contexts)]`
    (tokens_per_round may be given as one number per candidate: the same at every grid point), keyed by candidate
    name in the order measured; and what they were measured with."""

    device_kind: str  # jax's `device_kind` of the devices, e.g. "NVIDIA H200" or "cpu"
    device_count: int  # devices the programs ran on
    dtype: str  # weights and activations, e.g. "bfloat16"
    jax_version: str
    target: str  # the checkpoints as given to the calibration
    drafter: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    round_ms: Mapping[str, tuple[tuple[float, ...], ...]]
    call_ms: Mapping[str, tuple[tuple[float, ...], ...]]
    tokens_per_round: Mapping[str, tuple[tuple[float, ...], ...]]  # or one number per candidate, when built
    acceptance_rounds: int  # the fewest rounds a drafting candidate's acceptance was measured over, whole grid
    exact: bool = False  # the programs ran the exact numerics (`Generator(exact=)`), whose round times differ
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # how it was measured (provenance)
    source: str = dataclasses.field(default="", compare=False)  # the file it was read from; "" if measured here

    def __post_init__(self) -> None:
        for name, grid in (("batches", self.batches), ("contexts", self.contexts)):
            if not grid or any(not isinstance(v, int) or v < 1 for v in grid) or list(grid) != sorted(set(grid)):
                raise ValueError(f"{name} must be increasing integers >= 1, got {list(grid)}")
        if not self.round_ms or not list(self.round_ms) == list(self.call_ms) == list(self.tokens_per_round):
            raise ValueError("round_ms, call_ms and tokens_per_round must name the same candidates, at least one")
        if not isinstance(self.acceptance_rounds, int) or self.acceptance_rounds < 1:
            raise ValueError(f"acceptance_rounds must be an integer >= 1, got {self.acceptance_rounds}")
        for kind in ("round_ms", "call_ms", "tokens_per_round"):
            object.__setattr__(self, kind, {n: self._grid(n, kind, g) for n, g in getattr(self, kind).items()})
        for name in self.round_ms:
            Candidate.parse(name)
            tprs = [t for row in self.tokens_per_round[name] for t in row]
            if any(t < 1 for t in tprs) or (name == "ar" and any(t != 1 for t in tprs)):
                raise ValueError(f"{name}: tokens per round must be >= 1 (ar: 1), got {tprs}")

    def _grid(self, name: str, kind: str, values: Any) -> tuple[tuple[float, ...], ...]:
        """`values` as `[len(batches)][len(contexts)]` nested tuples of finite floats > 0 (one number for
        tokens_per_round: the same at every grid point); a ValueError naming the candidate otherwise."""
        shape = len(self.batches), len(self.contexts)
        if kind == "tokens_per_round" and isinstance(values, numbers.Real):
            values = [[values] * shape[1]] * shape[0]
        try:
            grid = tuple(tuple(float(v) for v in row) for row in values)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: {kind} is not a grid of numbers") from None
        if [len(row) for row in grid] != [shape[1]] * shape[0]:
            raise ValueError(f"{name}: {kind} is not {shape[0]} batches x {shape[1]} contexts")
        if not all(math.isfinite(v) and v > 0 for row in grid for v in row):
            raise ValueError(f"{name}: {kind} must be finite and > 0")
        return grid

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        return tuple(Candidate.parse(name) for name in self.round_ms)

    def _at(self, grids: Mapping[str, tuple[tuple[float, ...], ...]], name: str, batch: int, context: int) -> float:
        """grids[name] at (batch, context), bilinear between grid points, clamped at the grid's ends."""
        i0, i1, wb = _segment(self.batches, batch)
        j0, j1, wc = _segment(self.contexts, context)
        g = grids[name]
        near = (1 - wc) * g[i0][j0] + wc * g[i0][j1]
        far = (1 - wc) * g[i1][j0] + wc * g[i1][j1]
        return (1 - wb) * near + wb * far

    def round_time(self, name: str, batch: int, context: int) -> float:
        """Candidate `name`'s round time in ms at (batch, context), bilinear between grid points, clamped."""
        return self._at(self.round_ms, name, batch, context)

    def call_time(self, name: str, batch: int, context: int) -> float:
        """Candidate `name`'s call time (a 1-token run) in ms at (batch, context), as `round_time` interpolates."""
        return self._at(self.call_ms, name, batch, context)

    def acceptance(self, batch: int, context: int) -> dict[str, float]:
        """Each candidate's tokens per round at (batch, context), as `round_time` interpolates."""
        return {n: self._at(self.tokens_per_round, n, batch, context) for n in self.round_ms}

    def run_time(self, name: str, batch: int, context: int, max_new_tokens: int, tokens_per_round: float) -> float:
        """Expected ms of a run of `max_new_tokens`: the call, then (max_new_tokens - 1) / tokens_per_round rounds
        (the prefill emits the first token)."""
        rounds = max(max_new_tokens - 1, 0) / tokens_per_round
        return self.call_time(name, batch, context) + rounds * self.round_time(name, batch, context)

    def choose(self, batch: int, context: int, max_new_tokens: int, acceptance: Mapping[str, float]) -> Choice:
        """The candidate with the highest expected rate batch x max_new_tokens / `run_time` (the first in table
        order on a tie), unless the table has `ar` and that rate is no more than `AR_MARGIN` above ar's: then ar.
        `acceptance`: tokens per round by candidate name. The Choice holds the plain expected rates."""
        rates = {
            n: batch * max_new_tokens / self.run_time(n, batch, context, max_new_tokens, acceptance[n]) * 1e3
            for n in self.round_ms
        }
        best = max(rates, key=rates.__getitem__)
        if "ar" in rates and rates[best] <= (1 + AR_MARGIN) * rates["ar"]:
            best = "ar"
        return Choice(Candidate.parse(best), batch, context, rates, FROM_TABLE)

    def check(self, device_kind: str, device_count: int, dtype: str, exact: bool) -> None:
        """A `UserError` unless the table was measured on this device kind and count, in this dtype and with the
        exact numerics on or off as here."""
        measured = (self.device_kind, self.device_count, self.dtype, self.exact)
        if measured != (device_kind, device_count, dtype, exact):
            where = f"{self.source}: " if self.source else ""
            numerics = {True: ", exact", False: ""}
            raise UserError(
                f"{where}cost table measured on {self.device_count} x {self.device_kind} in {self.dtype}"
                f"{numerics[self.exact]}, but this run is on {device_count} x {device_kind} in {dtype}"
                f"{numerics[exact]}: run ddtree-calibrate on this machine with the same settings"
            )

    def to_json(self) -> dict[str, Any]:
        per_candidate = ("round_ms", "call_ms", "tokens_per_round")
        head = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in per_candidate}
        del head["source"]
        cands = {n: {k: getattr(self, k)[n] for k in per_candidate} for n in self.round_ms}
        return {"format": FORMAT, **head, "candidates": cands}

    def save(self, path: str | Path) -> None:
        """Write the table as JSON, atomically (no partial file)."""
        atomic_write(Path(path), (json.dumps(self.to_json(), indent=1) + "\n").encode())

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """Read a table written by `save` (or in the previous format, whose one acceptance per candidate then holds
        at every grid point); a `UserError` naming the file when it is missing or malformed."""
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
            if raw.get("format") not in (FORMAT, FORMAT_POOLED):
                raise ValueError(f"not a cost table (format {raw.get('format')!r}, want {FORMAT!r})")
            cands = raw.pop("candidates")
            del raw["format"]
            return cls(
                **raw
                | {
                    "batches": tuple(raw["batches"]),
                    "contexts": tuple(raw["contexts"]),
                    **{k: {n: c[k] for n, c in cands.items()} for k in ("round_ms", "call_ms", "tokens_per_round")},
                    "source": str(p),
                }
            )
        except FileNotFoundError:
            raise UserError(f"{p}: no cost table there (ddtree-calibrate writes one)") from None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise UserError(f"{p}: malformed cost table ({type(e).__name__}: {e})") from None


class Acceptance:
    """Tokens per round as `auto` expects them: the table's at the batch's grid position, with each drafting
    candidate's drafted part (the tokens past the one every round commits) scaled by one factor for the content
    served so far, the drafted tokens the observed rounds committed over what the table expected of those rounds
    where they ran. The table counts as `acceptance_rounds` rounds at its own mean acceptance, so the factor moves as
    the served rounds outweigh the table's. One factor for all candidates and grid points: whichever ran, its rounds
    say how hard the prompts are for every drafting candidate alike."""

    def __init__(self, table: CostTable):
        self._table = table
        drafting = [c.name for c in table.candidates if c.method != "ar"]
        drafted = [t - 1 for n in drafting for row in table.tokens_per_round[n] for t in row]
        prior = table.acceptance_rounds * (sum(drafted) / len(drafted) if drafted else 0.0)
        self._seen = self._expected = prior  # drafted tokens: committed past one per round / the table's for them

    def observe(self, name: str, committed: float, rounds: int, batch: int, context: int) -> None:
        """A batch of `batch` rows whose longest prompt has `context` tokens ran candidate `name` and committed
        `committed` tokens in `rounds` rounds (summed over rows)."""
        expected = self._table.acceptance(batch, context)[name] - 1
        if expected > 0:  # ar (1 everywhere), or a point where the table saw no draft accepted, says nothing
            self._seen += committed - rounds
            self._expected += expected * rounds

    @property
    def factor(self) -> float:
        """Drafted tokens committed so far over the table's expectation for them (1 before any batch)."""
        return self._seen / self._expected if self._expected > 0 else 1.0

    def means(self, batch: int, context: int) -> dict[str, float]:
        """Each candidate's expected tokens per round for a batch of `batch` rows at `context` tokens."""
        f = self.factor
        return {n: 1 + f * (t - 1) for n, t in self._table.acceptance(batch, context).items()}
