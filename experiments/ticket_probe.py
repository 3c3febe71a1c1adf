"""A join across programs without a second kernel: "the last program reduces", checked and timed on the device.

    python -m experiments.ticket_probe                       # GPU: check --checks calls, then time both variants
    python -m experiments.ticket_probe --interpret --checks=3 --batches=2  # CPU: the logic in interpret mode

The pattern the drafter's fused layer kernels would need (notes_round.md, "reductions across programs without
nondeterminism"), at the drafter's attention-output shape (its 8 block rows padded to 16, as Triton dots need): B
sequences x G heads, one Pallas-Triton program per (b, g) multiplying its head's `[R, D]` rows by `[D, N]` weights
into an f32 partial `[R, N]`.

* `ticket`: each program stores its partial, waits for its own stores (a CTA barrier), and takes a ticket from its
  sequence's counter (an acquire-release atomic add at GPU scope). The program that draws the last ticket loads the
  G partials past L1 (`.cg`), sums them in head order in f32, adds the residual, stores `[R, N]` in bf16 and sets the
  counter back to 0. One launch; nobody waits for anybody, so no co-residency is assumed.
* `two_kernels`: the same kernel without the join, then XLA sums the partials in head order and adds the residual.

Check (`--checks` calls on fresh inputs): the ticket's output must equal, bit for bit, the residual plus its own
partials summed in head order (the kernel returns them), and every counter must be back at 0 after every call; a
stale or missing partial shows as a mismatch. Timing: `mla_common.per_call_time` over a `lax.fori_loop` that carries
the inputs, the counters and the output (each call's output is the next call's residual), the weights an argument of
the program, so nothing is dead code or a constant. Writes <out_dir>/<name>.json and .md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ddtree_jax.errors import UserError, run_app
from experiments import common
from experiments.mla_common import per_call_time

FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["32"], "sequences B (one join each)")
flags.DEFINE_integer("heads", 8, "programs G joined per sequence")
flags.DEFINE_integer("rows", 16, "rows R per program (Triton dots take at least 16)")
flags.DEFINE_integer("head_dim", 64, "inner size D of a program's product")
flags.DEFINE_integer("width", 256, "output columns N")
flags.DEFINE_integer("checks", 200, "calls checked bit for bit, each on fresh inputs")
flags.DEFINE_integer("inner", 200, "calls N of the shorter timed loop (the other runs 2N)")
flags.DEFINE_integer("repeats", 7, "timed runs of each loop program (median)")
flags.DEFINE_bool("interpret", False, "run the kernel in interpret mode (CPU)")
flags.DEFINE_string("name", "ticket_probe", "results file name")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

COLUMNS = ["variant", "batch", "heads", "checks", "mismatched_calls", "calls_leaving_counters", "us_per_call"]


def _kernel(
    a_ref, w_ref, resid_ref, count_in_ref, y_ref, part_ref, count_ref, *, heads: int, join: bool, barriers: bool
) -> None:
    """Program (b, g): part[b, g] = a[b, g] @ w[g] in f32; with `join` the last of sequence b's programs to finish
    writes y[b] = resid[b] + sum_g part[b, g] (head order) and zeroes count[b]. `barriers`: CTA barriers around the
    ticket (interpret mode, which runs one program at a time, has none)."""
    barrier = pltriton.debug_barrier if barriers else lambda: None
    del count_in_ref  # aliased to count_ref
    b, g = pl.program_id(0), pl.program_id(1)
    part = jnp.dot(a_ref[b, g], w_ref[g], preferred_element_type=jnp.float32)
    part_ref[b, g] = part
    if not join:
        return
    barrier()  # every thread's partial stored before the ticket's release
    ticket = pltriton.atomic_add(count_ref, (b,), jnp.int32(1))

    @pl.when(ticket == heads - 1)
    def _reduce():
        barrier()  # the acquire (one thread's atomic) before every thread's loads
        total = pltriton.load(part_ref.at[b, jnp.int32(0)], cache_modifier=".cg")
        for h in range(1, heads):
            total = total + pltriton.load(part_ref.at[b, jnp.int32(h)], cache_modifier=".cg")
        y_ref[b] = (resid_ref[b].astype(jnp.float32) + total).astype(y_ref.dtype)
        count_ref[b] = jnp.int32(0)


def call(
    a: jax.Array, w: jax.Array, resid: jax.Array, counts: jax.Array, *, join: bool, interpret: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """a `[B, G, R, D]`, w `[G, D, N]`, resid `[B, R, N]` bf16, counts `[B]` int32 (zeros) -> (y `[B, R, N]`,
    partials `[B, G, R, N]` f32, counts). Without `join`, y is XLA's head-order sum plus the residual."""
    bsz, heads, rows, _ = a.shape
    width = w.shape[-1]
    y, part, counts = pl.pallas_call(
        functools.partial(_kernel, heads=heads, join=join, barriers=not interpret),
        grid=(bsz, heads),
        out_shape=(
            jax.ShapeDtypeStruct(resid.shape, resid.dtype),
            jax.ShapeDtypeStruct((bsz, heads, rows, width), jnp.float32),
            jax.ShapeDtypeStruct(counts.shape, counts.dtype),
        ),
        input_output_aliases={3: 2},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(a, w, resid, counts)
    if not join:
        y = residual_plus_heads(resid, part)
    return y, part, counts


def residual_plus_heads(resid: jax.Array | np.ndarray, part: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    """resid `[B, R, N]` + part `[B, G, R, N]` summed over G in head order, in f32, rounded to resid's dtype: the
    join's arithmetic, on jax arrays (the `two_kernels` variant) or numpy arrays (the check, on the host)."""
    total = part[:, 0]
    for h in range(1, part.shape[1]):
        total = total + part[:, h]
    return (resid.astype(np.float32) + total).astype(resid.dtype)


def _inputs(key: jax.Array, bsz: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    ka, kw, kr = jax.random.split(key, 3)
    a = jax.random.normal(ka, (bsz, FLAGS.heads, FLAGS.rows, FLAGS.head_dim), jnp.bfloat16)
    w = (jax.random.normal(kw, (FLAGS.heads, FLAGS.head_dim, FLAGS.width)) / FLAGS.head_dim**0.5).astype(jnp.bfloat16)
    resid = jax.random.normal(kr, (bsz, FLAGS.rows, FLAGS.width), jnp.bfloat16)
    return a, w, resid


def check(bsz: int) -> tuple[int, int]:
    """(calls whose output differs from resid + its partials summed in head order, calls after which a counter is
    not back at 0)."""
    fn = jax.jit(functools.partial(call, join=True, interpret=FLAGS.interpret))
    counts = jnp.zeros((bsz,), jnp.int32)
    bad = left = 0
    for i in range(FLAGS.checks):
        a, w, resid = _inputs(jax.random.key(i), bsz)
        y, part, counts = fn(a, w, resid, counts)
        want = residual_plus_heads(np.asarray(resid), np.asarray(part))
        bad += int(not np.array_equal(np.asarray(y).view(np.uint16), want.view(np.uint16)))
        left += int(np.count_nonzero(np.asarray(counts)) > 0)
    return bad, left


def time_variant(bsz: int, join: bool) -> float:
    """Seconds per call in a loop carrying (a, resid, counts), w an argument: each call's output is the next call's
    residual."""
    a, w, resid = _inputs(jax.random.key(0), bsz)
    counts = jnp.zeros((bsz,), jnp.int32)

    def build(k: int):
        def run(a, w, resid, counts):
            def body(_, carry):
                a, resid, counts = carry
                y, _, counts = call(a, w, resid, counts, join=join, interpret=FLAGS.interpret)
                return lax.optimization_barrier((a, y, counts))

            return lax.fori_loop(0, k, body, (a, resid, counts))

        loop = jax.jit(run)
        return lambda: loop(a, w, resid, counts)

    return per_call_time(build, FLAGS.inner, FLAGS.repeats)[0]


def main(argv: list[str]) -> None:
    del argv
    sizes = {"rows": FLAGS.rows, "head_dim": FLAGS.head_dim, "width": FLAGS.width}
    for name, n in sizes.items():
        if n < 16 or n & (n - 1):
            raise UserError(f"--{name} must be a power of two of at least 16 (Triton dots), not {n}")
    records = []
    for bsz in (int(b) for b in FLAGS.batches):
        bad, left = check(bsz)
        for variant, join in (("ticket", True), ("two_kernels", False)):
            rec = {"variant": variant, "batch": bsz, "heads": FLAGS.heads}
            if join:
                rec |= {"checks": FLAGS.checks, "mismatched_calls": bad, "calls_leaving_counters": left}
            rec["us_per_call"] = time_variant(bsz, join) * 1e6
            records.append(rec)
            print(rec)
            common.write_results(FLAGS.name, records, COLUMNS, FLAGS.out_dir)


if __name__ == "__main__":
    run_app(main)
