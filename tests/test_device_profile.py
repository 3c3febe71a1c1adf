"""experiments/device_profile.py: joining profiler events to HLO scopes, on a hand-written module and trace."""

from __future__ import annotations

import gzip
import json

import pytest

from experiments import device_profile

HLO = """HloModule jit_run, entry_computation_layout={()->f32[]}

%body (p: f32[]) -> f32[] {
  %fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, calls=%f3, metadata={op_name="jit(run)/while/body/tree/sort"}
  ROOT %custom-call.7 = f32[4]{0} custom-call(%x), metadata={op_name="jit(run)/while/body/verify/pallas_call"}
}

ENTRY %main () -> f32[] {
  %copy.1 = f32[4]{0} copy(%y)
  %fusion = f32[4]{0} fusion(%z), kind=kLoop, metadata={op_name="jit(run)/prefill/while/body/dot_general"}
}
"""


def test_scope_of_ops_reads_the_named_scopes():
    scopes = device_profile.scope_of_ops(HLO, ("prefill", "tree", "verify"))
    assert scopes == {"fusion.3": "tree", "custom-call.7": "verify", "fusion": "prefill"}  # copy.1: no metadata
    assert device_profile.module_name(HLO) == "jit_run"
    with pytest.raises(ValueError):
        device_profile.module_name("not hlo")


def test_device_events_are_attributed_once(tmp_path):
    def x(pid, ts, dur, op, module="jit_run"):
        return {
            "ph": "X",
            "pid": pid,
            "tid": 1,
            "ts": ts,
            "dur": dur,
            "name": op,
            "args": {"hlo_op": op, "hlo_module": module},
        }

    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        x(1, 0, 50, "fusion.3"),  # host-side event: ignored when the trace has device events
        x(2, 0, 10, "fusion.3"),
        x(2, 10, 5, "fusion.3"),
        x(2, 20, 30, "custom-call.7"),
        x(2, 60, 7, "copy.1"),
        x(2, 70, 100, "fusion.3", module="jit_other"),  # another program
        x(2, 200, 100, "while.1"),  # encloses the next kernel on its stream: not counted
        x(2, 210, 4, "custom-call.7"),
        {**x(2, 300, 2, "command_buffer"), "name": "fusion_3"},  # a kernel launched from a command buffer
        x(2, 310, 1, "command_buffer"),  # a graph kernel naming no instruction: the scope of the one before (tree)
        # a CUDA graph's kernels, stamped overlapping by a fraction of a microsecond: both count
        {**x(2, 400, 3, "command_buffer_5"), "name": "fusion_3"},
        {**x(2, 402.9, 3, "command_buffer_5"), "name": "custom_call_7"},
        {**x(2, 406, 6, "command_buffer_5"), "name": "mla_attention"},  # after a verify kernel: verify
    ]
    (tmp_path / "p").mkdir()
    with gzip.open(tmp_path / "p" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    ops = device_profile.op_events(device_profile.load_trace(tmp_path), "jit_run")
    per = device_profile.per_scope(ops, device_profile.scope_of_ops(HLO, ("prefill", "tree", "verify")))
    assert per == {"tree": (21.0, 5), "verify": (43.0, 4), "other": (7.0, 1)}
    scopes = device_profile.scope_of_ops(HLO, ("prefill", "tree", "verify"))
    assert device_profile.unattributed(ops, scopes) == [
        "copy.1/copy.1 x1",
        "command_buffer/command_buffer x1",
        "command_buffer_5/mla_attention x1",
    ]
    top = device_profile.costliest(ops, scopes, n=3)
    assert top == [("verify:custom-call.7", 34.0, 2), ("tree:fusion.3", 15.0, 2), ("other:copy.1", 7.0, 1)]
    assert device_profile.costliest(ops, scopes, prefill=True) == []  # this trace ran no prefill
