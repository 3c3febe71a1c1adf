"""experiments.mla_schedule against a listing of the work, cell by cell, and its one-line errors. Through the
command line only: the module defines absl flags that other experiment modules imported by the tests define too."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest


def run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.mla_schedule", f"--out_dir={tmp_path}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def listing(tiles: int, row_blocks: int, splits: int, per_cta: int, overhead: int) -> dict[str, int]:
    """Both schedules from lists of units: the grid's CTAs and waves on 132 SMs and its total tiles, persistent
    ranges of per_cta units."""
    per_split = -(-tiles // splits)
    ctas = [min(per_split, max(0, tiles - s * per_split)) for s in range(splits) for _ in range(row_blocks)]
    units = [(r, t) for r in range(row_blocks) for t in range(tiles)]
    ranges = [units[i : i + per_cta] for i in range(0, len(units), per_cta)]
    segments = [len({r for r, _ in chunk}) for chunk in ranges]
    return {
        "grid_ctas": len(ctas),
        "grid_waves": -(-len(ctas) // 132),
        "grid_tiles": sum(ctas),
        "pers_busy_ctas": len(ranges),
        "pers_max_segments": max(segments),
        "pers_makespan": max(len(c) + overhead * s for c, s in zip(ranges, segments, strict=True)),
    }


def test_cells_match_a_listing(tmp_path):
    """Fresh random cells: CTA, wave and segment counts and the persistent makespan as a listing gives them; the
    grid's tiles add up to every row block's tiles; the 17-node 8-sequence cell is the one wave-bound case."""
    rng = random.Random()
    cells = [(rng.choice([700, 4096, 9000]), rng.choice([1, 5, 17]), rng.randint(1, 9), rng.choice([8, 64]))]
    cells += [(8192, 17, 8, 64)]
    overhead = rng.randint(0, 3)
    cli = ",".join("/".join(map(str, c)) for c in cells)
    proc = run_cli(tmp_path, f"--cells={cli}", f"--overhead_tiles={overhead}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads((tmp_path / "mla_schedule.json").read_text())["records"]
    for (context, nodes, batch, heads), rec in zip(cells, records, strict=True):
        tiles, row_blocks = -(-(context + nodes) // 64), batch * -(-(nodes * heads) // 64)
        assert (rec["tiles"], rec["row_blocks"]) == (tiles, row_blocks)
        want = listing(tiles, row_blocks, rec["grid_splits"], rec["pers_per_cta"], overhead)
        assert rec["grid_ctas"] == want["grid_ctas"] and rec["grid_waves"] == want["grid_waves"]
        assert rec["grid_max_tiles"] * 132 >= want["grid_tiles"] == tiles * row_blocks
        for key in ("pers_busy_ctas", "pers_max_segments", "pers_makespan"):
            assert rec[key] == want[key], (key, rec)
    wave_bound = records[-1]
    assert (wave_bound["grid_ctas"], wave_bound["grid_waves"]) == (680, 6)  # 5 splits of 136 CTAs
    assert wave_bound["pers_makespan"] < wave_bound["grid_makespan"]


@pytest.mark.parametrize(
    "args, says", [(["--cells=8192/17/8"], "context/nodes/batch/heads"), (["--sms=100"], "--sms=100")]
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, says):
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2 and says in proc.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())
