"""Where the Mosaic MLA kernel's warps stall, from Nsight Compute's source page (`ncu -i REPORT --page source --csv
--print-source sass`, written by `run_gpu_matrix.sh STAGES=mla_profile` as profiles/ncu_mla_source.csv.gz).

The page lists every SASS instruction of each profiled kernel with its sampled warp stalls. The memory warpgroup's
code is the tail of the kernel, from its register-releasing `setmaxnreg` (`USETMAXREG.DEALLOC`) on; everything
before it is the two compute warpgroups (and the prologue they share). A kernel without that instruction (a
Pallas-Triton kernel, such as the drafter's) is all "compute". Per kernel the record gives the samples of each part,
the compute part's shares by stall reason and by opcode, and its most-sampled instructions (#: the instruction's
index in the kernel).

    .venv/bin/python -m experiments.ncu_stalls --csv=experiments/results/profiles/ncu_mla_source.csv.gz
    (the drafter's: --csv=experiments/results/profiles/ncu_drafter_source.csv.gz, --labels one per kernel profiled,
    --name=ncu_drafter_stalls; PROVENANCE gives the labels)
"""

from __future__ import annotations

import csv
import gzip
import io
from collections import Counter
from pathlib import Path

from absl import app, flags

from ddtree_jax.errors import UserError, cli_main
from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("csv", "experiments/results/profiles/ncu_mla_source.csv.gz", "the source page (.csv or .csv.gz)")
flags.DEFINE_list(
    "labels", ["8192/1/32/64", "8192/17/8/64"], "what each profiled kernel was, in order (run_gpu_matrix's cells)"
)
flags.DEFINE_integer("top", 8, "most-sampled compute instructions listed per kernel")
flags.DEFINE_string("out_dir", None, "results folder (default experiments/results)")
flags.DEFINE_string("name", "ncu_mla_stalls", "record name")

SAMPLES = "Warp Stall Sampling (All Samples)"
MEMORY_START = "USETMAXREG.DEALLOC"


def read_kernels(text: str) -> list[list[dict[str, str]]]:
    """The page's kernels, each a list of instruction rows (column name -> value); a UserError if none parse."""
    kernels = []
    for block in text.split('"Kernel Name"')[1:]:
        rows = list(csv.reader(io.StringIO(block.split("\n", 1)[1])))
        header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
        kernels.append([dict(zip(header, r, strict=True)) for r in body])
    if not kernels or not all(k and SAMPLES in k[0] and "Source" in k[0] for k in kernels):
        raise UserError(f"--csv: no kernel with a {SAMPLES!r} column (not an ncu --page source --csv file?)")
    return kernels


def opcode(source: str) -> str:
    """'@!P1  BRA 0x7f..' -> 'BRA'; 'WARPGROUP.DEPBAR.LE gsb0, 0x0' -> 'WARPGROUP.DEPBAR'."""
    words = source.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return ".".join(op.split(".")[:2]) if op.startswith("WARPGROUP") else op.split(".")[0]


def summarise(label: str, rows: list[dict[str, str]], top: int) -> dict:
    """One kernel's record: samples of the compute and memory parts, the compute part's top stall reasons,
    opcodes and instructions (shares of its samples, in %)."""
    start = next((i for i, r in enumerate(rows) if MEMORY_START in r["Source"]), len(rows))
    compute, memory = rows[:start], rows[start:]
    total = sum(int(r[SAMPLES]) for r in compute)
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    by_reason = Counter({c[len("stall_") :]: sum(int(r[c]) for r in compute) for c in reasons})
    by_op: Counter = Counter()
    for r in compute:
        by_op[opcode(r["Source"])] += int(r[SAMPLES])
    pct = lambda n: round(100.0 * n / max(total, 1), 1)
    ranked = sorted(range(len(compute)), key=lambda i: -int(compute[i][SAMPLES]))[:top]
    return {
        "kernel": label,
        "instructions": len(rows),
        "compute_samples": total,
        "memory_samples": sum(int(r[SAMPLES]) for r in memory),
        "reasons_%": ", ".join(f"{k} {pct(v)}" for k, v in by_reason.most_common(6)),
        "opcodes_%": ", ".join(f"{k} {pct(v)}" for k, v in by_op.most_common(8)),
        "top_%": "; ".join(f"#{i} {compute[i]['Source'].strip()[:32]} {pct(int(compute[i][SAMPLES]))}" for i in ranked),
    }


@cli_main
def main(argv: list[str]) -> None:
    del argv
    path = Path(FLAGS.csv)
    if not path.is_file():
        raise UserError(f"--csv: {path} is not a file")
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode()
    kernels = read_kernels(text)
    if len(kernels) != len(FLAGS.labels):
        raise UserError(f"--labels: {len(FLAGS.labels)} labels for {len(kernels)} profiled kernels")
    records = [summarise(label, rows, FLAGS.top) for label, rows in zip(FLAGS.labels, kernels, strict=True)]
    columns = list(records[0])
    out = common.write_results(FLAGS.name, records, columns, FLAGS.out_dir, extra={"profile": str(path)})
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
