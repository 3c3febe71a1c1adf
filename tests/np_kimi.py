"""Independent float64 NumPy Kimi K2 / DeepSeek-V3 forward, written from ../shared/spec/kimi_k2.md.

Takes HF-named tensors in HF orientation (`[out, in]`), routed experts already dequantized to float
(`...experts.{e}.{gate,up,down}_proj.weight`), names without the `model.` / `language_model.` prefix
(`embed_tokens.weight`, `layers.{l}...`, `norm.weight`, `lm_head.weight`). Full recompute, one sequence, explicit
positions and visibility mask, naive (per-head) MLA as in §3.2.
"""

from __future__ import annotations

import math

import numpy as np


def yarn_inv_freq(dim: int, theta: float, factor: float, orig: int, beta_fast: float, beta_slow: float):
    i = np.arange(dim // 2, dtype=np.float64)
    f_extra = theta ** (-2 * i / dim)
    f_inter = f_extra / factor

    def corr(n):
        return dim * math.log(orig / (2 * math.pi * n)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0, 1)
    return f_inter * ramp + f_extra * (1 - ramp)


def softmax_scale(cfg) -> float:
    y = cfg.rope_scaling
    m = 0.1 * y.mscale_all_dim * math.log(y.factor) + 1 if y.factor > 1 else 1.0
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * m * m


def rms(x, g, eps):
    return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope(x, pos, inv_freq):
    """Interleaved pairs (2i, 2i+1); x [..., N, (H,) R], pos [N]."""
    ang = pos[:, None] * inv_freq[None, :]  # [N, R/2]
    if x.ndim == 3:
        ang = ang[:, None, :]
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def silu(x):
    return x / (1 + np.exp(-x))


def ffn(x, w, prefix):
    g = x @ w[f"{prefix}.gate_proj.weight"].T
    u = x @ w[f"{prefix}.up_proj.weight"].T
    return (silu(g) * u) @ w[f"{prefix}.down_proj.weight"].T


def route(x, w, prefix, cfg):
    """Returns (ids [N, k], weights [N, k]) per §4 (n_group = 1)."""
    logits = x @ w[f"{prefix}.gate.weight"].T
    s = 1 / (1 + np.exp(-logits))
    sel = s + w[f"{prefix}.gate.e_score_correction_bias"]
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]
    sw = np.take_along_axis(s, ids, axis=-1)
    return ids, sw / (sw.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor


def forward(w: dict[str, np.ndarray], cfg, tokens, positions, visible, capture=()):
    """tokens/positions [N], visible [N, N] bool -> (logits [N, V], {layer: residual output [N, H]})."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    y = cfg.rope_scaling
    inv = yarn_inv_freq(
        cfg.qk_rope_head_dim,
        cfg.rope_theta,
        y.factor,
        y.original_max_position_embeddings,
        y.beta_fast,
        y.beta_slow,
    )
    nh, p, r, vd, c = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    pos = np.asarray(positions, np.float64)
    h = w["embed_tokens.weight"][np.asarray(tokens)]
    n = h.shape[0]
    feats = {}
    for li in range(cfg.num_hidden_layers):
        a = f"layers.{li}.self_attn"
        x = rms(h, w[f"layers.{li}.input_layernorm.weight"], cfg.rms_norm_eps)
        cq = rms(x @ w[f"{a}.q_a_proj.weight"].T, w[f"{a}.q_a_layernorm.weight"], cfg.latent_norm_eps)
        q = (cq @ w[f"{a}.q_b_proj.weight"].T).reshape(n, nh, p + r)
        q_nope, q_pe = q[..., :p], rope(q[..., p:], pos, inv)
        kv = x @ w[f"{a}.kv_a_proj_with_mqa.weight"].T
        ckv = rms(kv[:, :c], w[f"{a}.kv_a_layernorm.weight"], cfg.latent_norm_eps)
        k_pe = rope(kv[:, c:], pos, inv)
        kvb = w[f"{a}.kv_b_proj.weight"].reshape(nh, p + vd, c)
        k_nope = np.einsum("hpc,tc->thp", kvb[:, :p], ckv)
        v = np.einsum("hvc,tc->thv", kvb[:, p:], ckv)
        s = (np.einsum("nhp,thp->hnt", q_nope, k_nope) + np.einsum("nhr,tr->hnt", q_pe, k_pe)) * softmax_scale(cfg)
        s = np.where(visible[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hnt,thv->nhv", s, v).reshape(n, nh * vd)
        h = h + o @ w[f"{a}.o_proj.weight"].T
        x = rms(h, w[f"layers.{li}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        m = f"layers.{li}.mlp"
        if not cfg.is_moe_layer(li):
            h = h + ffn(x, w, m)
        else:
            ids, rw = route(x, w, m, cfg)
            out = ffn(x, w, f"{m}.shared_experts") if cfg.n_shared_experts else np.zeros_like(x)
            for t in range(n):
                for j in range(ids.shape[1]):
                    out[t] += rw[t, j] * ffn(x[t : t + 1], w, f"{m}.experts.{ids[t, j]}")[0]
            h = h + out
        if li in capture:
            feats[li] = h.copy()
    logits = rms(h, w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
    return logits, feats
