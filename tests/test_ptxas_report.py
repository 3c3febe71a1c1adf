"""experiments/ptxas_report.py without its 400 MB CUDA plugin: reading ptxas logs, capturing the kernel's module."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree_jax.errors import UserError
from experiments import ptxas_report
from experiments.mla_common import parse_tiling

# Abridged from an H200 ptxas log of a kernel variant whose wgmmas ptxas serialised.
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


@pytest.mark.parametrize("tiling", ["", "num_stages=1"])
def test_one_mosaic_module_per_call(tiling: str):
    """Lowering one call for CUDA on CPU registers exactly one serialised Mosaic module; tilings differ in it."""
    rng = np.random.default_rng(1)
    context = int(rng.integers(100, 3000))
    (module,) = ptxas_report.mosaic_modules((context, 1, 2, 64), parse_tiling(tiling))
    (other,) = ptxas_report.mosaic_modules((context, 1, 2, 64), parse_tiling("compute_registers=232"))
    assert isinstance(module, bytes) and len(module) > 1000 and module != other


def sass(lines: list[str]) -> str:
    """nvdisasm-style text: `.L_x_N:` labels at column 0, numbered instructions indented."""
    out, address = ["\t.text.anonymous_mosaic_gpu_kernel:"], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{address:04x}*/                   {line} ;")
            address += 16
    return "\n".join(out)


# Loops A (3 instructions, 1 HGMMA, an STL), B (8, 2 HGMMAs, an LDL, holding a polling loop without wgmmas) and
# C (2) inside the outer loop D; a spill after D and one after the EXIT; polling stubs after the EXIT that branch
# back into B (not loops).
KERNEL = [
    "MOV R1, c[0x0][0x28]",
    ".L_x_1:", "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", "STL [R1], R2", "@P0 BRA `(.L_x_1)",
    ".L_x_2:", "LDL R3, [R1+0x4]", "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24",
    "HGMMA.64x256x16.F32.BF16 R88, R4, gdesc[UR8], R88",
    ".L_x_3:", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8+0x10], R5", "@!P1 BRA `(.L_x_9)",
    ".L_x_10:", "FADD R4, R4, R4", "@P3 BRA `(.L_x_10)",
    "@P2 BRA `(.L_x_2)",
    ".L_x_4:", "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", "@P4 BRA `(.L_x_4)",
    "@P5 BRA `(.L_x_1)",
    "STL [R1+0x8], R7",
    "EXIT",
    ".L_x_9:", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8+0x10], R5", "@!P1 BRA `(.L_x_9)", "BRA `(.L_x_3)",
    "LDL R9, [R1+0x8]",
    ".L_x_5:", "BRA `(.L_x_5)",
]  # fmt: skip


def test_sass_loops_finds_the_innermost_wgmma_loops_and_their_spills():
    assert ptxas_report.sass_loops(sass(KERNEL)) == {
        "tile_loops": 3,
        "tile_instrs_min": 2,
        "tile_instrs_max": 8,
        "hgmma_per_tile": 2,
        "tile_spill_instrs": 2,
        "spill_instrs": 4,
    }
    # A wgmma at a wait whose only way back is a polling stub after the EXIT: no loop.
    stub = [".L_x_1:", "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], RZ", "@!P1 BRA `(.L_x_9)", "EXIT", ".L_x_9:"]
    stub += ["@P1 BRA `(.L_x_1)"]
    assert ptxas_report.sass_loops(sass(stub))["tile_loops"] == 0
    with pytest.raises(UserError, match="no EXIT"):
        ptxas_report.sass_loops(sass(KERNEL[:-9]))
