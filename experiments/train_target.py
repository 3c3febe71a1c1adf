"""Train a small Kimi K2.6-architecture target on the Python standard library and ship it as an HF checkpoint.

    python -m experiments.train_target --stage=data     # CPU: file list, BPE tokenizer, token .npy, manifest
    python -m experiments.train_target --stage=train    # GPU: train, export INT4 HF checkpoint + loss curve

Stage `data` lists the running interpreter's standard library `.py` files (sorted; no tests, site-packages,
idlelib, turtledemo, ensurepip, lib2to3), holds out the files whose path hash is 0 mod 50 (~2%) for evaluation,
trains a byte-level BPE tokenizer (specials `<|endoftext|>` = EOS between files, `[MASK]` for the drafter) and
writes to --data_dir: tokenizer.json, train_tokens.npy / eval_tokens.npy (uint16), manifest.json (every file
with its sha256), and prompts from held-out files (experiments/eval_prompts.jsonl, checkpoints/demo_prompts.jsonl).

Stage `train` trains MLA + dense first layer + sigmoid noaux_tc MoE (balanced correction bias) + shared expert +
YaRN with AdamW (f32 master weights, bf16 forward), stops at --steps or --max_seconds, and writes --out_dir in the
real HF format (routed experts INT4 group 32, compressed-tensors pack-quantized) with tokenizer.json and
training_manifest.json; the loss curve goes to --results_dir/train_target_loss.json.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from absl import flags, logging

from ddtree_jax.config import KimiConfig, QuantConfig, YarnConfig
from ddtree_jax.errors import run_app

FLAGS = flags.FLAGS
flags.DEFINE_enum("stage", "train", ["data", "train"], "data (CPU, needs `tokenizers`) or train.")
flags.DEFINE_string("data_dir", "experiments/data", "Tokenizer, token arrays and manifest.")
flags.DEFINE_string("out_dir", "checkpoints/kimi-mini", "HF checkpoint written by --stage=train.")
flags.DEFINE_string("results_dir", "experiments/results", "Loss curve JSON.")
flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary size, specials included.")
flags.DEFINE_enum("preset", "mini", ["mini", "tiny"], "Model size: mini (shipped) or tiny (smoke tests).")
flags.DEFINE_integer("steps", 4000, "Maximum optimizer steps.")
flags.DEFINE_float("max_seconds", 170.0, "Wall-clock budget of the training loop (the schedule follows it).")
flags.DEFINE_integer("batch", 32, "Sequences per step.")
flags.DEFINE_integer("seq_len", 512, "Tokens per sequence.")
flags.DEFINE_float("lr", 3e-3, "Peak learning rate.")
flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay (matrices only).")
flags.DEFINE_float("bias_rate", 1e-3, "Correction-bias update speed u.")
flags.DEFINE_integer("seed", 0, "Init and data seed.")
flags.DEFINE_integer("log_every", 25, "Steps between loss-curve points.")

EXCLUDED_DIRS = {"site-packages", "test", "tests", "idlelib", "turtledemo", "ensurepip", "lib2to3", "__pycache__"}
EOS, MASK = "<|endoftext|>", "[MASK]"
HOLDOUT_MOD = 50
EVAL_PROMPTS = Path("experiments/eval_prompts.jsonl")
DEMO_PROMPTS = Path("checkpoints/demo_prompts.jsonl")


# ---- data -----------------------------------------------------------------------------------------------


def stdlib_files(root: Path) -> list[Path]:
    """Sorted standard-library sources under `root`, without tests and bundled apps."""
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if set(rel.parts[:-1]) & EXCLUDED_DIRS or rel.name.startswith("test_"):
            continue
        files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HOLDOUT_MOD == 0


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_files(tok, texts: list[str]) -> np.ndarray:
    """Each text followed by EOS, concatenated -> uint16 `[N]`."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eos]
    return np.asarray(ids, np.uint16)


def function_prompts(rel: str, text: str, per_file: int, max_chars: int = 600) -> list[dict]:
    """Up to `per_file` prompts: the text from a `def` line to the end of the line after which max_chars is hit."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and i > 0]
    picks = starts[len(starts) // 4 :: max(1, len(starts) // (2 * per_file))][:per_file]
    out = []
    for k, i in enumerate(picks):
        chunk = ""
        for line in lines[i:]:
            if len(chunk) + len(line) > max_chars:
                break
            chunk += line
        if chunk.count("\n") >= 3:
            out.append({"id": f"{rel}#{k}", "prompt": chunk})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def stage_data(data_dir: Path) -> None:
    import sys
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    rels = [f.relative_to(root).as_posix() for f in files]
    raw = [f.read_bytes() for f in files]
    texts = [b.decode("utf-8", errors="replace") for b in raw]
    entries = [{"path": r, "sha256": hashlib.sha256(b).hexdigest()} for r, b in zip(rels, raw, strict=True)]
    train = [i for i, r in enumerate(rels) if not is_held_out(r)]
    held = [i for i, r in enumerate(rels) if is_held_out(r)]
    tok = train_tokenizer([texts[i] for i in train], FLAGS.vocab_size)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(data_dir / "tokenizer.json"))
    train_ids = encode_files(tok, [texts[i] for i in train])
    eval_ids = encode_files(tok, [texts[i] for i in held])
    np.save(data_dir / "train_tokens.npy", train_ids)
    np.save(data_dir / "eval_tokens.npy", eval_ids)
    listing = json.dumps([entries[i] for i in train], sort_keys=True).encode()
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "holdout_rule": f"sha256(relative path) % {HOLDOUT_MOD} == 0",
        "train_files": [entries[i] for i in train],
        "eval_files": [entries[i] for i in held],
        "train_files_sha256": hashlib.sha256(listing).hexdigest(),
        "tokenizer_sha256": hashlib.sha256((data_dir / "tokenizer.json").read_bytes()).hexdigest(),
        "train_tokens": int(train_ids.size),
        "eval_tokens": int(eval_ids.size),
        "vocab_size": tok.get_vocab_size(),
    }
    (data_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    prompts = [p for i in held for p in function_prompts(rels[i], texts[i], per_file=2)]
    write_jsonl(EVAL_PROMPTS, prompts)
    write_jsonl(DEMO_PROMPTS, prompts[:: max(1, len(prompts) // 5)][:5])
    logging.info(
        "%d train files (%d tokens), %d held out (%d tokens), %d eval prompts",
        len(train),
        train_ids.size,
        len(held),
        eval_ids.size,
        len(prompts),
    )


# ---- model ----------------------------------------------------------------------------------------------


def model_config(preset: str, vocab: int, eos_id: int) -> KimiConfig:
    """The Kimi K2.6 layout at small scale: 1 dense + MoE layers, 16 experts top-2 + shared, MLA, YaRN."""
    dims = {
        "mini": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128,
                     qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=1024,
                     moe_intermediate_size=256, n_routed_experts=16),
        "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                     moe_intermediate_size=32, n_routed_experts=8),
    }[preset]  # fmt: skip
    return KimiConfig(
        vocab_size=vocab,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        routed_scaling_factor=2.827,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        rope_theta=50000.0,
        rope_scaling=YarnConfig(
            factor=4.0,
            original_max_position_embeddings=512,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),  # fmt: skip
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        quant=QuantConfig(group_size=32),
        model_type="kimi_k2",
        eos_token_ids=(eos_id,),
        pad_token_id=eos_id,
        **dims,
    )


def eval_loss(model, tokens: np.ndarray, seq_len: int, batch: int = 8) -> float:
    """Mean next-token loss over consecutive windows of the held-out stream (bf16 forward)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ddtree_jax.training import trainers

    n = (len(tokens) - 1) // seq_len
    windows = np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)
    graphdef, state = nnx.split(model)
    state = trainers.cast_floats(state, jnp.bfloat16)
    loss = jax.jit(lambda s, t: trainers.next_token_loss(nnx.merge(graphdef, s), t))
    total = [float(loss(state, windows[i : i + batch])) for i in range(0, n - batch + 1, batch)]
    return float(np.mean(total))


def stage_train(data_dir: Path, out_dir: Path, results_dir: Path) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ddtree_jax.config import to_hf_dict
    from ddtree_jax.models.kimi import KimiForCausalLM
    from ddtree_jax.training import trainers
    from ddtree_jax.training.synthetic import hf_tensors_from_model, write_hf_checkpoint
    from experiments.common import metadata

    manifest = json.loads((data_dir / "manifest.json").read_text())
    vocab = json.loads((data_dir / "tokenizer.json").read_text())
    eos_id = next(t["id"] for t in vocab["added_tokens"] if t["content"] == EOS)
    cfg = model_config(FLAGS.preset, manifest["vocab_size"], eos_id)
    tokens = np.load(data_dir / "train_tokens.npy")
    model = KimiForCausalLM(cfg, rngs=nnx.Rngs(FLAGS.seed), dtype=jnp.float32, quantized=False)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    logging.info("target: %d params, %d train tokens", n_params, tokens.size)
    trainer = trainers.TargetTrainer(model, trainers.adamw(FLAGS.lr, FLAGS.weight_decay), FLAGS.bias_rate)
    rng = np.random.default_rng(FLAGS.seed)
    curve, t0, step = [], time.perf_counter(), 0
    while step < FLAGS.steps:
        elapsed = time.perf_counter() - t0
        progress = max(step / FLAGS.steps, elapsed / FLAGS.max_seconds)
        if progress >= 1.0:
            break
        lr = trainers.lr_at(progress, FLAGS.lr)
        loss, imbalance = trainer.step(trainers.sample_windows(tokens, FLAGS.batch, FLAGS.seq_len + 1, rng), lr)
        step += 1
        if step == 1:  # the budget counts from the first compiled step
            t0 = time.perf_counter()
        if step % FLAGS.log_every == 0 or step == 1:
            curve.append({"step": step, "seconds": elapsed, "lr": lr, "loss": loss, "load_max_over_mean": imbalance})
            logging.info("step %d  %.0fs  lr %.2e  loss %.4f  load max/mean %.2f", step, elapsed, lr, loss, imbalance)
    train_s = time.perf_counter() - t0
    model = trainer.export()
    held_loss = eval_loss(model, np.load(data_dir / "eval_tokens.npy"), FLAGS.seq_len)
    logging.info("trained %d steps in %.0fs; held-out loss %.4f", step, train_s, held_loss)
    write_hf_checkpoint(out_dir, cfg, params=hf_tensors_from_model(model), num_shards=2)
    shutil.copy(data_dir / "tokenizer.json", out_dir / "tokenizer.json")
    run = {
        "steps": step,
        "train_seconds": train_s,
        "tokens_seen": step * FLAGS.batch * FLAGS.seq_len,
        "final_train_loss": curve[-1]["loss"] if curve else None,
        "held_out_loss": held_loss,
        "params": int(n_params),
        "flags": {k: FLAGS[k].value for k in ("preset", "batch", "seq_len", "lr", "weight_decay", "bias_rate", "seed")},
    }
    (out_dir / "training_manifest.json").write_text(json.dumps({**metadata(), **run, "data": manifest}, indent=1))
    results_dir.mkdir(parents=True, exist_ok=True)
    payload = {"meta": metadata(), "run": run, "config": to_hf_dict(cfg), "curve": curve}
    (results_dir / "train_target_loss.json").write_text(json.dumps(payload, indent=1))


def main(argv: Sequence[str]) -> None:
    del argv
    if FLAGS.stage == "data":
        stage_data(Path(FLAGS.data_dir))
    else:
        stage_train(Path(FLAGS.data_dir), Path(FLAGS.out_dir), Path(FLAGS.results_dir))


if __name__ == "__main__":
    run_app(main)
