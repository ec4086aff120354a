"""A Hugging Face model id (``"Qwen/Qwen2-0.5B"``) as a local checkpoint directory.

The id is looked up in the local Hugging Face cache first (``HF_HOME`` / ``HF_HUB_CACHE``, the
layout `huggingface_hub` writes); only when it is not there, and the hub is reachable (not
``HF_HUB_OFFLINE=1``), are the config, weights and tokenizer files downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["ModelNotFoundError", "looks_like_repo_id", "resolve_model_id"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
#: What a download fetches: config, weights, tokenizer, chat template, remote code.
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "tokenizer*"]


class ModelNotFoundError(ValueError):
    """Neither a local directory nor a model id in the cache (nor downloadable)."""


def looks_like_repo_id(model: str) -> bool:
    """``"org/name"`` or ``"name"``: what the hub accepts (not ``./x``, ``/x`` or ``a/b/c``)."""
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.endswith(".")


def resolve_model_id(model: str, *, revision: str | None = None) -> Path:
    """The snapshot directory of hub model id `model`: from the cache, else downloaded.

    Raises
    ------
    ModelNotFoundError
        Not in the cache and the download failed (offline, unknown id, gated repo): the
        message names the cache that was searched and what to do.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except HFValidationError as err:
        raise ModelNotFoundError(f"{model!r} is not a model id or a directory ({err})") from err
    except Exception:  # not cached (LocalEntryNotFoundError and friends): try the hub
        pass
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"cannot load model {model!r}: no such local directory, and the Hugging Face "
            f"cache ({cache}) does not hold it; HF_HUB_OFFLINE is set, so it was not "
            "downloaded. Check the path or id, or download it where the hub is reachable"
        )
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=_PATTERNS))
    except Exception as err:
        raise ModelNotFoundError(
            f"cannot load model {model!r}: no such local directory, the Hugging Face cache "
            f"({cache}) does not hold it, and {_download_failure(err, model, revision)}"
        ) from err


def _download_failure(err: Exception, model: str, revision: str | None) -> str:
    """Why a download failed, in words a user can act on (one line)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = constants.ENDPOINT
    if isinstance(err, GatedRepoError):
        return (f"the hub ({hub}) holds it as a gated model: accept its terms on its page "
                "and log in (`hf auth login` or HF_TOKEN)")
    if isinstance(err, RevisionNotFoundError):
        return f"the hub ({hub}) has no revision {revision!r} of it"
    if isinstance(err, RepositoryNotFoundError):
        return (f"the hub ({hub}) has no model {model!r} (or it is private: log in with "
                "`hf auth login` or HF_TOKEN). Check the path or id (a directory must exist; "
                "an id is 'org/name')")
    causes = [err]
    while causes[-1].__cause__ is not None and len(causes) < 8:
        causes.append(causes[-1].__cause__)  # type: ignore[arg-type]
    text = " ".join(f"{type(e).__name__}: {e}" for e in causes)
    if "ConnectError" in text or "ConnectTimeout" in text or "Connection refused" in text:
        return (f"the hub ({hub}) could not be reached to download it. Check the path or id, "
                "the network or HF_ENDPOINT; or set HF_HUB_OFFLINE=1 to use the cache only")
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return (f"downloading it failed ({type(err).__name__}: {first}). Check the path or id "
            "(a directory must exist; an id is 'org/name')")
