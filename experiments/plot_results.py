"""PNG plots of the training curves and the acceptance histogram in experiments/results/.

    python -m experiments.plot_results

train_target_loss.json -> train_target_loss.png; every drafter stage train_dflash*_loss.json (train_dflash.py and
selfdistill_dflash.py runs, e.g. train_dflash_stage2_loss.json) -> the same name .png, with the held-out points when
the run has them; acceptance.json -> acceptance_hist.png (rounds committing k tokens, per method, as fractions of
rounds). The JSON files are written by train_target.py, train_dflash.py, selfdistill_dflash.py and eval_acceptance.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib
from absl import flags

from ddtree_jax.errors import run_app

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("results_dir", "experiments/results", "Where the JSON files are and the PNGs go.")


def plot_curve(src: Path, title: str, extra: str) -> None:
    d = json.loads(src.read_text())
    steps = [p["step"] for p in d["curve"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [p["loss"] for p in d["curve"]], label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax2 = ax.twinx()
    ax2.plot(steps, [p[extra] for p in d["curve"]], color="tab:orange", alpha=0.6, label=extra)
    if d.get("val_curve"):
        val = d["val_curve"]
        ax2.plot([p["step"] for p in val], [p[extra] for p in val], "o-", color="tab:red", label=f"held-out {extra}")
    ax2.set_ylabel(extra)
    ax.set_title(title, fontsize=10)
    fig.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(src.with_suffix(".png"), dpi=120)
    plt.close(fig)


def plot_acceptance(src: Path) -> None:
    hists = {k: v for k, v in json.loads(src.read_text())["accept_hist"].items() if v}
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(hists)
    for i, (name, h) in enumerate(hists.items()):
        total = sum(h)
        ax.bar([k + 1 + (i - len(hists) / 2) * width for k in range(len(h))], [c / total for c in h], width, label=name)
    ax.set_xlabel("tokens committed in a round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("Acceptance on held-out prompts (temperature 0)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(src.parent / "acceptance_hist.png", dpi=120)
    plt.close(fig)


def main(argv: Sequence[str]) -> None:
    del argv
    d = Path(FLAGS.results_dir)
    plot_curve(d / "train_target_loss.json", "Kimi-mini target (MoE load: max/mean)", "load_max_over_mean")
    for src in sorted(d.glob("train_dflash*_loss.json")):
        kind = "self-distillation on the target's greedy text" if "selfdistill" in src.name else "corpus training"
        device = json.loads(src.read_text())["meta"]["device"]
        plot_curve(src, f"DFlash drafter, {kind}\n{src.stem}, {device}", "top1_agree_pos1")
    plot_acceptance(d / "acceptance.json")


if __name__ == "__main__":
    run_app(main)
