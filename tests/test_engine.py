"""The speculative engine: lossless greedy and sampled output, cache compaction, one program with no host transfers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx

from ddtree_jax import engine
from ddtree_jax import tree as ddtree
from ddtree_jax.api import Generator
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.sampling import request_keys
from pallas_kernels.dispatch import OPS


def make_pair(seed: int, vocab: int = 97, block: int = 4):
    cfg = tiny_kimi_config(vocab_size=vocab)
    target = KimiForCausalLM(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32)
    drafter = DFlashDrafter(tiny_dflash_config(cfg, block_size=block), rngs=nnx.Rngs(seed + 1), dtype=jnp.float32)
    return target, drafter


def run(target, drafter, spec, prompts, plen, key=0):
    program, ts, ds = engine.compile_generate(target, drafter, spec)
    out = program(ts, ds, jnp.asarray(prompts), jnp.asarray(plen), request_keys(key, range(spec.batch)))
    return [np.asarray(out.tokens[b, : out.n_out[b]]).tolist() for b in range(spec.batch)], out


def random_prompts(rng, batch, max_len, vocab):
    plen = rng.integers(1, max_len + 1, batch).astype(np.int32)
    plen[0] = max_len
    prompts = rng.integers(0, vocab - 1, (batch, max_len)).astype(np.int32)
    return prompts, plen


def oracle_draft(reference: np.ndarray, noise: float, seed: int):
    """A stand-in for `engine.draft` whose logits favour the known target continuation `reference [B, M]`, with
    noise so that acceptance is partial and siblings get accepted: exercises deep walks and compaction."""
    ref = jnp.asarray(reference)

    def draft(target, drafter, s, kernels=None):
        d, v = drafter.config.num_draft, target.config.vocab_size
        idx = jnp.minimum(s.n_out[:, None] + jnp.arange(d)[None, :], ref.shape[1] - 1)
        want = jnp.take_along_axis(ref, idx, axis=1)
        key = jax.random.fold_in(jax.random.key(seed), jnp.sum(s.n_out))
        logits = 3.0 * jax.nn.one_hot(want, v) + noise * jax.random.normal(key, (s.root.shape[0], d, v))
        pend_pos = s.ctx_len[:, None] + jnp.arange(s.pend_feats.shape[1])[None, :]
        return logits, drafter.append_context(s.dcache, s.pend_feats, pend_pos, s.ctx_len)

    return draft


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_ar_with_trained_like_drafts(batch, monkeypatch):
    rng = np.random.default_rng(1)
    seed = int(rng.integers(1 << 20))
    target, drafter = make_pair(seed)
    prompts, plen = random_prompts(rng, batch, 7, 97)
    new = 24
    ar, _ = run(target, None, engine.GenSpec("ar", batch, 7, new), prompts, plen)
    reference = np.zeros((batch, new + 16), np.int32)
    for b, t in enumerate(ar):
        reference[b, : len(t)] = t
    monkeypatch.setattr(engine, "draft", oracle_draft(reference, noise=1.2, seed=seed))
    budgets = [1, 2, 4, 8, 16, 32, 64] if batch == 4 else [1, 8, 64]
    mean_tau = {}
    for method, budget in [("dflash", 1)] + [("ddtree", b) for b in budgets]:
        got, out = run(target, drafter, engine.GenSpec(method, batch, 7, new, budget=budget), prompts, plen)
        assert got == ar, f"{method} budget {budget}"
        hist = np.asarray(out.accept_hist)
        mean_tau[(method, budget)] = (hist * np.arange(hist.shape[1])).sum() / hist.sum()
    # The oracle makes acceptance real (so walks go deep and compaction moves entries); over 4 rows a wide tree
    # accepts more than the chain (one row of 24 tokens is too few rounds to compare reliably).
    assert mean_tau[("dflash", 1)] > 1.2
    if batch == 4:
        assert mean_tau[("ddtree", 64)] > mean_tau[("dflash", 1)]


@pytest.mark.parametrize("method,budget", [("dflash", 1), ("ddtree", 5), ("ddtree", 32)])
def test_greedy_speculative_equals_ar_with_real_drafter(method, budget):
    rng = np.random.default_rng(2)
    target, drafter = make_pair(int(rng.integers(1 << 20)), vocab=13)
    prompts, plen = random_prompts(rng, 3, 6, 13)
    ar, _ = run(target, None, engine.GenSpec("ar", 3, 6, 20), prompts, plen)
    got, _ = run(target, drafter, engine.GenSpec(method, 3, 6, 20, budget=budget), prompts, plen)
    assert got == ar


def test_stop_tokens_end_rows_independently():
    rng = np.random.default_rng(3)
    target, drafter = make_pair(int(rng.integers(1 << 20)))
    prompts, plen = random_prompts(rng, 4, 5, 97)
    free, _ = run(target, None, engine.GenSpec("ar", 4, 5, 16), prompts, plen)
    stop = free[1][5]  # a token row 1 emits at step 6: every row must stop at its first occurrence of it
    for method in ("ar", "ddtree"):
        got, _ = run(target, drafter, engine.GenSpec(method, 4, 5, 16, budget=8, stop_ids=(stop,)), prompts, plen)
        for g, f in zip(got, free, strict=True):
            cut = f.index(stop) + 1 if stop in f else len(f)
            assert g == f[:cut]


def run_rounds(target, drafter, spec, prompts, plen, rounds):
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter)

    @jax.jit
    def f(ts, ds, prompts, plen):
        t, d = nnx.merge(tg, ts), nnx.merge(dg, ds)
        s = engine.prefill(t, d, spec, prompts, plen, request_keys(0, range(spec.batch)))
        return jax.lax.fori_loop(0, rounds, lambda i, st: engine.spec_round(t, d, spec, st), s)

    return f(ts, ds, jnp.asarray(prompts), jnp.asarray(plen))


@pytest.mark.parametrize("rounds", [1, 3])
def test_compacted_cache_equals_linear_decode_cache(rounds, monkeypatch):
    rng = np.random.default_rng(4)
    seed = int(rng.integers(1 << 20))
    target, drafter = make_pair(seed)
    prompts, plen = random_prompts(rng, 3, 6, 97)
    ar, _ = run(target, None, engine.GenSpec("ar", 3, 6, 30), prompts, plen)
    reference = np.zeros((3, 48), np.int32)
    for b, t in enumerate(ar):
        reference[b, : len(t)] = t
    monkeypatch.setattr(engine, "draft", oracle_draft(reference, noise=1.0, seed=seed))
    spec = engine.GenSpec("ddtree", 3, 6, 30, budget=12)
    s = run_rounds(target, drafter, spec, prompts, plen, rounds)
    layers = drafter.config.target_layer_ids
    moved = False
    for b in range(3):
        n_out, start = int(s.n_out[b]), int(s.start[b])
        committed = np.concatenate([prompts[b, : plen[b]], np.asarray(s.out[b, : n_out - 1])])
        assert len(committed) == start
        pos = jnp.arange(start)[None]
        lin = target(
            jnp.asarray(committed[None]),
            pos,
            target.init_cache(1, start),
            jnp.zeros((1,), jnp.int32),
            feature_layers=layers,
        )
        for c, r in zip(s.cache, lin.cache, strict=True):
            np.testing.assert_allclose(np.asarray(c[b, :start]), np.asarray(r[0]), rtol=2e-4, atol=2e-5)
        # Drafter context: committed positions < ctx_len are projected; the rest wait in pend_feats.
        ctx, pend = int(s.ctx_len[b]), int(s.pend_count[b])
        assert ctx + pend == start
        k, v = drafter.context_kv(lin.features, pos)
        np.testing.assert_allclose(np.asarray(s.dcache.k[:, b, :ctx]), np.asarray(k[:, 0, :ctx]), rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(np.asarray(s.dcache.v[:, b, :ctx]), np.asarray(v[:, 0, :ctx]), rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(
            np.asarray(s.pend_feats[b, :pend]), np.asarray(lin.features[0, ctx:start]), rtol=2e-4, atol=2e-5
        )
        moved |= pend > 1
    assert moved, "no round accepted a draft: the test did not exercise compaction"


def test_loop_runs_with_host_transfers_disallowed():
    target, drafter = make_pair(3)
    spec = engine.GenSpec("ddtree", 2, 5, 12, budget=8)
    program, ts, ds = engine.compile_generate(target, drafter, spec)
    args = jax.device_put((np.ones((2, 5), np.int32), np.array([5, 3], np.int32), request_keys(1, [0, 1])))
    with jax.transfer_guard("disallow"):
        out = program(ts, ds, *args)
        out.tokens.block_until_ready()
    assert int(out.n_out[0]) == 12


def test_one_compiled_program_per_shape():
    target, drafter = make_pair(4)
    gen = Generator(target, drafter)
    a = gen.generate([[1, 2, 3], [4, 5]], method="ddtree", budget=4, max_new_tokens=6)
    b = gen.generate([[7], [8, 9, 10, 11]], method="ddtree", budget=4, max_new_tokens=6)
    assert a.compile_s > 0 and b.compile_s == 0 and len(gen._compiled) == 1
    assert all(len(t) == 6 for t in a.tokens + b.tokens)
    assert a.stats[0]["rounds"] >= 1 and len(a.stats[0]["accept_hist"]) == drafter.config.block_size


def test_precompile_on_threads_serves_later_calls():
    target, drafter = make_pair(5)
    gen = Generator(target, drafter)
    kw = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    specs = [gen.spec(2, 4, method=m, budget=3, **kw) for m in ("ar", "dflash", "ddtree")]
    gen.precompile(specs + specs[:1], workers=3)
    assert set(gen.compile_seconds) == set(specs) and all(t > 0 for t in gen.compile_seconds.values())
    for m, spec in zip(("ar", "dflash", "ddtree"), specs, strict=True):
        res = gen.generate([[1, 2], [3, 4, 5]], method=m, budget=3, max_new_tokens=5, ignore_eos=True)
        assert res.compile_s == 0 and res.spec == spec


# ---- temperature > 0: the distribution of generated sequences is the target's -------------------------------


def reference_log_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, float]:
    """log q `[N, V]` float64 of the sampling distribution for logits `[N, V]`, written apart from
    `sampling.transform_logits`: softmax(logits / temperature) restricted to the tokens whose logit is >= the k-th
    largest, renormalised, then to the fewest most probable tokens of mass >= top_p (ties with the last included),
    renormalised. Also returns the smallest distance of a cumulative mass to top_p (how safely f32 agrees)."""
    x = logits.astype(np.float64) / temperature
    if top_k:
        x = np.where(x >= np.sort(x, axis=1)[:, -top_k][:, None], x, -np.inf)
    q = np.exp(x - x.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    margin = np.inf
    if top_p < 1:
        ranked = -np.sort(-q, axis=1)
        cum = np.cumsum(ranked, axis=1)
        last = np.argmax(cum >= top_p, axis=1)  # the first rank reaching top_p
        q = np.where(q >= ranked[np.arange(len(q)), last][:, None], q, 0.0)
        q /= q.sum(1, keepdims=True)
        margin = np.abs(cum - top_p).min()
    with np.errstate(divide="ignore"):
        return np.log(q), margin


def exact_joint(target, prompt, vocab, steps, temperature=1.0, top_k=0, top_p=1.0):
    """q(t1..t_steps | prompt) for every sequence, from the target's own conditionals transformed as the sampler
    transforms them (`reference_log_probs`)."""
    seqs = np.array(np.meshgrid(*[np.arange(vocab)] * steps, indexing="ij")).reshape(steps, -1).T
    full = np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], 1)
    n = full.shape[1]
    out = target(
        jnp.asarray(full),
        jnp.broadcast_to(jnp.arange(n), full.shape),
        target.init_cache(len(seqs), n),
        jnp.zeros((len(seqs),), jnp.int32),
    )
    logits = np.asarray(target.logits(out.hidden), np.float64)
    p0 = len(prompt) - 1
    total = 0.0
    for j in range(steps):
        logq, margin = reference_log_probs(logits[:, p0 + j], temperature, top_k, top_p)
        assert margin > 1e-4, f"a cumulative mass within {margin:.1e} of top_p: f32 and f64 might keep other sets"
        total = total + logq[np.arange(len(seqs)), seqs[:, j]]
    return seqs, np.exp(total)


def chi_square_z(samples: np.ndarray, seqs: np.ndarray, probs: np.ndarray, vocab: int) -> float:
    """Pearson chi-square of sampled sequences against `probs` (cells pooled to expected >= 5), as a z-score."""
    codes = samples @ (vocab ** np.arange(samples.shape[1])[::-1])
    cell = seqs @ (vocab ** np.arange(seqs.shape[1])[::-1])
    counts = np.bincount(codes, minlength=vocab ** seqs.shape[1])[cell]
    exp = probs * len(samples)
    order = np.argsort(exp)
    pooled_o, pooled_e, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_o, acc_e = acc_o + counts[i], acc_e + exp[i]
        if acc_e >= 5:
            pooled_o.append(acc_o)
            pooled_e.append(acc_e)
            acc_o = acc_e = 0.0
    pooled_o[-1] += acc_o
    pooled_e[-1] += acc_e
    o, e = np.array(pooled_o), np.array(pooled_e)
    stat, df = ((o - e) ** 2 / e).sum(), len(o) - 1
    return (stat - df) / np.sqrt(2 * df)


def biased_walk(original):
    """A lossy rule wrapped around the real walk: the root's first child (the drafter's top token) is always
    accepted."""

    def walk(tree, post, max_depth, anc=None):
        forced = post.at[0].set(jnp.where(tree.valid[1], tree.tokens[1], post[0]))
        return original(tree, forced, max_depth, anc)

    return walk


@pytest.mark.parametrize("method,budget", [("ddtree", 12), ("dflash", 1)])
def test_sampling_matches_target_distribution(method, budget, monkeypatch):
    vocab, steps, n = 6, 3, 3000
    target, drafter = make_pair(7, vocab=vocab, block=4)
    prompt = np.array([1, 4, 2, 3], np.int32)
    seqs, probs = exact_joint(target, prompt, vocab, steps)
    prompts, plen = np.broadcast_to(prompt, (n, 4)).copy(), np.full((n,), 4, np.int32)

    def sample_tokens():
        spec = engine.GenSpec(method, n, 4, steps, budget=budget, temperature=1.0)
        got, _ = run(target, drafter, spec, prompts, plen, key=int(np.random.randint(1 << 30)))
        return np.array(got)

    assert abs(chi_square_z(sample_tokens(), seqs, probs, vocab)) < 5
    monkeypatch.setattr(ddtree, "follow_verified_tree", biased_walk(ddtree.follow_verified_tree))
    assert chi_square_z(sample_tokens(), seqs, probs, vocab) > 10


def test_transform_logits_keeps_ties_and_the_top_token():
    """top_k keeps every token tied with the k-th; top_p the fewest tokens of mass >= top_p plus ties with the last of
    them, computed on the temperature-scaled, top-k-renormalised distribution; the top token always stays."""
    from ddtree_jax.sampling import transform_logits

    logits = jnp.log(jnp.array([[0.4, 0.2, 0.2, 0.1, 0.1], [0.9, 0.04, 0.03, 0.02, 0.01]]))

    def kept(**kw):
        return np.isfinite(np.asarray(transform_logits(logits, **kw))).astype(int).tolist()

    assert kept(temperature=1.0, top_k=2) == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert kept(temperature=1.0, top_p=0.5) == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert kept(temperature=1.0, top_p=0.01) == [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    # top-k first: row 1 renormalised over {0.9, 0.04} puts 0.957 on the first token, so top_p=0.95 keeps it alone
    assert kept(temperature=1.0, top_k=2, top_p=0.95) == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert kept(temperature=1.0, top_p=0.95) == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # temperature first: at 0.5 row 1's top token has mass 0.9^2 / 0.8130 = 0.996
    assert kept(temperature=0.5, top_p=0.99) == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    scaled = np.asarray(transform_logits(logits, temperature=0.5, top_k=2))
    np.testing.assert_allclose(scaled[0, :3], np.asarray(logits[0, :3]) / 0.5, rtol=1e-6)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 3, 1.0), (1.0, 0, 0.7), (0.7, 4, 0.75)], ids=["top_k", "top_p", "both"]
)
def test_top_k_top_p_sampling_matches_transformed_distribution(method, temperature, top_k, top_p, monkeypatch):
    """Every method samples sequences from the target's temperature -> top-k -> top-p distribution (the exact one,
    `exact_joint`): no sequence outside it, frequencies within |z| < 5. The lossy walk is still detected."""
    vocab, steps, n = 6, 3, 3000
    target, drafter = make_pair(7, vocab=vocab, block=4)
    prompt = np.array([1, 4, 2, 3], np.int32)
    seqs, probs = exact_joint(target, prompt, vocab, steps, temperature, top_k, top_p)
    assert (probs == 0).sum() > len(probs) // 2  # the transform removes most sequences
    prompts, plen = np.broadcast_to(prompt, (n, 4)).copy(), np.full((n,), 4, np.int32)
    spec = engine.GenSpec(method, n, 4, steps, budget=12, temperature=temperature, top_k=top_k, top_p=top_p)

    def sample_tokens():
        got, _ = run(target, drafter if method != "ar" else None, spec, prompts, plen, int(np.random.randint(1 << 30)))
        return np.array(got)

    got = sample_tokens()
    codes = got @ (vocab ** np.arange(steps)[::-1])
    assert probs[codes].min() > 0, "sampled a sequence outside the top-k / top-p set"
    z = chi_square_z(got, seqs, probs, vocab)
    print(f"{method} temperature={temperature} top_k={top_k} top_p={top_p}: z = {z:.2f}")
    assert abs(z) < 5
    if method == "ddtree" and top_k and top_p < 1:
        monkeypatch.setattr(ddtree, "follow_verified_tree", biased_walk(ddtree.follow_verified_tree))
        assert chi_square_z(sample_tokens(), seqs, probs, vocab) > 10


# ---- reliability: numerics guard and determinism ------------------------------------------------------------


def test_nonfinite_logits_stop_the_row_and_name_the_round():
    rng = np.random.default_rng(5)
    for _ in range(20):  # find a token that row 1 emits at step 3 and nothing else has seen before
        target, _ = make_pair(int(rng.integers(1 << 20)))
        prompts, plen = random_prompts(rng, 3, 5, 97)
        free, _ = run(target, None, engine.GenSpec("ar", 3, 5, 8), prompts, plen)
        bad = free[1][3]
        # no other row ever feeds `bad` back (padding slots are embedded too, and Generator pads with 0);
        # row 1 first does at round 4
        seen = set(prompts.ravel().tolist()) | {0} | set(free[0]) | set(free[2])
        if bad not in seen and bad not in free[1][:3]:
            break
    else:
        pytest.skip("no suitable token found")
    target.embed_tokens[...] = target.embed_tokens[...].at[bad].set(jnp.nan)
    _, out = run(target, None, engine.GenSpec("ar", 3, 5, 8), prompts, plen)
    assert int(out.bad_round[1]) == 4 and int(out.n_out[1]) == 4  # out[3] is fed back in round 4
    gen = Generator(target)
    with pytest.raises(Exception, match=r"round 4 of batch row 1"):
        # ignore_eos: `run` has no stop ids, so with them row 1 could stop on the tiny config's EOS before round 4
        gen.generate([list(prompts[b, : plen[b]]) for b in range(3)], method="ar", max_new_tokens=8, ignore_eos=True)


def test_same_seed_same_sample_and_rows_independent_of_batch():
    rng = np.random.default_rng(6)
    target, drafter = make_pair(int(rng.integers(1 << 20)))
    gen = Generator(target, drafter)
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 7, 5, 2)]
    kw = dict(method="ddtree", budget=6, max_new_tokens=10, temperature=1.0)
    assert gen.generate(prompts, seed=5, **kw).tokens == gen.generate(prompts, seed=5, **kw).tokens
    greedy = gen.generate(prompts, method="ddtree", budget=6, max_new_tokens=10).tokens
    for i, p in enumerate(prompts):
        alone = gen.generate([p], method="ddtree", budget=6, max_new_tokens=10, pad_batch_to=4).tokens[0]
        assert alone == greedy[i]


def test_chunked_prefill_equals_single_pass():
    """Long prompts are prefilled chunk by chunk (absorbed MLA over the cache): same caches, same tokens."""
    rng = np.random.default_rng(7)
    target, drafter = make_pair(int(rng.integers(1 << 20)))
    prompts, plen = random_prompts(rng, 3, 11, 97)
    whole = engine.GenSpec("ddtree", 3, 11, 10, budget=6)
    chunked = engine.GenSpec("ddtree", 3, 11, 10, budget=6, prefill_chunk=4)
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter)

    def prefill(ts, ds, p, n, spec):
        return engine.prefill(nnx.merge(tg, ts), nnx.merge(dg, ds), spec, p, n, request_keys(0, range(3)))

    states = [
        jax.jit(prefill, static_argnums=4)(ts, ds, jnp.asarray(prompts), jnp.asarray(plen), spec)
        for spec in (whole, chunked)
    ]
    a, b = states
    np.testing.assert_array_equal(np.asarray(a.root), np.asarray(b.root))
    for row in range(3):
        n = int(plen[row])
        for ca, cb in zip(a.cache, b.cache, strict=True):
            np.testing.assert_allclose(np.asarray(ca[row, :n]), np.asarray(cb[row, :n]), rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(
            np.asarray(a.dcache.k[:, row, :n]), np.asarray(b.dcache.k[:, row, :n]), rtol=2e-4, atol=2e-5
        )
    got = [run(target, drafter, spec, prompts, plen)[0] for spec in (whole, chunked)]
    assert got[0] == got[1]


KERNEL_CHANGES = [
    ({"moe_swiglu": "reference"}, None),
    ({"mla_attention": "reference"}, None),
    ({"build_tree": "interpret"}, None),
    (dict.fromkeys(OPS, "reference"), ("DDTREE_KERNELS", "reference")),
    ({"mla_kernel": "mosaic"}, ("DDTREE_MLA_KERNEL", "mosaic")),
    ({"mla_tiling": "num_splits=3"}, ("DDTREE_MLA_TILING", "num_splits=3")),
    ({"topk_chunk": 16}, ("DDTREE_TOPK_CHUNK", "16")),
]


def test_changing_a_kernel_setting_between_calls_compiles_a_new_program(monkeypatch):
    """Each setting of the kernel selection, changed between two `generate` calls (explicitly, or through its
    environment variable, which chooses the default), compiles a new program carrying it; changing it back reuses
    the first program. One generator takes every change in turn, so the first program is compiled once."""
    from pallas_kernels.dispatch import Kernels, tiling_from_text

    target, drafter = make_pair(int(np.random.default_rng(8).integers(1 << 20)), vocab=13)
    gen = Generator(target, drafter, tokenizer=None)
    built: list[engine.GenSpec] = []
    real = engine.compile_generate
    monkeypatch.setattr(engine, "compile_generate", lambda t, d, spec: built.append(spec) or real(t, d, spec))
    for var in ("DDTREE_KERNELS", "DDTREE_MLA_KERNEL", "DDTREE_MLA_TILING", "DDTREE_TOPK_CHUNK"):
        monkeypatch.delenv(var, raising=False)
    kw = dict(method="ddtree", budget=4, max_new_tokens=3)
    first = gen.generate([[1, 2, 3]], **kw)
    assert [s.kernels for s in built] == [Kernels()]
    for changes, env in KERNEL_CHANGES:
        built.clear()
        tiling = {"mla_tiling": tiling_from_text(changes["mla_tiling"])} if "mla_tiling" in changes else {}
        want = dataclasses.replace(Kernels(), **changes | tiling)
        if env is None:
            changed = gen.generate([[1, 2, 3]], kernels=want, **kw)
        else:  # the environment chooses the default selection, read at each call
            monkeypatch.setenv(*env)
            changed = gen.generate([[1, 2, 3]], **kw)
            monkeypatch.delenv(env[0])
        assert [s.kernels for s in built] == [want] and changed.spec.kernels == want, changes
        assert changed.compile_s > 0 and changed.tokens == first.tokens, changes
        again, explicit = gen.generate([[1, 2, 3]], **kw), gen.generate([[1, 2, 3]], kernels=want, **kw)
        assert (again.spec, explicit.spec) == (first.spec, changed.spec), changes
        assert again.compile_s == explicit.compile_s == 0, changes
        assert len(built) == 1, changes


def test_float32_model_compiles_with_full_precision_matmuls():
    """A float32 model's program asks for HIGHEST precision on every dot (on a GPU XLA's default runs f32 matmuls in
    TF32); a bf16 model's keeps the ambient default. The suite sets "highest" globally, so the test resets it."""
    cfg = tiny_kimi_config()
    for dtype, want_highest in ((jnp.float32, True), (jnp.bfloat16, False)):
        target = KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype)
        with jax.default_matmul_precision("default"):
            compiled, _, _ = engine.compile_generate(target, None, engine.GenSpec("ar", 1, 8, 4))
        hlo = compiled.as_text()
        dots, highest = hlo.count(" dot("), hlo.count("operand_precision={highest,highest}")
        assert dots > 0 and highest == (dots if want_highest else 0), (dtype, dots, highest)
