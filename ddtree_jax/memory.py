"""Memory planning: per-device bytes of a generation run, from the configs alone, before any weight is loaded.

`plan(...)` adds four parts, each per device:

* weights: the target as stored (`sizing.model_sizes`) laid out like `sharding.py`: routed experts split
  `expert x tensor` ways (ceil(E / (expert * tensor)) experts per device, every MoE layer); MLA head
  projections (q_b, kv_b, o), dense and shared-expert FFNs and the lm_head split `tensor` ways; the embedding,
  norms, q_a / kv_a projections and routers replicated. The drafter (its own layers; it shares the target's
  embedding and lm_head) is replicated.
* target cache: the latent cache, layers x batch x capacity x (kv_lora_rank + rope dims) values, batch split
  over `data`; capacity as `engine.cache_capacity` (context + verify block + 1 slot, rounded up to whole
  64-slot tiles).
* drafter cache: K and V, layers x 2 x batch x capacity x kv_heads x head_dim, batch split over `data`.
* workspace: the larger of two phases (XLA frees the prefill's temporaries before the decode loop starts):
    - prefill over the prompt P in chunks of C = min(P, `engine.prefill_chunk`) tokens (the engine's chunked
      prefill): one chunk's attention scores and probabilities f32 (`[B, heads, P, P]` for the single naive pass
      when P <= C, `[B, C, heads, capacity]` over the latent cache otherwise), per-head q/k/v/output, 4 live
      hidden copies `[B, C, H]`, routed-expert intermediates `[B*C*top_k, 2I]` f32, the drafter features
      `[B, C, K*H]` and their context K/V in f32.
    - one round over the T verified tokens (T = 1 for ar, 1 + D for dflash, 1 + budget for ddtree): 4 hidden
      copies, f32 logits twice (logits + the sampling softmax) over the vocab (split over `tensor`), features
      `[B, T, K*H]`, MLA scores and probabilities `[B, T, heads, capacity]` f32, routed-expert intermediates;
      plus the draft: f32 logits twice `[B, D, V]`, the drafter's scores and probabilities `[B, heads, block,
      capacity + block]` f32 and the concatenated K/V copy of one drafter layer.
  Every term counts one layer's temporaries (layers run one after another). Small buffers (tokens, lengths,
  tree indices, one `[B, V]` prefill logit row) are not counted.
  Under the exact numerics (`exact=True`) the prefill is never the naive pass (chunks of `engine.prefill_chunk`
  tokens), and both phases add the exact MLA kernel's partials (`mla_exact.partial_bytes`): per query token and
  context segment of `mla_exact.SEGMENT` slots, an f32 `[rows, kv_lora_rank]` accumulator with its row maxes and
  sums (the bound: a call that packs tokens in a program's rows writes fewer).

Activations and non-INT4 weights use the model dtype (`dtype_bytes`, 2 for bfloat16); the router bias is f32.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

from absl import logging

from ddtree_jax.config import DFlashConfig, KimiConfig
from ddtree_jax.engine import GenSpec, prefill_chunk, tree_size
from ddtree_jax.errors import UserError
from ddtree_jax.mesh_spec import parse_mesh_spec
from ddtree_jax.sizing import F32_BYTES, cache_slots, drafter_params, model_sizes, tensor_split_params
from pallas_kernels import dispatch
from pallas_kernels.mla_exact import partial_bytes

FREE_BYTES_ENV = "DDTREE_FREE_BYTES"  # overrides the device's free memory (tests, dry runs), in bytes
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axis sizes (as `sharding.MESH_AXES`): batch over `data`, experts over `expert x tensor`."""

    data: int = 1
    expert: int = 1
    tensor: int = 1

    @classmethod
    def from_spec(cls, spec: str | None, num_devices: int = 1) -> Layout:
        """A `--mesh` spec ("expert=8,tensor=1"); None: all `num_devices` on `expert` (the engine's
        default)."""
        return cls(expert=num_devices) if spec is None else cls(**parse_mesh_spec(spec))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of one run; `weights` / `workspace` break their totals down by term."""

    batch: int
    max_len: int
    prompt_len: int
    method: str
    budget: int
    exact: bool
    layout: Layout
    capacity: int
    tree_size: int
    weights: dict[str, int]
    target_cache: int
    drafter_cache: int
    workspace: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.target_cache + self.drafter_cache + max(self.workspace.values())

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return d | {"weight_bytes": sum(self.weights.values()), "total_bytes": self.total}

    def summary(self) -> str:
        weights, workspace = sum(self.weights.values()), max(self.workspace.values())
        return (
            f"batch {self.batch} x context {self.max_len} ({self.method}) needs {fmt_bytes(self.total)} "
            f"per device (weights {fmt_bytes(weights)}, target cache {fmt_bytes(self.target_cache)}, "
            f"drafter cache {fmt_bytes(self.drafter_cache)}, workspace {fmt_bytes(workspace)})"
        )


def fmt_bytes(n: float) -> str:
    """1.5e10 -> "15.0 GB", 2.5e6 -> "2.5 MB" (decimal units)."""
    unit, scale = next((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1)) if n >= s or s == 1)
    return f"{n / scale:.1f} {unit}"


def _weights(c: KimiConfig, d: DFlashConfig | None, lay: Layout, w: int) -> dict[str, int]:
    sizes = model_sizes(c)
    n_moe = len(c.moe_layers)
    routed_stored = sizes["expert_bytes"] * c.n_routed_experts * n_moe
    router_bias = c.n_routed_experts * n_moe * F32_BYTES
    float_params = (sizes["weight_bytes"] - routed_stored - router_bias) // 2  # everything else is stored bf16
    split = tensor_split_params(c)
    experts_here = math.ceil(c.n_routed_experts / (lay.expert * lay.tensor)) if c.n_routed_experts else 0
    expert_scale = 1 if c.quant is not None else w / 2  # float experts follow the model dtype
    return {
        "routed_experts": int(sizes["expert_bytes"] * experts_here * n_moe * expert_scale),
        "tensor_split": math.ceil(split / lay.tensor) * w,
        "replicated": (float_params - split) * w + router_bias,
        "drafter": drafter_params(d) * w if d is not None else 0,
    }


def _prefill(
    c: KimiConfig, d: DFlashConfig | None, lay: Layout, b: int, p: int, w: int, cap: int, chunk: int, exact: bool
) -> int:
    """chunk: prompt tokens per prefill step (`engine.prefill_chunk`)."""
    heads = math.ceil(c.num_attention_heads / lay.tensor)
    h = c.hidden_size
    naive = not exact and p <= chunk  # the single naive pass over the prompt
    ch = min(p, chunk)  # tokens per prefill step
    keys = p if naive else cap  # the naive pass sees the prompt; chunks score the whole cache
    scores = 2 * b * heads * ch * keys * F32_BYTES
    q_dim = c.qk_head_dim if naive else c.latent_dim  # naive per-head q, or absorbed q over the cache
    qkvo = b * ch * heads * ((q_dim + c.qk_nope_head_dim + c.v_head_dim) * w + c.kv_lora_rank * F32_BYTES)
    moe = b * ch * c.num_experts_per_tok * 2 * c.moe_intermediate_size * F32_BYTES
    total = scores + qkvo + 4 * b * ch * h * w + moe
    if exact:
        total += partial_bytes(b, ch, cap, heads, c.kv_lora_rank)
    if d is not None:
        k = len(d.target_layer_ids)
        total += b * ch * k * h * w + d.num_hidden_layers * 2 * b * ch * d.num_key_value_heads * d.head_dim * F32_BYTES
    return total


def _round(c: KimiConfig, d: DFlashConfig | None, lay: Layout, b: int, t: int, cap: int, w: int, exact: bool) -> int:
    heads = math.ceil(c.num_attention_heads / lay.tensor)
    vocab = math.ceil(c.vocab_size / lay.tensor)
    h = c.hidden_size
    total = (
        4 * b * t * h * w
        + 2 * b * t * vocab * F32_BYTES
        + 2 * b * t * heads * cap * F32_BYTES
        + b * t * c.num_experts_per_tok * 2 * c.moe_intermediate_size * F32_BYTES
    )
    if exact:
        total += partial_bytes(b, t, cap, heads, c.kv_lora_rank)
    if d is not None and t > 1:
        keys = cap + d.block_size
        total += (
            b * t * len(d.target_layer_ids) * h * w
            + 2 * b * d.num_draft * vocab * F32_BYTES
            + 2 * b * d.num_attention_heads * d.block_size * keys * F32_BYTES
            + 2 * b * keys * d.num_key_value_heads * d.head_dim * w
        )
    return total


def plan(
    target_cfg: KimiConfig,
    drafter_cfg: DFlashConfig | None,
    *,
    batch: int,
    max_len: int,
    method: str,
    budget: int = 16,
    prompt_len: int | None = None,
    layout: Layout | None = None,
    dtype_bytes: int = 2,
    exact: bool = False,
) -> Plan:
    """Per-device memory of generating `batch` rows of up to `max_len` tokens (prompt + new) with `method`.

    prompt_len: the (padded) prompt length the prefill runs over; None: the whole context (the worst case).
    The drafter is only counted for dflash / ddtree. exact: the programs run the exact numerics
    (`dispatch.Kernels.exact`), whose prefill chunks and MLA partials differ.
    """
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch and max_len must be >= 1, got {batch}, {max_len}")
    lay = layout or Layout()
    d = drafter_cfg if method != "ar" else None
    spec = GenSpec(
        method=method,
        batch=batch,
        prompt_len=1,
        max_new_tokens=max_len,
        budget=budget,
        kernels=dispatch.Kernels(exact=exact),
    )
    t = tree_size(spec, d.num_draft if d is not None else 0)
    cap = cache_slots(max_len + t + 1)
    p = max_len if prompt_len is None else min(prompt_len, max_len)
    b = math.ceil(batch / lay.data)
    c, w = target_cfg, dtype_bytes
    return Plan(
        batch=batch,
        max_len=max_len,
        prompt_len=p,
        method=method,
        budget=budget,
        exact=exact,
        layout=lay,
        capacity=cap,
        tree_size=t,
        weights=_weights(c, d, lay, w),
        target_cache=c.num_hidden_layers * b * cap * c.latent_dim * w,
        drafter_cache=0 if d is None else d.num_hidden_layers * 2 * b * cap * d.num_key_value_heads * d.head_dim * w,
        workspace={
            "prefill": _prefill(c, d, lay, b, p, w, cap, prefill_chunk(spec), exact),
            "round": _round(c, d, lay, b, t, cap, w, exact),
        },
    )


def fits(p: Plan, free_bytes: int) -> bool:
    return p.total <= free_bytes


def _largest(ok: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, limit] with ok(n) (ok monotone: true up to some n), 0 if none."""
    if limit < 1 or not ok(1):
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def largest_batch(
    target_cfg: KimiConfig,
    drafter_cfg: DFlashConfig | None,
    free_bytes: int,
    *,
    limit: int = 1 << 16,
    **kw: Any,
) -> int:
    """The largest batch whose plan (other `plan` arguments in `kw`) fits `free_bytes`; 0 if none does."""
    return _largest(lambda n: fits(plan(target_cfg, drafter_cfg, batch=n, **kw), free_bytes), limit)


def longest_context(
    target_cfg: KimiConfig, drafter_cfg: DFlashConfig | None, free_bytes: int, *, limit: int, **kw: Any
) -> int:
    """The longest max_len up to `limit` whose plan fits `free_bytes` (prompt filling it unless `kw` has a
    prompt_len); 0 if none does."""
    return _largest(lambda n: fits(plan(target_cfg, drafter_cfg, max_len=n, **kw), free_bytes), limit)


def device_free_bytes() -> int | None:
    """Free bytes of the local device with the least: $DDTREE_FREE_BYTES if set, else bytes_limit -
    bytes_in_use from `memory_stats()`; None where the backend reports no stats (CPU). On GPU, bytes_limit is
    XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the card: K2.6 on H200s needs it raised (e.g. 0.95)."""
    env = os.environ.get(FREE_BYTES_ENV)
    if env is not None:
        if not env.strip().isdigit():
            raise UserError(f"${FREE_BYTES_ENV} must be a number of bytes, got {env!r}")
        return int(env)
    import jax

    free = []
    for dev in jax.local_devices():
        stats = dev.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free)


def check_fits(target_cfg: KimiConfig, drafter_cfg: DFlashConfig | None, *, context_limit: int, **kw: Any) -> Plan:
    """Plan the run (`plan` arguments in `kw`) and refuse it with a `UserError` saying what fits when the
    device has too little free memory; where the device reports none (CPU), log that the check is skipped."""
    p = plan(target_cfg, drafter_cfg, **kw)
    free = device_free_bytes()
    if free is None:
        logging.info("The device reports no memory stats; skipping the memory check (%s).", p.summary())
        return p
    if fits(p, free):
        logging.info("Memory plan: %s; %s free.", p.summary(), fmt_bytes(free))
        return p
    batch_kw = {k: v for k, v in kw.items() if k != "batch"}
    ctx_kw = {k: v for k, v in kw.items() if k not in ("max_len", "prompt_len")}
    n = largest_batch(target_cfg, drafter_cfg, free, limit=p.batch, **batch_kw)
    ctx = longest_context(target_cfg, drafter_cfg, free, limit=context_limit, **ctx_kw)
    hints = [f"largest batch at this context: {n}"] if n else []
    hints += [f"longest context at this batch: {ctx} tokens (prompt included)"] if ctx else []
    if not hints:
        one = plan(target_cfg, drafter_cfg, **(kw | {"batch": 1, "max_len": 1, "prompt_len": 1}))
        hints = [f"nothing fits: batch 1 x context 1 already needs {fmt_bytes(one.total)}"]
    raise UserError(f"not enough device memory: {p.summary()}, {fmt_bytes(free)} free; {'; '.join(hints)}")
