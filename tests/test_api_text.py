"""The Python API with text: `generate_text` on strings and chat messages, `texts` decoded, labelled figures."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_kimi_config

from ddtree_jax.api import Generator
from ddtree_jax.errors import UserError
from ddtree_jax.training import synthetic

KW = dict(method="ar", max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory) -> Generator:
    """A tiny target with Kimi's tiktoken tokenizer: 256 byte ranks + 256 specials (chat markers included)."""
    target = synthetic.write_hf_checkpoint(tmp_path_factory.mktemp("t") / "target", tiny_kimi_config(vocab_size=512))
    ranks = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    (target / "tiktoken.model").write_text(ranks)
    return Generator.load(target)


def test_text_prompts_give_the_token_prompts_outputs_decoded(gen: Generator) -> None:
    tok = gen.tokenizer
    res = gen.generate_text(["hello", "a longer prompt"], **KW)
    ids = gen.generate([tok.encode("hello"), tok.encode("a longer prompt")], **KW)
    assert res.tokens == ids.tokens and res.texts == [tok.decode(t) for t in ids.tokens] == ids.texts


def test_chat_messages_and_chat_strings_use_the_chat_format(gen: Generator) -> None:
    tok = gen.tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    got = gen.generate_text([messages, "hi"], chat=True, **KW)
    want = gen.generate([tok.encode_messages(messages), tok.encode_chat("hi")], **KW)
    assert got.tokens == want.tokens and tok.encode_chat("hi") != tok.encode("hi")
    with pytest.raises(UserError, match="role"):
        gen.generate_text([[{"role": "robot", "content": "hi"}]], **KW)


def test_strings_to_generate_and_text_without_a_tokenizer_are_clear_errors(gen: Generator) -> None:
    with pytest.raises(ValueError, match="generate_text"):
        gen.generate(["hello"], **KW)
    bare = Generator(gen.target)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate_text(["hello"], **KW)
    assert bare.generate([[1, 2]], **KW).texts is None


def test_figures_say_what_they_are(gen: Generator) -> None:
    """Aggregate tok/s is the batch's tokens over its execution; each row's latency is estimated from its own
    rounds (a row that stops early reports less than the batch's time)."""
    res = gen.generate([[1, 2], [3, 4, 5]], method="ar", max_new_tokens=6, ignore_eos=True)
    assert res.tokens_per_s == pytest.approx(sum(map(len, res.tokens)) / res.wall_s)
    assert res.batch_rounds == max(s["rounds"] for s in res.stats)
    for s, t in zip(res.stats, res.tokens, strict=True):
        assert s["est_latency_s"] == pytest.approx(res.wall_s * s["rounds"] / res.batch_rounds)
        assert s["est_tokens_per_s"] == pytest.approx(len(t) / s["est_latency_s"])


def test_readme_quick_start_runs_as_written() -> None:
    """The README's Python quick start, run in a fresh interpreter from the repository root, prints its result."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip(), "the quick start printed nothing"


def test_default_dtype_on_a_cpu_is_float32(gen: Generator) -> None:
    """On a CPU backend the default load is float32, where ar, dflash and ddtree give the same tokens."""
    import jax.numpy as jnp

    assert gen.target.dtype == jnp.float32
