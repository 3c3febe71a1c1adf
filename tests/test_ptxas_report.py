"""experiments/ptxas_report.py without its 400 MB CUDA plugin: reading ptxas logs, capturing the kernel's module."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree_jax.errors import UserError
from experiments import ptxas_report
from experiments.mla_common import parse_tiling

# Abridged from profiles/ptxas_overlap.txt (the H200's own ptxas on the overlapped kernel at cf66603).
SERIALISED = """ptxas info    : (C7519) warpgroup.arrive is injected in around line 1613 by compiler to allow use of registers
ptxas info    : (C7519) warpgroup.arrive is injected in around line 2505 by compiler to allow use of registers
ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma
ptxas warning : Registers are spilled to local memory in function 'anonymous_mosaic_gpu_kernel', 184 bytes spill stores, 268 bytes spill loads
    64 bytes stack frame, 184 bytes spill stores, 268 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 64 bytes cumulative stack size, 1 bytes smem
"""  # noqa: E501


def test_summarize_reads_serialisation_fences_and_spills():
    assert ptxas_report.summarize(SERIALISED) == {
        "serialized": True,
        "injected_fences": 2,
        "spill_stores": 184,
        "spill_loads": 268,
        "registers": 168,
    }
    clean = "\n".join(line for line in SERIALISED.splitlines() if "C75" not in line).replace("184", "16")
    assert ptxas_report.summarize(clean)["serialized"] is False and ptxas_report.summarize(clean)["spill_stores"] == 16
    with pytest.raises(UserError, match="no resource usage"):
        ptxas_report.summarize("ptxas fatal   : Unresolved extern function 'f'")


@pytest.mark.parametrize("tiling", ["", "overlap=true"])
def test_one_mosaic_module_per_call(tiling: str):
    """Lowering one call for CUDA on CPU registers exactly one serialised Mosaic module; tilings differ in it."""
    rng = np.random.default_rng()
    context = int(rng.integers(100, 3000))
    (module,) = ptxas_report.mosaic_modules((context, 1, 2, 64), parse_tiling(tiling))
    (other,) = ptxas_report.mosaic_modules((context, 1, 2, 64), parse_tiling("softmax=duplicate"))
    assert isinstance(module, bytes) and len(module) > 1000 and module != other
