"""`ddtree_jax.hub`: checkpoints given as Hugging Face model ids resolve from a local cache laid out as
huggingface_hub lays it out, offline; local paths stay as they are; an id that cannot be resolved is a one-line
`UserError` naming it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from huggingface_hub import constants

from ddtree_jax.errors import UserError
from ddtree_jax.hub import METADATA_FILES, is_model_id, resolve_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_model(cache: Path, model_id: str, files: dict[str, bytes]) -> Path:
    """`files` cached as the hub caches a download of `model_id` at `main`: contents in blobs/<sha256>, the
    snapshot's files symlinks into them, refs/main holding the commit. Returns the snapshot directory."""
    repo = cache / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * name.count("/") + "../../blobs") / blob.name)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)  # the hub writes the hash without a newline
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, with the hub client offline (no request leaves the machine)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize(
    ("text", "is_id"),
    [
        ("moonshotai/Kimi-K2.6", True),
        ("z-lab/Kimi-K2.5-DFlash", True),
        ("org/name_1.0", True),
        ("checkpoints", False),
        ("/abs/dir", False),
        ("./rel/dir", False),
        ("a/b/c", False),
        ("../up", False),
        ("org/..", False),
        ("org/", False),
    ],
)
def test_model_id_shape(text: str, is_id: bool) -> None:
    assert is_model_id(text) is is_id


def test_id_resolves_to_its_cached_snapshot(offline_cache: Path) -> None:
    config = json.dumps({"model_type": "kimi_k2"}).encode()
    snapshot = write_hub_model(offline_cache, "moonshotai/Kimi-K2.6", {"config.json": config, "sub/x.json": b"{}"})
    got = resolve_checkpoint("moonshotai/Kimi-K2.6", METADATA_FILES)
    assert got == snapshot
    assert (got / "config.json").read_bytes() == config and (got / "sub" / "x.json").read_bytes() == b"{}"
    assert resolve_checkpoint("moonshotai/Kimi-K2.6") == snapshot  # the whole repository: what is cached


def test_local_paths_stay_as_given(offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_hub_model(offline_cache, "org/name", {"config.json": b"{}"})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert resolve_checkpoint("org/name") == Path("org/name")  # an existing directory wins over the id
    assert resolve_checkpoint(tmp_path / "absent") == tmp_path / "absent"  # not an id: the loaders report it
    assert resolve_checkpoint("absent") == Path("absent")


def test_missing_id_offline_is_one_line_naming_it(offline_cache: Path) -> None:
    with pytest.raises(UserError) as e:
        resolve_checkpoint("moonshotai/Kimi-K2.6", METADATA_FILES)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("moonshotai/Kimi-K2.6: no such local directory")
    assert str(offline_cache) in msg and "HF_HUB_OFFLINE" in msg and "hf download moonshotai/Kimi-K2.6" in msg
