"""Loading a local checkpoint directory, refusing one that would load silently wrong.

transformers initialises missing weights randomly and only warns (a config with more layers
than the weights loads random layers), never looks at NaN/inf values, and a corrupt
``tokenizer.json`` used to surface much later as "model has no tokenizer". Here each is an error
that names the file and what to do. Where transformers itself only warns (missing, unexpected
weights; non-finite values), ``PAGEDCORE_SKIP_CHECKPOINT_CHECKS=1`` (or ``strict=False``)
turns the error back into a logged warning.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "SKIP_CHECKS_ENV",
    "TOKENIZER_FILES",
    "CheckpointError",
    "check_checkpoint_dir",
    "load_checkpoint",
    "load_tokenizer",
]

#: Set to 1 to load a checkpoint with missing/unexpected/non-finite weights anyway (warned).
SKIP_CHECKS_ENV = "PAGEDCORE_SKIP_CHECKPOINT_CHECKS"
#: Files whose presence means "this checkpoint ships a tokenizer".
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_MAX_NAMES = 6
logger = logging.getLogger("pagedcore.engine.models.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as it is (the message names the file)."""


def _names(keys: Any) -> str:
    ordered = sorted(keys)
    more = f" and {len(ordered) - _MAX_NAMES} more" if len(ordered) > _MAX_NAMES else ""
    return ", ".join(ordered[:_MAX_NAMES]) + more


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"{what} {path} is not readable JSON ({type(err).__name__}: {err}); the checkpoint "
            "is corrupt or truncated: download or save it again"
        ) from err


def check_checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """Cheap checks before anything loads: the directory, its ``config.json``, weight files.

    Raises
    ------
    CheckpointError
        The directory does not exist, has no (readable JSON) ``config.json``, or no weights.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(
            f"cannot load model {str(root)!r}: that checkpoint directory does not exist; "
            "check the path (or use 'demo' / 'random:<type>' for a built-in model)"
        )
    if not root.is_dir():
        raise CheckpointError(
            f"{str(root)!r} is a file, not a checkpoint directory; pass the directory that "
            "holds config.json and the weights"
        )
    config = root / "config.json"
    if not config.is_file():
        raise CheckpointError(
            f"{config} is missing: {str(root)!r} is not a transformers checkpoint (save one "
            "with model.save_pretrained(path))"
        )
    if not isinstance(_read_json(config, "config file"), dict):
        raise CheckpointError(f"config file {config} must hold a JSON object")
    weights = [p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file()]
    if not weights:
        raise CheckpointError(
            f"{str(root)!r} has no weight files (*.safetensors or *.bin); a config alone "
            "would load random weights. Use the config itself (LLM(config)) for that"
        )
    index = root / "model.safetensors.index.json"
    if index.is_file():
        _read_json(index, "weight index")
    return root


def _strict(strict: bool | None) -> bool:
    if strict is not None:
        return strict
    return os.environ.get(SKIP_CHECKS_ENV, "").strip().lower() not in ("1", "true", "yes")


def _refuse(problem: str, *, strict: bool) -> None:
    if strict:
        raise CheckpointError(
            f"{problem}. Fix the checkpoint, or set {SKIP_CHECKS_ENV}=1 to load it anyway"
        )
    logger.warning("%s (loading anyway: %s is set)", problem, SKIP_CHECKS_ENV)


def _non_finite(model: Any) -> list[str]:
    import torch

    bad: list[str] = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    return bad


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    device: torch.device,
    strict: bool | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """The causal LM of a checkpoint directory, on `device`, in eval mode, checked.

    Parameters
    ----------
    strict:
        Refuse missing or unexpected weights and NaN/inf values (None: unless
        ``PAGEDCORE_SKIP_CHECKPOINT_CHECKS=1``).

    Raises
    ------
    CheckpointError
        Anything `check_checkpoint_dir` refuses; weights transformers cannot read (truncated
        file, shapes that do not match ``config.json``); and, when strict, weights missing
        from or unexpected by the config, or non-finite weights (each names the tensors).
    """
    from transformers import AutoModelForCausalLM

    root = check_checkpoint_dir(path)
    strict_checks = _strict(strict)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(root), dtype=dtype, local_files_only=True, output_loading_info=True,
            trust_remote_code=trust_remote_code,
        )
    except Exception as err:  # OSError, RuntimeError (shapes), safetensors' SafetensorError...
        raise CheckpointError(_load_failure(root, err)) from err
    model, info = loaded
    if info.get("mismatched_keys"):
        raise CheckpointError(
            f"weights in {root} do not match the shapes config.json describes: "
            f"{_names(k if isinstance(k, str) else k[0] for k in info['mismatched_keys'])}"
        )
    if info.get("missing_keys"):
        _refuse(
            f"{root}: config.json describes weights the checkpoint does not have (they would "
            f"be random): {_names(info['missing_keys'])}; is config.json (e.g. "
            "num_hidden_layers) the one these weights were saved with?", strict=strict_checks,
        )
    from pagedcore.engine.models.kv_scales import is_kv_scale_key

    # fp8 KV-cache scales have no place in transformers' modules: read_kv_scales reads them.
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys") or ()
                               if not is_kv_scale_key(k)]
    if info.get("unexpected_keys"):
        _refuse(
            f"{root}: the weight files hold tensors config.json has no place for (they would be "
            f"ignored): {_names(info['unexpected_keys'])}; is config.json the one these weights "
            "were saved with?", strict=strict_checks,
        )
    bad = _non_finite(model)
    if bad:
        _refuse(f"{root}: weights hold NaN or inf values: {_names(bad)}", strict=strict_checks)
    return model.to(device).eval()


def _load_failure(root: Path, err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    hint = "the weight files are corrupt or truncated: download or save them again"
    if "size mismatch" in str(err) or "ignore_mismatched_sizes" in str(err):
        hint = "the weights' shapes do not match config.json: is it the right config?"
    return f"cannot load the weights in {root} ({type(err).__name__}: {text}); {hint}"


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, or None when it ships none (no tokenizer files).

    Raises
    ------
    CheckpointError
        Tokenizer files are present but unreadable (corrupt ``tokenizer.json``, say): the
        message names the file, instead of a later "model has no tokenizer".
    """
    root = Path(path)
    present = [name for name in TOKENIZER_FILES if (root / name).is_file()]
    if not present:
        return None
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        if name in present:
            _read_json(root / name, "tokenizer file")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except Exception as err:  # tokenizers raises its own Exception types
        raise CheckpointError(
            f"the tokenizer of {root} ({', '.join(present)}) cannot be loaded "
            f"({type(err).__name__}: {str(err)[:200]}); save it again with "
            "tokenizer.save_pretrained(path), or pass tokenizer= explicitly"
        ) from err
