"""`python -m ddtree_jax.generate` on bad input: exit 2, one `error:` line naming the problem, no traceback,
and no output file. These runs stop before any weight is loaded, so no checkpoint tensors are needed."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from absl import flags

from ddtree_jax import generate
from ddtree_jax.errors import UserError
from pallas_kernels.dispatch import Kernels

VOCAB = 512  # 256 byte ranks + 256 Kimi specials
CONTEXT = 64
HIDDEN = 64


def target_config(**overrides: object) -> dict:
    cfg = {
        "model_type": "kimi_k2",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "max_position_embeddings": CONTEXT,
    }
    return cfg | overrides


def drafter_config(**overrides: object) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "num_target_layers": 3,
        "block_size": 4,
        "max_position_embeddings": 4096,
        "dflash_config": {"mask_token_id": VOCAB - 2, "target_layer_ids": [1]},
    }
    return cfg | overrides


def write_checkpoint(d: Path, config: dict, tokenizer: bool = True) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if tokenizer:
        ranks = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
        (d / "tiktoken.model").write_text(ranks)
    return d


class Cli:
    """A tiny target + drafter and a valid prompts file; `run(**flags)` overrides any flag."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.target = write_checkpoint(tmp / "target", target_config())
        self.drafter = write_checkpoint(tmp / "drafter", drafter_config(), tokenizer=False)
        self.prompts = self.write_prompts({"id": "a", "prompt": "hello"}, {"id": "b", "prompt_ids": [1, 2, 3]})
        self.output = tmp / "out.jsonl"

    def write_prompts(self, *records: object, raw: bytes | None = None) -> Path:
        p = self.tmp / "prompts.jsonl"
        p.write_bytes(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records).encode())
        return p

    def run(self, env: dict[str, str] | None = None, **overrides: object) -> subprocess.CompletedProcess:
        args = {
            "target": self.target,
            "drafter": self.drafter,
            "prompts": self.prompts,
            "output": self.output,
            "max_new_tokens": 8,
        }
        args |= overrides
        argv = [f"--{k}={v}" for k, v in args.items() if v is not None]
        return subprocess.run(
            [sys.executable, "-m", "ddtree_jax.generate", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "DDTREE_DEBUG"} | (env or {}),
        )

    def assert_user_error(self, proc: subprocess.CompletedProcess, *fragments: str) -> None:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, proc.stderr
        assert len(errors) == 1, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""
        for fragment in fragments:
            assert fragment in errors[0], errors[0]
        assert not self.output.exists()
        assert {p.name for p in self.tmp.iterdir()} <= {"drafter", "prompts.jsonl", "target"}  # no temp file


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("budget", 0, "--budget must be >= 1, got 0"),
        ("batch_size", 0, "--batch_size must be >= 1, got 0"),
        ("max_new_tokens", 0, "--max_new_tokens must be >= 1, got 0"),
        ("temperature", -0.5, "--temperature must be finite and >= 0"),
        ("temperature", "nan", "--temperature must be finite and >= 0"),
        ("top_k", -1, "--top_k must be >= 0 (0 = all tokens), got -1"),
        ("top_p", 0, "--top_p must be in (0, 1] (1 = all tokens), got 0.0"),
        ("top_p", 1.5, "--top_p must be in (0, 1] (1 = all tokens), got 1.5"),
        ("top_p", 0.9, "--top_k and --top_p need --temperature > 0 (--temperature=0 is greedy)"),
        ("stop_token_ids", "7,x", "--stop_token_ids must be integers, got 7,x"),
        ("stop_token_ids", "-3", "--stop_token_ids [-3] outside the vocabulary"),
        ("stop_token_ids", f"5,{VOCAB}", f"--stop_token_ids [{VOCAB}] outside the vocabulary [0, {VOCAB})"),
        ("stop", "", "--stop must not be empty"),
        ("budget", "many", "flag --budget=many"),
        ("method", "beam", "flag --method=beam: value should be one of <auto|ar|dflash|ddtree>"),
        ("dtype", "int8", "flag --dtype=int8"),
    ],
)
def test_bad_flag_values(cli: Cli, flag: str, value: object, message: str) -> None:
    cli.assert_user_error(cli.run(**{flag: value}), message)


def test_missing_required_flag(cli: Cli) -> None:
    cli.assert_user_error(cli.run(prompts=None), "--prompts must have a value")


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_method_needs_drafter(cli: Cli, method: str) -> None:
    cli.assert_user_error(cli.run(method=method, drafter=None), f"--method={method} needs --drafter")


def test_output_directory_missing(cli: Cli) -> None:
    proc = cli.run(output=cli.tmp / "nope" / "out.jsonl")
    cli.assert_user_error(proc, "--output directory", "nope does not exist")


def test_output_is_the_prompts_file(cli: Cli) -> None:
    proc = cli.run(output=cli.prompts)
    assert proc.returncode == 2 and "is the prompts file" in proc.stderr
    assert (cli.tmp / "prompts.jsonl").read_text().startswith('{"id": "a"')


def test_existing_output_refused_without_overwrite(cli: Cli) -> None:
    cli.output.write_text("earlier results\n")
    proc = cli.run()
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --output {cli.output} exists: pass --overwrite to replace it or --resume to continue it"]
    assert cli.output.read_text() == "earlier results\n"


def test_resume_and_overwrite_together_refused(cli: Cli) -> None:
    cli.assert_user_error(cli.run(resume=True, overwrite=True), "--resume keeps --output and --overwrite replaces it")


def test_chat_without_tokenizer_refused(cli: Cli) -> None:
    (cli.target / "tiktoken.model").unlink()
    cli.write_prompts({"id": "b", "prompt_ids": [1, 2, 3]})
    cli.assert_user_error(cli.run(chat=True), "--chat:", "has no tokenizer")


def test_chat_without_chat_format_refused(cli: Cli) -> None:
    from tokenizers import Tokenizer, models

    (cli.target / "tiktoken.model").unlink()
    Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(cli.target / "tokenizer.json"))
    cli.assert_user_error(cli.run(chat=True), "--chat:", "a tokenizer without a chat format")


def test_stop_string_without_tokenizer_refused(cli: Cli) -> None:
    (cli.target / "tiktoken.model").unlink()
    cli.write_prompts({"id": "b", "prompt_ids": [1, 2, 3]})
    cli.assert_user_error(cli.run(stop="\n\n"), "--stop:", "has no tokenizer")


def test_messages_rows_need_a_chat_format(cli: Cli) -> None:
    (cli.target / "tiktoken.model").unlink()
    cli.write_prompts({"id": "m", "messages": [{"role": "user", "content": "hi"}]})
    cli.assert_user_error(cli.run(), "prompts.jsonl:1: prompt 'm' has 'messages', but the checkpoint has no tokenizer")


def test_hub_id_resolves_from_the_offline_cache(cli: Cli, tmp_path_factory: pytest.TempPathFactory) -> None:
    from test_hub import write_hub_model

    cache = tmp_path_factory.mktemp("hub")
    files = {"config.json": (cli.target / "config.json").read_bytes()}
    write_hub_model(cache, "org/kimi-tiny", files | {"tiktoken.model": (cli.target / "tiktoken.model").read_bytes()})
    write_hub_model(cache, "org/kimi-tiny-dflash", {"config.json": (cli.drafter / "config.json").read_bytes()})
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    cli.write_prompts()  # stops after the configs and tokenizer are read, before any weight
    proc = cli.run(env=env, target="org/kimi-tiny", drafter="org/kimi-tiny-dflash")
    cli.assert_user_error(proc, "prompts.jsonl: no prompts")


def test_hub_id_missing_offline(cli: Cli, tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = tmp_path_factory.mktemp("hub")
    proc = cli.run(env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, target="moonshotai/Kimi-K2.6")
    cli.assert_user_error(proc, "moonshotai/Kimi-K2.6: no such local directory", "HF_HUB_OFFLINE")


def test_no_backend_probe_noise(cli: Cli) -> None:
    # Stops at the memory check, after JAX has initialised its backends.
    proc = cli.run(method="ar", drafter=None, env={"DDTREE_FREE_BYTES": "1000"})
    cli.assert_user_error(proc, "not enough device memory")
    assert "tpu" not in proc.stderr.lower(), proc.stderr


def test_target_without_config(cli: Cli) -> None:
    (cli.target / "config.json").unlink()
    cli.assert_user_error(cli.run(), "target/config.json: config.json not found")


def test_target_config_malformed(cli: Cli) -> None:
    (cli.target / "config.json").write_text("{not json")
    cli.assert_user_error(cli.run(), "target/config.json: malformed JSON")


def test_drafter_does_not_match_target(cli: Cli) -> None:
    (cli.drafter / "config.json").write_text(json.dumps(drafter_config(hidden_size=2 * HIDDEN)))
    cli.assert_user_error(cli.run(), f"drafter hidden_size {2 * HIDDEN} does not match the target's {HIDDEN}")


def test_prompts_not_found(cli: Cli) -> None:
    cli.prompts.unlink()
    cli.assert_user_error(cli.run(), "prompts.jsonl: prompts file not found")


def test_prompts_empty(cli: Cli) -> None:
    cli.write_prompts()
    cli.assert_user_error(cli.run(), "prompts.jsonl: no prompts")


def test_prompt_line_not_json(cli: Cli) -> None:
    cli.write_prompts(raw=b'{"id": 1, "prompt": "x"}\n{"id": 2, "prompt": \n')
    cli.assert_user_error(cli.run(), "prompts.jsonl:2: not JSON")


def test_prompt_without_prompt_field(cli: Cli) -> None:
    cli.write_prompts({"id": "q", "text": "hello"})
    want = "prompts.jsonl:1: prompt 'q' needs exactly one of 'prompt', 'prompt_ids' and 'messages'"
    cli.assert_user_error(cli.run(), want)


def test_prompt_ids_outside_vocab(cli: Cli) -> None:
    cli.write_prompts({"id": "q", "prompt_ids": [5, VOCAB]})
    cli.assert_user_error(cli.run(), f"token id {VOCAB} outside the vocabulary [0, {VOCAB})")


def test_prompt_not_utf8(cli: Cli) -> None:
    cli.write_prompts(raw=b'{"id": "q", "prompt": "\xc3\x28"}\n')
    cli.assert_user_error(cli.run(), "prompts.jsonl:1: not valid UTF-8")


def test_text_prompt_without_tokenizer(cli: Cli) -> None:
    (cli.target / "tiktoken.model").unlink()
    cli.assert_user_error(cli.run(), "prompts.jsonl:1: prompt 'a' is text, but the checkpoint has no tokenizer")


@pytest.mark.parametrize(("method", "fits"), [("ar", 56), ("ddtree", 53)])
def test_prompt_too_long_for_context(cli: Cli, method: str, fits: int) -> None:
    # ar needs prompt + max_new_tokens <= 64; ddtree also block_size - 1 = 3 draft positions.
    cli.write_prompts({"id": "ok", "prompt_ids": [1] * fits}, {"id": "long", "prompt_ids": [1] * (fits + 1)})
    cli.assert_user_error(cli.run(method=method), "prompt 'long'", "exceeds the context limit 64")


def test_resume_from_corrupt_output_keeps_it(cli: Cli) -> None:
    cli.output.write_text('{"id": "a"}\ngarbage\n')
    proc = cli.run(resume=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "out.jsonl:2: existing output is corrupt" in proc.stderr
    assert cli.output.read_text() == '{"id": "a"}\ngarbage\n'


def test_resume_with_everything_done_loads_nothing(cli: Cli) -> None:
    done = '{"id": "a", "token_ids": [1]}\n{"id": "b", "token_ids": [2]}\n'
    cli.output.write_text(done)
    proc = cli.run(resume=True)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stderr
    assert cli.output.read_text() == done


def test_large_budget_warns(cli: Cli) -> None:
    cli.write_prompts()  # stop right after the warning, before loading weights
    proc = cli.run(method="ddtree", budget=1000)
    assert "--budget=1000: a round accepts at most block_size=4 tokens" in proc.stderr
    cli.assert_user_error(proc, "no prompts")


def test_debug_env_shows_traceback(cli: Cli) -> None:
    proc = cli.run(budget=0, env={"DDTREE_DEBUG": "1"})
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UserError: --budget must be >= 1" in proc.stderr


# ---- the batch loop, in process, against a fake engine (the real one is tested end to end elsewhere) ----


class FakeGenerator:
    """Generator contract of ddtree_jax.api: each row generates [last + 1, last + 2] and stops."""

    calls: list[dict] = []

    @classmethod
    def load(
        cls,
        target: str,
        drafter: str | None,
        dtype: object,
        mesh: str | None,
        calibration: str | None,
        exact: bool | None,
    ) -> FakeGenerator:
        cls.calls.append({"load": (target, drafter, dtype, mesh), "exact": exact})
        gen = cls()
        gen.exact = bool(exact)
        return gen

    def generate(self, prompts: list[list[int]], **kw: object) -> SimpleNamespace:
        self.calls.append({"prompts": prompts, **kw})
        tokens = [[p[-1] + 1, p[-1] + 2] for p in prompts]
        stats = [
            {"rounds": 1, "tokens_per_round": 2.0, "accept_hist": [0, 1], "finish_reason": "length"}
            | {"est_latency_s": 0.5, "est_tokens_per_s": 4.0}
            for _ in prompts
        ]
        texts = ["".join(map(chr, t)) for t in tokens]
        rate = 4.0 * len(prompts)
        method, budget = kw["method"], kw["budget"] if kw["method"] == "ddtree" else None
        return SimpleNamespace(
            tokens=tokens, texts=texts, stats=stats, wall_s=0.5, compile_s=0.0, tokens_per_s=rate, batch_rounds=1,
            method=method, budget=budget, auto=None, spec=SimpleNamespace(kernels=SimpleNamespace(exact=self.exact)),
        )  # fmt: skip


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> type[FakeGenerator]:
    from ddtree_jax import api

    fake_api = SimpleNamespace(
        Generator=FakeGenerator,
        padded_prompt_len=api.padded_prompt_len,
        default_dtype=api.default_dtype,
        resolve_exact=api.resolve_exact,
        device_identity=api.device_identity,
    )
    monkeypatch.setitem(sys.modules, "ddtree_jax.api", fake_api)
    FakeGenerator.calls = []
    yield FakeGenerator
    flags.FLAGS.unparse_flags()


def run_in_process(cli: Cli, *extra: str) -> None:
    argv = [f"--target={cli.target}", f"--drafter={cli.drafter}", f"--prompts={cli.prompts}"]
    generate.main(flags.FLAGS(["ddtree-generate", *argv, f"--output={cli.output}", *extra]))


def test_batches_in_input_order_with_resume(
    cli: Cli, fake_engine: type[FakeGenerator], capsys: pytest.CaptureFixture
) -> None:
    cli.write_prompts(*({"id": f"p{i}", "prompt_ids": [10 * i + 1]} for i in range(5)), {"id": "t", "prompt": "A"})
    cli.output.write_text(json.dumps({"id": "p1", "token_ids": [7]}) + "\n")
    extra = ["--resume", "--batch_size=2", "--method=dflash", "--dtype=float32", "--mesh=expert=1", "--seed=3"]
    run_in_process(cli, *extra, "--temperature=0.7", "--max_new_tokens=5", "--ignore_eos")

    import jax.numpy as jnp

    load, *gens = fake_engine.calls
    assert load["load"] == (str(cli.target), str(cli.drafter), jnp.float32, "expert=1")
    assert [g["prompts"] for g in gens] == [[[1], [21]], [[31], [41]], [[65]]]  # p1 skipped; "A" is byte 65
    assert gens[0] | {"prompts": None} == {
        "prompts": None,
        "method": "dflash",
        "budget": 16,
        "temperature": 0.7,
        "max_new_tokens": 5,
        "seed": 3,
        "request_indices": [0, 2],  # positions in the prompts file: they seed each request's sampling
        "ignore_eos": True,
        "top_k": 0,
        "top_p": 1.0,
        "stop_token_ids": [],
        "stop_strings": [],
        "pad_batch_to": 2,  # every batch runs at min(--batch_size, prompts), so the last reuses its program
        "kernels": Kernels(),
    }
    assert [g["request_indices"] for g in gens] == [[0, 2], [3, 4], [5]]
    records = [json.loads(line) for line in cli.output.read_text().splitlines()]
    assert [r["id"] for r in records] == ["p0", "p1", "p2", "p3", "p4", "t"]
    assert records[1] == {"id": "p1", "token_ids": [7]}  # kept from the earlier run
    assert records[5] == {
        "id": "t",
        "token_ids": [66, 67],
        "text": "BC",
        "stats": {
            "rounds": 1,
            "tokens_per_round": 2.0,
            "finish_reason": "length",
            "est_latency_s": 0.5,  # this request's share of its batch's execution, from its rounds
            "est_tokens_per_s": 4.0,
            # labelled as the batch's, with the method that ran (auto: what it chose, else null)
            "batch": {
                "requests": 1,
                "rounds": 1,
                "exec_s": 0.5,
                "tokens_per_s": 4.0,
                "method": "dflash",
                "budget": None,
                "exact": False,
                "auto": None,
            },
        },
    }
    out, err = capsys.readouterr()
    assert "5/5" in err and "tok/s aggregate (exec)" in err
    head, row = out.splitlines()
    for label in ("method", "aggregate tok/s (exec)", "per-request tok/s (median, est.)", "exec s", "compile s"):
        assert label in head
    assert row.split()[:9] == ["dflash", "5", "10", "5", "2.00", "6.7", "4.0", "1.50", "0.00"]  # 10 tokens, 3 x 0.5 s


def test_default_dtype_is_float32_on_a_cpu(cli: Cli, fake_engine: type[FakeGenerator]) -> None:
    cli.write_prompts({"id": "a", "prompt_ids": [1, 2]})
    run_in_process(cli, "--method=ddtree", "--max_new_tokens=8")
    import jax.numpy as jnp

    assert fake_engine.calls[0]["load"][2] == jnp.float32


@pytest.mark.parametrize("flag,exact", [("--exact", True), ("--noexact", False)])
def test_exact_flag_reaches_the_generator_and_the_record(cli: Cli, fake_engine, flag: str, exact: bool) -> None:
    run_in_process(cli, flag, "--method=ar", "--max_new_tokens=5")
    assert fake_engine.calls[0]["exact"] is exact
    assert all(json.loads(line)["stats"]["batch"]["exact"] is exact for line in cli.output.read_text().splitlines())


def test_exact_with_a_device_mesh_is_refused_before_loading(cli: Cli, fake_engine) -> None:
    with pytest.raises(UserError, match="the exact numerics do not cover a device mesh yet"):
        run_in_process(cli, "--exact", "--mesh=expert=1", "--method=ar", "--max_new_tokens=5")
    assert fake_engine.calls == [] and not cli.output.exists()


def test_sampling_and_stop_flags_reach_generate(cli: Cli, fake_engine: type[FakeGenerator]) -> None:
    extra = ["--temperature=0.5", "--top_k=5", "--top_p=0.9", "--stop_token_ids=7,9", "--stop=ab", "--stop=\n\n"]
    run_in_process(cli, *extra, "--method=ddtree", "--ignore_eos", "--max_new_tokens=5")
    _, *gens = fake_engine.calls
    want = {"top_k": 5, "top_p": 0.9, "stop_token_ids": [7, 9], "stop_strings": ["ab", "\n\n"], "ignore_eos": True}
    assert all({k: g[k] for k in want} == want for g in gens)
