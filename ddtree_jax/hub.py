"""Checkpoint locations: a local path, or a Hugging Face model id (`moonshotai/Kimi-K2.6`) resolved to its
snapshot directory in the local Hugging Face cache, downloading what is missing.

`huggingface_hub.snapshot_download` does the work, so its environment applies: `HF_HUB_CACHE` / `HF_HOME` (where
the cache is), `HF_HUB_OFFLINE=1` (the cache only, no network), `HF_TOKEN` (gated or private models).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from ddtree_jax.errors import UserError

# What `load_kimi_config` / `load_dflash_config` / `load_tokenizer` / `api.trained_context` read: everything
# the CLIs check before loading a weight.
METADATA_FILES = ("*.json", "tiktoken.model", "tokenization_*.py")

# `org/name`: each part starts with a letter or digit, then letters, digits, `_`, `.`, `-` (the Hub's rule).
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_model_id(text: str) -> bool:
    """Whether `text` is shaped like a Hugging Face model id `org/name` (no `..`, not an absolute path)."""
    return _MODEL_ID.fullmatch(text) is not None and ".." not in text


def resolve_checkpoint(path_or_id: str | Path, files: Sequence[str] | None = None) -> Path:
    """The local directory of a checkpoint given as a path or a Hugging Face model id.

    An existing path, or anything not shaped like `org/name`, is returned as is (the loaders report a missing
    path). An id is looked up in the Hugging Face cache and downloaded where missing (the cache only under
    `HF_HUB_OFFLINE=1`); `files`: glob patterns of the files needed (None: the whole repository). Raises a
    one-line `UserError` naming the id when it cannot be resolved.
    """
    path = Path(path_or_id)
    if path.exists() or not is_model_id(str(path_or_id)):
        return path
    model_id = str(path_or_id)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    where = f"{model_id}: no such local directory, and as a Hugging Face model id"
    try:
        return Path(snapshot_download(model_id, allow_patterns=None if files is None else list(files)))
    except GatedRepoError:
        raise UserError(
            f"{where} it is gated: accept its terms on huggingface.co/{model_id}, then `hf auth login` "
            "(or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{where} it does not exist or is private (`hf auth login` or HF_TOKEN for a private one); "
            "a local checkpoint must be an existing directory"
        ) from None
    except IncompleteSnapshotError:
        raise UserError(
            f"{where} its cached snapshot in {constants.HF_HUB_CACHE} is incomplete (an interrupted download): "
            f"run again with the Hub reachable, or `hf download {model_id}`"
        ) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise UserError(
                f"{where} it is not in the cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set: "
                f"download it first (`hf download {model_id}`) or unset HF_HUB_OFFLINE"
            ) from None
        raise UserError(
            f"{where} it is not in the cache {constants.HF_HUB_CACHE} and the Hub cannot be reached: "
            "check the network (or HF_ENDPOINT)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).strip().split("\n")[0]
        raise UserError(f"{where} it cannot be fetched ({type(e).__name__}: {first})") from None
