"""Small Python API for scripts and notebooks: load a target (+ drafter), generate for a batch, get stats.

gen = Generator.load("checkpoints/kimi-mini", "checkpoints/kimi-mini-dflash")
res = gen.generate_text(["def fibonacci(n):"], method="ddtree", budget=16, max_new_tokens=64)
res.texts[0], res.stats[0]["tokens_per_round"], res.tokens_per_s
res = gen.generate([[1, 2, 3], [4, 5]], method="ar")  # token ids in, res.tokens out
res = gen.generate([[1, 2, 3]], method="auto")  # per batch, the program the cost table expects fastest (res.auto)
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh

from ddtree_jax import cost_table, engine, sharding, stops
from ddtree_jax.config import check_pair
from ddtree_jax.errors import NumericsError, UserError
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.sampling import request_keys
from ddtree_jax.tokenizer import check_messages
from pallas_kernels.dispatch import Kernels

PROMPT_BUCKET = 32  # prompts are right-padded to a multiple of this, so few shapes get compiled


def default_dtype():
    """float32 on a CPU backend: exact there (every method gives the same tokens, see docs/exactness.md) and no
    slower than bfloat16 on most CPUs; bfloat16 on an accelerator."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def exact_by_default(one_device: bool, dtype) -> bool:
    """The exact numerics' default: on for bfloat16 on one GPU (no mesh), where their cost at batch 1 is within 10%
    (docs/exactness.md), else off: a CPU runs float32 by default, exact there without them, and they do not cover a
    device mesh yet."""
    return one_device and jax.default_backend() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16


def resolve_exact(exact: bool | None, mesh: Mesh | None, dtype) -> bool:
    """Whether programs run the exact (batch- and tree-invariant) numerics: `exact`; None: `exact_by_default`.
    They do not cover a device mesh yet, so exact=True with one is a `UserError`."""
    if exact and mesh is not None:
        raise UserError(
            "the exact numerics do not cover a device mesh yet (GSPMD cannot split their kernels): run on one device, "
            "or without --exact"
        )
    if exact is None:
        return exact_by_default(mesh is None, dtype)
    return bool(exact)


def padded_prompt_len(longest: int) -> int:
    """The prompt length a batch whose longest prompt has `longest` tokens is compiled for."""
    return PROMPT_BUCKET * math.ceil(longest / PROMPT_BUCKET)


def padded_prompts(rows: Sequence[Sequence[int]], prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A program's prompt arguments: `rows` right-padded with 0 to `[B, prompt_len]` int32, and their lengths `[B]`."""
    padded = np.zeros((len(rows), prompt_len), np.int32)
    for i, p in enumerate(rows):
        padded[i, : len(p)] = p
    return padded, np.asarray([len(p) for p in rows], np.int32)


@dataclasses.dataclass
class GenerationResult:
    """One `generate` call. The batch runs as one program: `wall_s` is its execution for the whole batch
    (compilation excluded, that is `compile_s`), and `tokens_per_s` the aggregate rate over it. A row leaves the
    loop when it finishes, so its own latency is estimated from its rounds: stats' `est_latency_s` is wall_s x the
    row's rounds / `batch_rounds` (prefill shared pro rata), `est_tokens_per_s` the row's tokens over that. Rates
    count every token the program generated, also those past a stop string."""

    tokens: list[list[int]]  # generated ids per row (a stop token, or the tokens spelling a stop string, included)
    texts: list[str] | None  # the rows' tokens decoded (cut before a stop string), when the Generator has a tokenizer
    # per row: rounds, tokens_per_round, accept_hist (count of rounds committing 1..D+1 tokens), finish_reason
    # ("stop": a stop token id or stop string ended it, "length": max_new_tokens did), est_latency_s, est_tokens_per_s
    stats: list[dict]
    wall_s: float  # execution seconds of the compiled program for the whole batch (compilation excluded)
    compile_s: float  # compilation seconds paid by this call (0 when cached)
    tokens_per_s: float  # aggregate: tokens the program generated for the whole batch / wall_s
    batch_rounds: int  # rounds the program ran: its longest row's
    spec: engine.GenSpec  # the program that ran
    auto: cost_table.Choice | None = None  # with method="auto": what it chose and why; None for a given method

    @property
    def method(self) -> str:
        """The method that ran (with method="auto", the one chosen)."""
        return self.spec.method

    @property
    def budget(self) -> int | None:
        """DDTree's node budget that ran; None for ar and dflash."""
        return self.spec.budget if self.spec.method == "ddtree" else None


class Generator:
    """A target model, an optional DFlash drafter and tokenizer, a cache of compiled programs, and the cost table
    (with the acceptance observed so far) that `method="auto"` chooses by."""

    def __init__(
        self,
        target: KimiForCausalLM,
        drafter: DFlashDrafter | None = None,
        tokenizer=None,
        *,
        mesh: Mesh | str | None = None,
        trained_context: int | None = None,
        exact: bool | None = None,
        calibration: cost_table.CostTable | Path | None = None,
    ):
        """mesh: a `jax.sharding.Mesh` or spec like "expert=8,tensor=1" (sharding.py); None: all local devices
        on `expert` when there are several, else the single-device program. Params are placed on it.
        trained_context: the window length the target was trained on, if known; longer requests are logged.
        exact: every program computes a token's target logits independently of the batch, the method and the tree
        (`Kernels.exact`), so speculative output equals `ar`'s bit for bit; `resolve_exact` settles None.
        calibration: the cost table of `method="auto"` (`use_calibration`)."""
        if drafter is not None:
            check_pair(target.config, drafter.config)
        self.mesh = sharding.resolve_mesh(mesh)
        if self.mesh is not None:
            sharding.shard_model(target, self.mesh)
            if drafter is not None:
                sharding.shard_model(drafter, self.mesh)
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.trained_context = trained_context
        self.exact = resolve_exact(exact, self.mesh, target.dtype)
        self._compiled: dict[engine.GenSpec, tuple] = {}  # spec (kernel selection included) -> program and states
        self.compile_seconds: dict[engine.GenSpec, float] = {}  # per program, however it was compiled
        self.use_calibration(calibration)

    @property
    def target_config(self):
        return self.target.config

    def use_calibration(self, table: cost_table.CostTable | Path | None) -> None:
        """Make `table` (a path: read when first needed) the one `method="auto"` chooses by, checked against this
        Generator's devices and dtype when auto uses it; its acceptance is where `acceptance` starts."""
        self._calibration = table
        loaded = isinstance(table, cost_table.CostTable)
        self.acceptance = cost_table.Acceptance(table) if loaded else None

    @property
    def calibration(self) -> cost_table.CostTable | None:
        """The cost table of `method="auto"`, if any (read now when it was given as a path)."""
        if isinstance(self._calibration, Path):
            self.use_calibration(cost_table.CostTable.load(self._calibration))
        return self._calibration

    def device_identity(self) -> dict[str, str | int]:
        """What a cost table must have been measured on to serve this Generator (`device_identity`)."""
        return device_identity(self.mesh, self.target.dtype, self.exact)

    @classmethod
    def load(
        cls,
        target_dir: str | Path,
        drafter_dir: str | Path | None = None,
        *,
        dtype=None,
        mesh: str | None = None,
        exact: bool | None = None,
        calibration: str | Path | None = None,
    ) -> Generator:
        """Load HF-format checkpoints, each a directory or a Hugging Face model id (`ddtree_jax.hub`), and the
        target's tokenizer when it has one.

        dtype: weights and activations; None: `default_dtype()` (float32 on a CPU, bfloat16 on an accelerator).
        mesh, exact: as in `__init__`; each target tensor goes straight to its shards as it is read.
        calibration: the cost table of `method="auto"` (`ddtree-calibrate` writes it), refused at once (`UserError`)
        if malformed or measured on other devices or in another dtype; None: the drafter's calibration.json when it
        has one, read (and refused) only when auto needs it."""
        dtype = default_dtype() if dtype is None else dtype
        from ddtree_jax.checkpoint import load_target
        from ddtree_jax.dflash_checkpoint import load_drafter
        from ddtree_jax.hub import resolve_checkpoint
        from ddtree_jax.tokenizer import has_tokenizer, load_tokenizer

        target_dir, drafter_dir = resolve_checkpoint(target_dir), drafter_dir and resolve_checkpoint(drafter_dir)
        mesh = sharding.resolve_mesh(mesh)
        exact = resolve_exact(exact, mesh, dtype)  # refused before any weight is read
        beside = Path(drafter_dir or "") / cost_table.FILE_NAME
        table = beside if drafter_dir is not None and beside.is_file() else None
        if calibration is not None:
            table = cost_table.CostTable.load(calibration)
            table.check(**device_identity(mesh, dtype, exact))
        place = sharding.sharding_fn(mesh) if mesh is not None else None
        target = load_target(target_dir, dtype=dtype, sharding_fn=place)
        drafter = load_drafter(drafter_dir, dtype=dtype) if drafter_dir is not None else None
        tok = load_tokenizer(target_dir) if has_tokenizer(target_dir) else None
        window = trained_context(Path(target_dir))
        return cls(target, drafter, tok, mesh=mesh, trained_context=window, calibration=table, exact=exact)

    def spec(
        self,
        batch: int,
        prompt_len: int,
        *,
        method: str,
        budget: int | None,
        temperature: float,
        max_new_tokens: int,
        ignore_eos: bool,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        kernels: Kernels | None = None,
    ) -> engine.GenSpec:
        """The program for these settings (method: ar, dflash or ddtree; budget None: `engine.DEFAULT_BUDGET`;
        kernels None: `Kernels.from_env()`, read now; its `exact` is this generator's). Its stop ids are stop_token_ids
        and, unless ignore_eos, the target's EOS ids; ids outside the vocabulary are a ValueError."""
        vocab = self.target.config.vocab_size
        bad = [i for i in stop_token_ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"stop token ids {bad} outside the vocabulary [0, {vocab})")
        eos = () if ignore_eos else self.target.config.stop_token_ids
        return engine.GenSpec(
            method=method,
            batch=batch,
            prompt_len=padded_prompt_len(prompt_len),
            max_new_tokens=max_new_tokens,
            budget=engine.DEFAULT_BUDGET if budget is None else budget,
            temperature=float(temperature),
            top_k=top_k,
            top_p=float(top_p),
            stop_ids=tuple(sorted({*stop_token_ids, *eos})),
            kernels=dataclasses.replace(Kernels.or_env(kernels), exact=self.exact),
        )

    def spec_for(
        self, prompts: Sequence[Sequence[int]], *, pad_batch_to: int | None = None, **settings
    ) -> engine.GenSpec:
        """The program `generate(prompts, pad_batch_to=..., **settings)` runs (settings: `spec`'s keywords), e.g.
        to `precompile` it."""
        return self.spec(max(len(prompts), pad_batch_to or 0), max(len(p) for p in prompts), **settings)

    def compiled(self, spec: engine.GenSpec):
        """The compiled program for `spec` (its kernel selection, `spec.kernels`, included) and the seconds spent
        compiling it now (0 if cached)."""
        if spec in self._compiled:
            return self._compiled[spec], 0.0
        t0 = time.perf_counter()
        drafter = self.drafter if spec.method != "ar" else None
        with sharding.use_mesh(self.mesh):
            self._compiled[spec] = engine.compile_generate(self.target, drafter, spec)
        dt = time.perf_counter() - t0
        self.compile_seconds[spec] = dt
        logging.info("compiled %s in %.1fs", spec, dt)
        return self._compiled[spec], dt

    def precompile(self, specs: Sequence[engine.GenSpec], workers: int) -> float:
        """Compile the `specs` not cached yet on `workers` threads (XLA compiles outside the GIL, so a many-core
        host overlaps them). Returns the wall seconds; each program's own time goes to `compile_seconds`."""
        todo = list(dict.fromkeys(s for s in specs if s not in self._compiled))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(self.compiled, todo))
        return time.perf_counter() - t0

    def choose(self, batch: int, context: int, max_new_tokens: int) -> cost_table.Choice:
        """What `method="auto"` runs for a batch of `batch` rows (the padded batch size) whose longest prompt has
        `context` tokens, generating `max_new_tokens`: `ar` without a drafter, else the cost table's fastest
        candidate at the acceptance observed so far (`cost_table.Acceptance`), `ar` unless that one is expected more
        than `cost_table.AR_MARGIN` faster (`CostTable.choose`).
        A `UserError` when there is no table, or one measured on other devices or in another dtype."""
        if self.drafter is None:
            return cost_table.Choice(cost_table.Candidate("ar"), batch, context, {}, cost_table.NO_DRAFTER)
        if self.calibration is None:
            raise UserError(
                'method "auto" needs a cost table: run ddtree-calibrate --target=... --drafter=... --prompts=... '
                f"(it writes {cost_table.FILE_NAME} beside the drafter), or pass calibration= or another method"
            )
        self.calibration.check(**self.device_identity())
        return self.calibration.choose(batch, context, max_new_tokens, self.acceptance.means(batch, context))

    def generate(
        self,
        prompts: list[list[int]],
        *,
        method: str = "ddtree",
        budget: int | None = None,
        temperature: float = 0.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        request_indices: Sequence[int] | None = None,
        ignore_eos: bool = False,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        pad_batch_to: int | None = None,
        kernels: Kernels | None = None,
    ) -> GenerationResult:
        """Generate for a batch of token-id prompts (different lengths allowed).

        method: "ar", "dflash", "ddtree" (budget: its node budget, None: `engine.DEFAULT_BUDGET`) or "auto": the
        program `choose` picks for this batch, budget included (so auto takes no budget); the result's `auto` says
        what it chose and why, and the batch's acceptance updates `acceptance`. Every method gives
        the target's own output (greedy: `ar`'s tokens).

        Sampling (temperature > 0): prompt i's randomness depends only on (seed, request_indices[i]) (default
        request_indices: 0..n-1), not on the batch it shares, its row or the batch size. Give each request its own
        index (e.g. its position in a file) to draw independent samples; the same (seed, index) repeats a sample.
        pad_batch_to: run the program at this batch size (extra rows repeat the last prompt and are dropped) so
        batches share one compilation. kernels: the kernel selection (None: `Kernels.from_env()`); each selection
        compiles its own program.

        top_k / top_p (temperature > 0): sample from the top-k, then top-p (nucleus) set (`sampling.transform_logits`);
        every method samples from that same distribution. stop_token_ids: extra ids that end a row on device (with
        the target's EOS ids; ignore_eos drops only the EOS ids). stop_strings (needs the tokenizer): each row is cut
        on the host at the first stop string in its generated text (`stops.cut_at_stop_strings`); the program still
        runs until max_new_tokens or a stop id."""
        if not prompts or any(isinstance(p, str) or len(p) == 0 for p in prompts):
            raise ValueError("prompts are non-empty lists of token ids (`generate_text` takes strings or messages)")
        stop_strings = stops.check_stop_strings(stop_strings)
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need the target's tokenizer (tiktoken.model or tokenizer.json)")
        indices = list(range(len(prompts))) if request_indices is None else list(request_indices)
        if len(indices) != len(prompts):
            raise ValueError(f"{len(indices)} request_indices for {len(prompts)} prompts")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if self.trained_context is not None and longest > self.trained_context:
            logging.log_first_n(
                logging.WARNING,
                "this request reaches %d tokens of context, past the %d-token windows the target was trained on "
                "(training_manifest.json): its tokens beyond that are unreliable, and acceptance drops with them",
                1,
                longest,
                self.trained_context,
            )
        settings = {
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": ignore_eos,
            "top_k": top_k,
            "top_p": top_p,
            "stop_token_ids": stop_token_ids,
            "kernels": kernels,
        }
        auto = None
        if method == "auto":
            if budget is not None:
                raise ValueError('method="auto" chooses the budget: pass a budget only with method="ddtree"')
            padded, context = max(len(prompts), pad_batch_to or 0), max(len(p) for p in prompts)
            auto = self.choose(padded, context, max_new_tokens)
            method, budget = auto.candidate.method, auto.candidate.spec_budget
        spec = self.spec_for(prompts, method=method, budget=budget, pad_batch_to=pad_batch_to, **settings)
        n, batch = len(prompts), spec.batch
        rows = list(prompts) + [prompts[-1]] * (batch - n)
        (program, t_state, d_state), compile_s = self.compiled(spec)
        keys = request_keys(seed, indices + indices[-1:] * (batch - n))
        args = jax.device_put((*padded_prompts(rows, spec.prompt_len), keys))
        t0 = time.perf_counter()
        out = jax.block_until_ready(program(t_state, d_state, *args))
        wall = time.perf_counter() - t0
        tokens, n_out, rounds, hist, bad = (np.asarray(x) for x in out)
        for i in range(n):
            if bad[i] >= 0:
                where = "prefill" if bad[i] == 0 else f"round {bad[i]}"
                raise NumericsError(
                    f"non-finite (NaN/inf) target logits in {where} of batch row {i}; "
                    "no tokens were emitted past that point"
                )
        result_tokens = [tokens[i, : n_out[i]].tolist() for i in range(n)]
        batch_rounds = int(rounds[:n].max())
        generated = [len(t) for t in result_tokens]
        finish = [stops.STOP if t[-1] in spec.stop_ids else stops.LENGTH for t in result_tokens]
        texts = None if self.tokenizer is None else [self.tokenizer.decode(t) for t in result_tokens]
        if stop_strings:
            for i in range(n):
                result_tokens[i], texts[i], hit = stops.cut_at_stop_strings(
                    result_tokens[i], stop_strings, self.tokenizer.decode
                )
                finish[i] = stops.STOP if hit else finish[i]
        stats = []
        for i in range(n):
            taus = np.arange(hist.shape[1])
            r = int(rounds[i])
            latency = wall * r / batch_rounds if batch_rounds else wall
            stats.append(
                {
                    "rounds": r,
                    "tokens_per_round": float((hist[i] * taus).sum() / r) if r else 0.0,
                    "accept_hist": hist[i, 1:].tolist(),
                    "finish_reason": finish[i],
                    "est_latency_s": latency,
                    "est_tokens_per_s": generated[i] / latency if latency > 0 else 0.0,
                }
            )
        total_rounds = int(rounds[:n].sum())
        if auto is not None and auto.reason == cost_table.FROM_TABLE and total_rounds:
            committed = float((hist[:n] * np.arange(hist.shape[1])).sum())
            self.acceptance.observe(auto.candidate.name, committed, total_rounds, auto.batch, auto.context)
        rate = sum(generated) / wall if wall > 0 else 0.0
        return GenerationResult(result_tokens, texts, stats, wall, compile_s, rate, batch_rounds, spec, auto)

    def generate_text(
        self, prompts: Sequence[str | Sequence[Mapping[str, str]]], *, chat: bool = False, **settings
    ) -> GenerationResult:
        """Generate for text prompts; the result's `texts` are the decoded outputs.

        Each prompt is a string (encoded as is, or as one user turn of the checkpoint's chat format with
        chat=True) or a conversation `[{"role": "system" | "user" | "assistant", "content": text}, ...]` (always
        the chat format). settings: `generate`'s keywords. A ValueError when the Generator has no tokenizer; a
        `UserError` for a malformed conversation or a tokenizer without a chat format."""
        if self.tokenizer is None:
            raise ValueError("generate_text needs the target's tokenizer (tiktoken.model or tokenizer.json)")
        tok = self.tokenizer
        ids = [
            (tok.encode_chat(p) if chat else tok.encode(p))
            if isinstance(p, str)
            else tok.encode_messages(check_messages(p))
            for p in prompts
        ]
        return self.generate(ids, **settings)


def device_identity(mesh: Mesh | None, dtype, exact: bool) -> dict[str, str | int | bool]:
    """What a cost table must have been measured on to serve programs on `mesh` (None: one device) in `dtype`
    with the exact numerics on or off: the devices' kind and count, the dtype's name and `exact`
    (`CostTable.check`'s keywords)."""
    count = mesh.devices.size if mesh is not None else 1
    kind = jax.devices()[0].device_kind
    return {"device_kind": kind, "device_count": count, "dtype": jnp.dtype(dtype).name, "exact": exact}


def trained_context(target_dir: Path) -> int | None:
    """The window length (`flags.seq_len`) in the target's training_manifest.json (our own trained checkpoints), or
    None when there is no manifest (e.g. a real Kimi checkpoint)."""
    path = target_dir / "training_manifest.json"
    if not path.is_file():
        return None
    try:
        return int(json.loads(path.read_text())["flags"]["seq_len"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: no integer flags.seq_len ({e})") from e
