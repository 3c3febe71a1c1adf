"""The local machine against a memory plan: its devices and their memory, and the `--mesh` and
`XLA_PYTHON_CLIENT_MEM_FRACTION` that make a run fit on them (`ddtree-inspect`)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ddtree_jax import memory
from ddtree_jax.config import DFlashConfig, KimiConfig
from ddtree_jax.mesh_spec import MESH_AXES

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_MEM_FRACTION = 0.75  # XLA's share of each GPU when MEM_FRACTION_ENV is unset
MAX_MEM_FRACTION = 0.95  # the most to give XLA: the CUDA context and libraries need the rest of the card
FRACTION_STEP = 0.05  # suggested fractions are rounded up to a multiple of this


@dataclasses.dataclass(frozen=True)
class Devices:
    """The local devices: `limit_bytes` is the memory XLA may use on each (the least over devices), None where
    the backend reports none (CPU); `mem_fraction` the share of a GPU that limit is (MEM_FRACTION_ENV)."""

    count: int
    platform: str
    kind: str
    limit_bytes: int | None
    mem_fraction: float

    @property
    def accelerator(self) -> bool:
        return self.platform != "cpu"

    @property
    def card_bytes(self) -> int | None:
        """A device's whole memory, as XLA's limit over the fraction in effect."""
        return None if self.limit_bytes is None else round(self.limit_bytes / self.mem_fraction)


def mem_fraction_in_effect() -> float:
    value = os.environ.get(MEM_FRACTION_ENV)
    try:
        return float(value) if value else DEFAULT_MEM_FRACTION
    except ValueError:
        return DEFAULT_MEM_FRACTION  # XLA itself rejects it when it starts


def local_devices() -> Devices:
    """Describe `jax.local_devices()` without reserving their memory (XLA_PYTHON_CLIENT_PREALLOCATE=false
    unless set)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    devs = jax.local_devices()
    stats = [d.memory_stats() or {} for d in devs]
    limits = [s.get("bytes_limit") for s in stats]
    limit = None if None in limits else min(limits)
    return Devices(len(devs), devs[0].platform, devs[0].device_kind, limit, mem_fraction_in_effect())


def layouts(n: int, target: KimiConfig) -> list[memory.Layout]:
    """Every `data x expert x tensor = n` layout the model's split dims allow (heads and vocab over `tensor`,
    routed experts over `expert x tensor`), the engine's default (all on `expert`) first."""
    out = []
    for tensor in range(1, n + 1):
        for expert in range(1, n // tensor + 1):
            data, rest = divmod(n, tensor * expert)
            splits = (target.num_attention_heads, target.vocab_size, target.n_routed_experts)
            if rest or splits[0] % tensor or splits[1] % tensor or splits[2] % (expert * tensor):
                continue
            out.append(memory.Layout(data=data, expert=expert, tensor=tensor))
    default = memory.Layout(expert=n)
    return sorted(out, key=lambda lay: lay != default)


def mesh_spec(layout: memory.Layout) -> str:
    """The `--mesh` string of `layout` (axes of size 1 left out, `expert=1` when all are)."""
    parts = [f"{axis}={getattr(layout, axis)}" for axis in MESH_AXES if getattr(layout, axis) > 1]
    return ",".join(parts) or "expert=1"


def needed_fraction(total_bytes: int, card_bytes: int) -> float:
    """The XLA memory fraction (a multiple of FRACTION_STEP) that holds `total_bytes` of a `card_bytes` card."""
    steps = math.ceil(round(total_bytes / card_bytes / FRACTION_STEP, 6))
    return round(steps * FRACTION_STEP, 2)


def advise(
    devices: Devices, target: KimiConfig, drafter: DFlashConfig | None, *, mesh: str | None, **plan_kw: Any
) -> dict[str, Any]:
    """Whether the `memory.plan` (arguments in `plan_kw`) fits these devices, with the mesh and the memory fraction
    it needs.

    mesh: the user's `--mesh` (checked as given); None: the engine's default layout if it fits, else the layout
    that needs the least memory per device. Keys: fits, mesh, total_bytes (per device), mem_fraction (None: the
    fraction in effect is enough) and that layout's plan; only `fits: None` on a CPU, or a device that reports no
    memory (nothing to check); for a `mesh` of another device count, `fits: False` and the problem.
    """
    if not devices.accelerator or devices.card_bytes is None:
        return {"fits": None}
    if plan_kw.get("exact") and devices.count > 1:
        return {"fits": False, "mesh": mesh, "problem": f"the exact numerics run on one device, not {devices.count}"}
    if mesh is not None:
        layout = memory.Layout.from_spec(mesh)
        if layout.data * layout.expert * layout.tensor != devices.count:
            return {"fits": False, "mesh": mesh, "problem": f"--mesh {mesh} is not {devices.count} devices"}
        candidates = [layout]
    else:
        candidates = layouts(devices.count, target)
    card = devices.card_bytes
    plans = [memory.plan(target, drafter, layout=lay, **plan_kw) for lay in candidates]
    best = plans[0] if plans[0].total <= MAX_MEM_FRACTION * card else min(plans, key=lambda p: p.total)
    return {
        "fits": best.total <= MAX_MEM_FRACTION * card,
        "mesh": mesh_spec(best.layout),
        "total_bytes": best.total,
        "mem_fraction": None
        if best.total <= devices.limit_bytes
        else min(needed_fraction(best.total, card), MAX_MEM_FRACTION),
        "plan": best.to_dict(),
    }


def report(
    devices: Devices, target: KimiConfig, drafter: DFlashConfig | None, *, mesh: str | None, **run: Any
) -> dict[str, Any]:
    """`devices` and `advise` for the run `run` (`memory.plan` arguments but the layout) as one JSON-ready dict."""
    described = {
        "devices": devices.count,
        "platform": devices.platform,
        "kind": devices.kind,
        "device_limit_bytes": devices.limit_bytes,
        "device_bytes": devices.card_bytes,
        "mem_fraction_in_effect": devices.mem_fraction if devices.accelerator else None,
        "run": run,
    }
    return described | advise(devices, target, drafter, mesh=mesh, **run)


def report_text(r: dict[str, Any]) -> list[str]:
    """`report(...)` for a person: the devices, then whether the run fits and with which settings."""
    b, indent = memory.fmt_bytes, " " * 16
    if r["fits"] is None and r["platform"] == "cpu":
        return [f"this machine    no accelerator ({r['devices']} cpu device): no memory plan to check"]
    if r["fits"] is None:
        return [f"this machine    {r['devices']} x {r['kind']}: reports no memory, no memory plan to check"]
    head = (
        f"this machine    {r['devices']} x {r['kind']}, {b(r['device_bytes'])} each (XLA may use "
        f"{b(r['device_limit_bytes'])} at {MEM_FRACTION_ENV}={r['mem_fraction_in_effect']:g})"
    )
    run = r["run"]
    what = f"batch {run['batch']} x {run['max_len']} tokens ({run['method']})"
    if "problem" in r:
        return [head, f"{indent}{what}: {r['problem']}"]
    if not r["fits"]:
        return [
            head,
            f"{indent}{what} does not fit: it needs {b(r['total_bytes'])} per device even with --mesh={r['mesh']} "
            f"and {MEM_FRACTION_ENV}={MAX_MEM_FRACTION:g} (more devices, a smaller batch or a shorter context)",
        ]
    setting = "as it is" if r["mem_fraction"] is None else f"with {MEM_FRACTION_ENV}={r['mem_fraction']:g}"
    return [head, f"{indent}{what} fits {setting}: --mesh={r['mesh']}, {b(r['total_bytes'])} per device"]
