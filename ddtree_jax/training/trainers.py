"""Training steps for the small Kimi-architecture target and its DFlash drafter (dflash_ddtree.md §4).

Target: next-token cross-entropy, f32 master weights with a bf16 forward, AdamW; the `noaux_tc` correction bias
is not trained by gradients but nudged after each step towards balanced expert load (kimi_k2.md §4):
bias += u * sign(mean_load - load).

Drafter: the frozen target gives features at `target_layer_ids` (and its own next-token distribution) for a
window of S tokens; the drafter projects the context K/V once per sequence (`context_kv`), then each of A random
anchors is a batch row `[anchor, mask x (B-1)]` attending to that shared context with cache_len = anchor
position: context strictly before the anchor, bidirectional inside the block, exactly the inference forward.
Loss: cross-entropy on block positions k = 1..B-1 with weights exp(-(k-1)/gamma), against a mix of the data
token and the target's distribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ddtree_jax.models.dflash import DFlashDrafter, DrafterCache
from ddtree_jax.models.kimi import KimiForCausalLM, MoE

BIAS = "e_score_correction_bias"


def _trainable(path: tuple, _value: Any) -> bool:
    return path[-1] != BIAS


TRAINABLE = nnx.All(nnx.Param, _trainable)


def decay_mask(params: nnx.State) -> nnx.State:
    """Weight decay on matrices only (no norms, no embedding table: its unused [MASK] row must not shrink)."""
    flat = nnx.to_flat_state(params)
    return nnx.from_flat_state([(p, v.replace(v.ndim >= 2 and p[-1] != "embed_tokens")) for p, v in flat])


def adamw(peak_lr: float, weight_decay: float, clip: float = 1.0) -> optax.GradientTransformation:
    """AdamW (b2 0.95) with global-norm clipping; the learning rate is injected per step (`set_lr`)."""
    return optax.chain(
        optax.clip_by_global_norm(clip),
        optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=peak_lr, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask
        ),
    )


def set_lr(opt_state: tuple, lr: float) -> tuple:
    opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return opt_state


def lr_at(progress: float, peak: float, warmup: float = 0.03, final: float = 0.1) -> float:
    """Linear warm-up over the first `warmup` of training, then cosine decay to `final * peak`."""
    if progress < warmup:
        return peak * (progress / warmup)
    t = min((progress - warmup) / (1.0 - warmup), 1.0)
    return peak * (final + (1.0 - final) * 0.5 * (1.0 + np.cos(np.pi * t)))


def cast_floats(state: nnx.State, dtype) -> nnx.State:
    """Floating leaves to `dtype` (the f32 router bias stays f32)."""
    flat = nnx.to_flat_state(state)
    out = []
    for p, v in flat:
        x = v.get_value()
        keep = p[-1] == BIAS or not jnp.issubdtype(x.dtype, jnp.floating)
        out.append((p, v.replace(x if keep else x.astype(dtype))))
    return nnx.from_flat_state(out)


def sample_windows(tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`batch` random windows of `length` tokens from the 1-D token stream -> int32 `[batch, length]`."""
    starts = rng.integers(0, len(tokens) - length, size=batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


# ---- target ----------------------------------------------------------------------------------------------


def set_record_load(model: KimiForCausalLM, on: bool) -> None:
    for _, m in nnx.iter_modules(model):
        if isinstance(m, MoE):
            m.record_load = on


def target_forward(model: KimiForCausalLM, tokens: jax.Array, feature_layers: tuple[int, ...] = ()):
    """Causal prefill forward over `tokens [B, S]` (positions 0..S-1, empty cache) -> `ForwardOut`."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    cache = model.init_cache(b, s)
    return model(tokens, positions, cache, jnp.zeros((b,), jnp.int32), feature_layers=feature_layers, naive=True)


def next_token_loss(model: KimiForCausalLM, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (`[B, S+1]` in)."""
    out = target_forward(model, tokens[:, :-1])
    logits = model.logits(out.hidden)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@dataclasses.dataclass
class TargetTrainer:
    """Holds the split model (f32 master weights), the optimizer state and one jitted step."""

    model: KimiForCausalLM
    tx: optax.GradientTransformation
    bias_rate: float = 1e-3
    compute_dtype: Any = jnp.bfloat16

    def __post_init__(self):
        set_record_load(self.model, True)
        self.graphdef, self.params, self.bias = nnx.split(self.model, TRAINABLE, nnx.Param)
        self.opt_state = self.tx.init(self.params)
        self._step = jax.jit(self._step_fn, donate_argnums=(0, 1, 2))

    def _step_fn(self, params, bias, opt_state, tokens):
        def loss_fn(p):
            m = nnx.merge(self.graphdef, cast_floats(p, self.compute_dtype), bias)
            loss = next_token_loss(m, tokens)
            return loss, nnx.pop(m, nnx.Intermediate)

        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, balance_bias(bias, loads, self.bias_rate), opt_state, loss, load_imbalance(loads)

    def step(self, tokens: np.ndarray, lr: float) -> tuple[float, float]:
        """One AdamW step on `tokens [B, S+1]` -> (loss, max/mean expert load over layers)."""
        self.opt_state = set_lr(self.opt_state, lr)
        self.params, self.bias, self.opt_state, loss, imb = self._step(
            self.params, self.bias, self.opt_state, jnp.asarray(tokens)
        )
        return float(loss), float(imb)

    def export(self) -> KimiForCausalLM:
        """The trained model (f32 params, record_load off), e.g. for `hf_tensors_from_model`."""
        model = nnx.merge(self.graphdef, self.params, self.bias)
        set_record_load(model, False)
        return model


def _layer_loads(loads: nnx.State) -> dict[tuple, jax.Array]:
    """{MoE module path: expert token counts [E]} from the popped "expert_load" intermediates."""
    return {p[:-1]: sum(v.get_value()) for p, v in nnx.to_flat_state(loads)}


def balance_bias(bias: nnx.State, loads: nnx.State, rate: float) -> nnx.State:
    """bias_l += rate * sign(mean(load_l) - load_l) for every MoE layer l (aux-loss-free balancing)."""
    per_layer = _layer_loads(loads)
    out = []
    for p, v in nnx.to_flat_state(bias):
        load = per_layer[p[:-1]]
        out.append((p, v.replace(v.get_value() + rate * jnp.sign(load.mean() - load))))
    return nnx.from_flat_state(out)


def load_imbalance(loads: nnx.State) -> jax.Array:
    """max(load) / mean(load), averaged over MoE layers (1 = perfectly balanced)."""
    per_layer = list(_layer_loads(loads).values())
    return jnp.mean(jnp.stack([load.max() / jnp.maximum(load.mean(), 1e-9) for load in per_layer]))


# ---- drafter ---------------------------------------------------------------------------------------------


def sample_anchors(key: jax.Array, batch: int, length: int, anchors: int, block: int, lo: int = 1) -> jax.Array:
    """`[batch, anchors]` distinct anchor positions in [lo, length - block] (lo >= 1: context non-empty; the
    block stays inside the sequence)."""
    scores = jax.random.uniform(key, (batch, length - block - lo + 1))
    return (jax.lax.top_k(scores, anchors)[1] + lo).astype(jnp.int32)


def block_targets(tokens: jax.Array, anchors: jax.Array, block: int) -> jax.Array:
    """tokens `[B, S]`, anchors `[B, A]` -> `[B, A, block]` tokens at anchor + 0..block-1."""
    idx = anchors[..., None] + jnp.arange(block)
    return jnp.take_along_axis(tokens[:, None, :], idx, axis=2)


def drafter_block_hidden(
    drafter: DFlashDrafter,
    embed: Callable[[jax.Array], jax.Array],
    features: jax.Array,
    tokens: jax.Array,
    anchors: jax.Array,
) -> jax.Array:
    """Drafter output for every anchor block, through the inference code path.

    features `[B, S, K*H]` (target layer outputs at positions 0..S-1), tokens `[B, S]`, anchors `[B, A]`
    -> final-normed hidden `[B, A, block, H]` of blocks [token at anchor, mask...] that see context < anchor.
    """
    c = drafter.config
    b, s = tokens.shape
    a = anchors.shape[1]
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    k, v = drafter.context_kv(features, positions)  # [layers, B, S, kvh, hd]
    rows = lambda x: jnp.repeat(x, a, axis=1)  # noqa: E731 -- [layers, B*A, S, kvh, hd]
    cache = DrafterCache(rows(k), rows(v))
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A]
    block = jnp.concatenate(
        [first[..., None], jnp.full((b, a, c.block_size - 1), c.mask_token_id, jnp.int32)], axis=-1
    ).reshape(b * a, c.block_size)
    pos = (anchors[..., None] + jnp.arange(c.block_size)).reshape(b * a, c.block_size)
    hidden = drafter(embed(block), pos, cache, anchors.reshape(b * a))
    return hidden.reshape(b, a, c.block_size, -1)


def position_weights(block: int, gamma: float) -> jax.Array:
    """exp(-(k-1)/gamma) for block positions k = 1..block-1 -> `[block - 1]`."""
    return jnp.exp(-jnp.arange(block - 1, dtype=jnp.float32) / gamma)


def drafter_loss(
    drafter: DFlashDrafter,
    target: KimiForCausalLM,
    tokens: jax.Array,
    anchors: jax.Array,
    *,
    gamma: float,
    distill: float,
) -> tuple[jax.Array, jax.Array]:
    """Weighted block cross-entropy for `tokens [B, S]` and `anchors [B, A]` -> (loss, top-1 accuracy on
    position 1 against the target's greedy token). distill in [0, 1] mixes the target's distribution into the
    one-hot data label."""
    c = drafter.config
    out = target_forward(target, tokens, c.target_layer_ids)
    features = jax.lax.stop_gradient(out.features)
    t_logits = jax.lax.stop_gradient(target.logits(out.hidden))  # [B, S, V]: predicts position + 1
    logits = block_logits(drafter, target, features, tokens, anchors)
    labels = block_targets(tokens, anchors, c.block_size)[..., 1:]
    pred_idx = anchors[..., None] + jnp.arange(c.block_size - 1)  # target logits at p predict p + 1
    t_probs = jax.nn.softmax(jnp.take_along_axis(t_logits[:, None], pred_idx[..., None], axis=2), -1)
    soft = (1.0 - distill) * jax.nn.one_hot(labels, logits.shape[-1]) + distill * t_probs
    acc = jnp.mean(jnp.argmax(logits[:, :, 0], -1) == jnp.argmax(t_probs[:, :, 0], -1))
    return weighted_block_ce(logits, soft, gamma), acc


def block_logits(
    drafter: DFlashDrafter, target: KimiForCausalLM, features: jax.Array, tokens: jax.Array, anchors: jax.Array
) -> jax.Array:
    """Draft logits `[B, A, block-1, V]` for block positions 1..block-1 (target embedding and lm_head)."""
    hidden = drafter_block_hidden(drafter, target.embed, features, tokens, anchors)
    return target.head_logits(hidden[:, :, 1:]) * drafter.config.output_multiplier


def weighted_block_ce(logits: jax.Array, soft_labels: jax.Array, gamma: float) -> jax.Array:
    """Cross-entropy `[B, A, block-1]` weighted exp(-(k-1)/gamma) by block position, averaged."""
    ce = optax.softmax_cross_entropy(logits, soft_labels)
    w = position_weights(ce.shape[-1] + 1, gamma)
    return jnp.sum(ce * w) / (ce.shape[0] * ce.shape[1] * jnp.sum(w))


@dataclasses.dataclass
class DrafterTrainer:
    """f32 master weights of the drafter, bf16 forward, frozen target (its params are constants of the step)."""

    drafter: DFlashDrafter
    target: KimiForCausalLM
    tx: optax.GradientTransformation
    anchors: int
    gamma: float = 4.0
    distill: float = 0.5
    anchor_lo: int = 1  # first allowed anchor position
    compute_dtype: Any = jnp.bfloat16

    def __post_init__(self):
        self.graphdef, self.params = nnx.split(self.drafter, nnx.Param)
        self.t_graphdef, self.t_state = nnx.split(self.target)
        self.opt_state = self.tx.init(self.params)
        self._step = jax.jit(self._step_fn, donate_argnums=(0, 1))
        self._eval = jax.jit(self.loss)

    def loss(self, params, t_state, tokens, anchors):
        drafter = nnx.merge(self.graphdef, cast_floats(params, self.compute_dtype))
        target = nnx.merge(self.t_graphdef, t_state)
        return drafter_loss(drafter, target, tokens, anchors, gamma=self.gamma, distill=self.distill)

    def _step_fn(self, params, opt_state, t_state, tokens, key):
        b, s = tokens.shape
        anchors = sample_anchors(key, b, s, self.anchors, self.drafter.config.block_size, self.anchor_lo)
        (loss, acc), grads = jax.value_and_grad(self.loss, has_aux=True)(params, t_state, tokens, anchors)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    def step(self, tokens: np.ndarray, key: jax.Array, lr: float) -> tuple[float, float]:
        """One AdamW step on windows `tokens [B, S]` -> (loss, position-1 agreement with the target)."""
        self.opt_state = set_lr(self.opt_state, lr)
        self.params, self.opt_state, loss, acc = self._step(
            self.params, self.opt_state, self.t_state, jnp.asarray(tokens), key
        )
        return float(loss), float(acc)

    def evaluate(self, tokens: np.ndarray, key: jax.Array) -> tuple[float, float]:
        """(loss, position-1 agreement) on `tokens [B, S]` at anchors drawn from key; no update."""
        b, s = tokens.shape
        anchors = sample_anchors(key, b, s, self.anchors, self.drafter.config.block_size, self.anchor_lo)
        loss, acc = self._eval(self.params, self.t_state, jnp.asarray(tokens), anchors)
        return float(loss), float(acc)

    def snapshot(self) -> nnx.State:
        """A copy of the current weights (the step donates its buffers)."""
        return jax.tree.map(jnp.copy, self.params)

    def export(self, params: nnx.State | None = None) -> DFlashDrafter:
        """The drafter with the current weights, or with `params` from `snapshot()`."""
        return nnx.merge(self.graphdef, self.params if params is None else params)


def grow_drafter(drafter: DFlashDrafter, layers: int, intermediate: int, seed: int = 0) -> DFlashDrafter:
    """A larger drafter computing exactly what `drafter` computes, to fine-tune from (function-preserving growth).

    MLPs widen to `intermediate`: the new units get random gate/up columns and zero down_proj rows. New layers
    (`layers` - old count, each old layer followed by at most one, LLaMA-Pro style) get random weights with zero
    o_proj and down_proj, so each starts as the identity on the residual stream. Norms, fc, and the old layers'
    weights are copied; the new layers' context projections (`kv_proj`) are random."""
    old = drafter.config
    extra = layers - old.num_hidden_layers
    if extra < 0 or extra > old.num_hidden_layers or intermediate < old.intermediate_size:
        raise ValueError(
            f"can grow {old.num_hidden_layers} layers x {old.intermediate_size} only to between that and "
            f"{2 * old.num_hidden_layers} layers and a wider MLP; asked {layers} x {intermediate}"
        )
    cfg = dataclasses.replace(old, num_hidden_layers=layers, intermediate_size=intermediate)
    new = DFlashDrafter(cfg, rngs=nnx.Rngs(seed), dtype=drafter.dtype)
    # layer i of the old drafter goes to slot i + (number of new layers inserted before it)
    slots = [i + min(i, extra) for i in range(old.num_hidden_layers)]
    inserted = [s + 1 for s in slots[:extra]]
    new.fc[...], new.hidden_norm[...], new.norm[...] = drafter.fc[...], drafter.hidden_norm[...], drafter.norm[...]
    kv = new.kv_proj[...]
    for i, s in enumerate(slots):
        kv = kv.at[s].set(drafter.kv_proj[i])
        src, dst = drafter.layers[i], new.layers[s]
        for name in ("input_layernorm", "post_attention_layernorm", "q_proj", "o_proj", "q_norm", "k_norm"):
            getattr(dst, name)[...] = getattr(src, name)[...]
        n = old.intermediate_size
        for name in ("gate_proj", "up_proj"):
            w = getattr(dst.mlp, name)
            w[...] = w[...].at[:, :n].set(getattr(src.mlp, name)[...])
        dst.mlp.down_proj[...] = jnp.zeros_like(dst.mlp.down_proj[...]).at[:n].set(src.mlp.down_proj[...])
    new.kv_proj[...] = kv
    for s in inserted:
        new.layers[s].o_proj[...] = jnp.zeros_like(new.layers[s].o_proj[...])
        new.layers[s].mlp.down_proj[...] = jnp.zeros_like(new.layers[s].mlp.down_proj[...])
    return new
