"""Attribute the device time of one compiled program to the engine's named scopes, from a `jax.profiler` trace.

The engine wraps each piece of a round in `jax.named_scope` (draft / tree / verify / accept; `step` for AR;
`prefill`), which XLA keeps in every instruction's `metadata={op_name=".../verify/..."}`. A profile's device events
name the instruction they ran (`args.hlo_op`), so joining the two gives device time and kernel count per scope.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name=\"([^\"]*)\"")


def module_name(hlo_text: str) -> str:
    """'HloModule jit_run, ...' -> 'jit_run'."""
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    if m is None:
        raise ValueError("not an HLO module dump")
    return m.group(1)


def op_paths(hlo_text: str) -> dict[str, list[str]]:
    """{instruction name: its op_name path split at '/'} for every instruction of the compiled module's text
    (`compiled.as_text()`) that carries an op_name, e.g. ['jit(run)', 'while', 'body', 'verify', 'dot_general']."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            out[m.group(1)] = m.group(2).split("/")
    return out


def scope_of_ops(hlo_text: str, scopes: tuple[str, ...]) -> dict[str, str]:
    """{instruction name: first of `scopes` found in its op_name path, else 'other'} for every instruction of the
    compiled module's text (`compiled.as_text()`)."""
    return {op: next((p for p in parts if p in scopes), "other") for op, parts in op_paths(hlo_text).items()}


def load_trace(trace_dir: str | Path) -> list[dict]:
    """The complete ('X') events of the newest perfetto trace under `trace_dir`, with their process names."""
    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [{**e, "process": procs.get(e.get("pid"), "")} for e in events if e.get("ph") == "X"]


def profiled_ops(run: Callable[[], object], hlo_text: str) -> list[tuple[str, str, float]]:
    """`op_events` of the module `hlo_text` (its compiled text) from one call of `run()` (which runs it and blocks
    on the result) under `jax.profiler`; a RuntimeError naming the costliest device events if none ran."""
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        run()
        jax.profiler.stop_trace()
        events = load_trace(tmp)
    ops = op_events(events, module_name(hlo_text))
    if not ops:
        sample = next((e.get("args", {}) for e in events if e["process"].startswith("/device:")), {})
        raise RuntimeError(
            f"the profile holds no ops of the program; costliest device events "
            f"{top_device_events(events, 5)}, a device event's args {sample}"
        )
    return ops


def op_events(events: list[dict], module: str) -> list[tuple[str, str, float]]:
    """(instruction, event name, microseconds) of every op of `module` that ran: the GPU's kernels when the trace
    has a '/device:' process (a GPU run), else the CPU runtime's per-op events. Events naming no module are kept."""

    def ours(e: dict) -> bool:
        args = e.get("args", {})
        return "hlo_op" in args and args.get("hlo_module", module) == module

    device = [e for e in events if e["process"].startswith("/device:")]
    picked = _leaves([e for e in (device or events) if ours(e)])
    return [(e["args"]["hlo_op"], e.get("name", ""), float(e["dur"])) for e in picked]


def _leaves(events: list[dict]) -> list[dict]:
    """Drop events that enclose another event of their thread (a CPU while-loop thunk around its body's ops), so
    nothing is counted twice. Merely overlapping neighbours are both kept: a CUDA graph's kernels on one stream are
    stamped overlapping by a fraction of a microsecond."""
    by_thread: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        for e, nxt in zip(evs, evs[1:] + [None], strict=True):
            end = float(e["ts"]) + float(e["dur"])
            if nxt is None or float(nxt["ts"]) >= end or float(nxt["ts"]) + float(nxt["dur"]) > end:
                out.append(e)
    return out


def top_device_events(events: list[dict], n: int = 15) -> list[tuple[str, float, int]]:
    """(name, total microseconds, count) of the `n` costliest event names on '/device:' processes, whatever
    their arguments: a fallback view when a trace's kernels carry no instruction names."""
    return _ranked(_totals((e["name"], float(e["dur"])) for e in events if e["process"].startswith("/device:")), n)


def _kernel_name(instruction: str) -> str:
    """XLA GPU names a fusion's kernel after the instruction with '.' and '-' as '_' (fusion.3 -> fusion_3)."""
    return re.sub(r"[.\-]", "_", instruction)


def per_scope(ops: list[tuple[str, str, float]], scope_map: dict[str, str]) -> dict[str, tuple[float, int]]:
    """{scope: (total microseconds, op count)} of `ops` in launch order. An op is looked up by its instruction, then
    by its kernel name (a kernel launched from a command buffer names the buffer as its instruction), then (graph
    kernels only) by its predecessor; other unknown ops count as 'other'."""
    return _totals((scope, us) for scope, _, us in _scoped(ops, scope_map))


def costliest(
    ops: list[tuple[str, str, float]], scope_map: dict[str, str], n: int = 12, *, prefill: bool = False
) -> list[tuple[str, float, int]]:
    """The `n` kernels of the most device time outside the prefill (or, with `prefill`, inside it): ("scope:kernel",
    total microseconds, count)."""
    scoped = _scoped(ops, scope_map)
    return _ranked(_totals((f"{s}:{name}", us) for s, name, us in scoped if (s == "prefill") == prefill), n)


def _scoped(ops: list[tuple[str, str, float]], scope_map: dict[str, str]):
    """(scope, kernel name, microseconds) per op, placed as `per_scope` says. A kernel launched from a command buffer
    that names no instruction (a Pallas/Mosaic custom call's kernel is named after the kernel, not the call) takes
    the scope of the kernel before it: a CUDA graph runs the instructions in program order."""
    by_kernel = {_kernel_name(k): v for k, v in scope_map.items()}
    prev = "other"
    for op, name, us in ops:
        scope = scope_map.get(op) or by_kernel.get(_kernel_name(name))
        if scope is None:
            scope = prev if op.startswith("command_buffer") else "other"
        prev = scope
        yield scope, name, us


def _totals(pairs) -> dict[str, tuple[float, int]]:
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for key, us in pairs:
        acc[key][0] += us
        acc[key][1] += 1
    return {k: (v[0], int(v[1])) for k, v in acc.items()}


def _ranked(totals: dict[str, tuple[float, int]], n: int) -> list[tuple[str, float, int]]:
    """The `n` keys of most microseconds: (key, microseconds, count)."""
    return [(k, us, c) for k, (us, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]]


def unattributed(ops: list[tuple[str, str, float]], scope_map: dict[str, str], n: int = 8) -> list[str]:
    """The `n` most frequent 'instruction/kernel' pairs that name no instruction of the program (for diagnosis;
    `per_scope` places the graph kernels among them by their predecessor)."""
    by_kernel = {_kernel_name(k) for k in scope_map}
    misses = collections.Counter(
        f"{op}/{name}" for op, name, _ in ops if op not in scope_map and _kernel_name(name) not in by_kernel
    )
    return [f"{k} x{c}" for k, c in misses.most_common(n)]
