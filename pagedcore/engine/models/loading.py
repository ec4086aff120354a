"""Model loading: local checkpoints, Hugging Face model ids (from the local cache, downloaded
when the hub is reachable), seeded random weights from a config, the built-in demo.

Any decoder whose attention goes through transformers' `AttentionInterface` and whose layers
the engine can bind runs (`pagedcore.engine.models.support`); ``TESTED_MODEL_TYPES`` are the
architectures CI proves token-identical to transformers (tests/engine/test_correctness.py,
tests/engine/test_more_archs.py), and the ones `tiny_config` builds.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TESTED_MODEL_TYPES",
    "ByteTokenizer",
    "LoadedModel",
    "demo_config",
    "llama3_8b_config",
    "load_model",
    "qwen2_0_5b_config",
    "random_config",
    "random_model",
    "tiny_config",
]

#: Architectures CI proves token-identical to transformers (greedy tokens and logits).
TESTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma2", "deepseek_v2", "deepseek_v3",
    "phi3", "olmo2", "granite", "qwen3_moe", "gemma", "starcoder2", "cohere",
    "gpt_oss",
)
#: Former name of `TESTED_MODEL_TYPES` (no longer an allowlist: see `model_support`).
SUPPORTED_MODEL_TYPES = TESTED_MODEL_TYPES


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS 256, EOS 257 and PAD 258."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


@attrs.define
class LoadedModel:
    """A causal LM ready for the engine, with its tokenizer (None when there is none)."""

    model: PreTrainedModel
    tokenizer: Any
    name: str
    #: Why there is no tokenizer (which files a checkpoint lacks); None when there is one.
    no_tokenizer_reason: str | None = None
    #: Per layer ``(k_scale, v_scale)`` of an fp8 KV cache from the checkpoint, or None.
    kv_scales: dict[int, tuple[float, float]] | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every EOS id of the model (see `pagedcore.engine.sampling.defaults`)."""
        from pagedcore.engine.sampling.defaults import eos_token_ids

        return eos_token_ids(self.model, self.tokenizer)


#: Per architecture: what makes its tiny config exercise what sets it apart (non-default
#: multipliers and scales, experts), so a runner that ignores one of them changes the logits.
_TINY_EXTRAS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1),
    "granite": dict(logits_scaling=4.0, attention_multiplier=0.2, embedding_multiplier=2.0,
                    residual_multiplier=0.5),
    "cohere": dict(logit_scale=0.5),
    "starcoder2": dict(sliding_window=12),
    "phi3": dict(partial_rotary_factor=0.5),
    # Alternating windowed / full layers with per-head sinks; a 4-expert top-2 MoE.
    "gpt_oss": dict(sliding_window=12, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"]),
}


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A 2-layer, hidden-64, GQA config of `model_type` for tests (initializer_range 0.1 so a
    broken attention changes the tokens).

    Mistral gets a sliding window of 12; Gemma-2 alternates sliding (window 12) and full layers
    and uses soft-caps small enough to matter.
    """
    from transformers import AutoConfig

    if model_type not in TESTED_MODEL_TYPES:
        raise ValueError(
            f"no tiny config for model type {model_type!r}; choose one of {TESTED_MODEL_TYPES}"
        )
    base: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if model_type == "mistral":
        base["sliding_window"] = 12
    if model_type == "gemma2":
        base.update(
            sliding_window=12,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention"],
        )
    base.update(_TINY_EXTRAS.get(model_type, {}))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        from pagedcore.engine.models.mla_attention import TINY_MLA_OVERRIDES

        del base["head_dim"]
        base.update(TINY_MLA_OVERRIDES[model_type])
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    return config


def demo_config() -> PretrainedConfig:
    """The built-in demo model: a small Llama (2 layers, hidden 128, 4 query / 2 KV heads of 64)
    over the byte tokenizer."""
    from transformers import LlamaConfig

    tok = ByteTokenizer()
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # a size every GPU backend supports
        max_position_embeddings=1024,
        initializer_range=0.05,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )


def qwen2_0_5b_config(**overrides: Any) -> PretrainedConfig:
    """Qwen2-0.5B's shapes (24 layers, hidden 896, 14/2 heads, vocab 151936) for benchmarks."""
    from transformers import Qwen2Config

    base: dict[str, Any] = dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=151643,
        eos_token_id=151643,
    )
    base.update(overrides)
    return Qwen2Config(**base)


def llama3_8b_config(**overrides: Any) -> PretrainedConfig:
    """Llama-3-8B's shapes (32 layers, hidden 4096, 32/8 heads of 128, intermediate 14336,
    vocab 128256, rope theta 500000) for benchmarks; 16 GB of bf16 weights."""
    from transformers import LlamaConfig

    base: dict[str, Any] = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=128000,
        eos_token_id=128001,
    )
    base.update(overrides)
    return LlamaConfig(**base)


def random_config(kind: str) -> PretrainedConfig:
    """The config behind ``"random:<kind>"``: the full-size ``qwen2-0.5b`` / ``llama3-8b`` shapes,
    else `tiny_config(kind)`."""
    full_size = {"qwen2-0.5b": qwen2_0_5b_config, "llama3-8b": llama3_8b_config}
    return full_size[kind]() if kind in full_size else tiny_config(kind)


def random_model(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PreTrainedModel:
    """A causal LM with seeded random weights (the same `seed` gives the same weights on the
    same device type)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)  # the model's attention implementation will be changed
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    model.eval()
    result: PreTrainedModel = model
    return result


def _looks_like_path(model: str) -> bool:
    """A string the user meant as a path (so a typo says "does not exist")."""
    from pagedcore.engine.models.hub import looks_like_repo_id

    return os.path.exists(model) or not looks_like_repo_id(model)


def _no_tokenizer_reason(root: Any) -> str:
    from pagedcore.engine.models.checkpoint import TOKENIZER_FILES

    return (f"the checkpoint {str(root)!r} ships no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)} is there); copy the tokenizer files into it "
            "(tokenizer.save_pretrained(path)) or pass tokenizer=")


def _load_directory(
    name: str, root: Any, *, dtype: torch.dtype, device: torch.device, strict: bool | None,
    trust_remote_code: bool,
) -> LoadedModel:
    from transformers import AutoConfig

    from pagedcore.engine.models.checkpoint import (
        CheckpointError,
        check_checkpoint_dir,
        load_checkpoint,
        load_tokenizer,
    )
    from pagedcore.engine.models.support import check_architecture

    root = check_checkpoint_dir(root)
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True,
                                            trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers' config checks raise many kinds (a bad value)
        if "trust_remote_code" in str(err):
            # (transformers' own message spans lines and points at hf.co: say it in one.)
            raise CheckpointError(
                f"{root} needs its own Python code to load (its config.json has an auto_map "
                "of classes defined in the checkpoint): pass trust_remote_code=True "
                "(--trust-remote-code) if you trust that code"
            ) from err
        raise CheckpointError(
            f"{root / 'config.json'} is not a usable transformers config "
            f"({type(err).__name__}: {' '.join(str(err).split())[:300]}); fix that value, or "
            "save it again with config.save_pretrained()"
        ) from err
    check_architecture(config, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(root, trust_remote_code=trust_remote_code)
    loaded = load_checkpoint(root, dtype=dtype, device=device, strict=strict,
                             trust_remote_code=trust_remote_code)
    from pagedcore.engine.models.kv_scales import read_kv_scales

    try:
        scales = read_kv_scales(root, int(config.num_hidden_layers))
    except ValueError as err:
        raise CheckpointError(str(err)) from err
    return LoadedModel(loaded, tokenizer, name,
                       None if tokenizer is not None else _no_tokenizer_reason(root),
                       kv_scales=scales)


def load_model(
    model: str | PretrainedConfig | PreTrainedModel,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    strict: bool | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Resolve what the user passed as `model`.

    Parameters
    ----------
    model:
        ``"demo"`` (built-in model, byte tokenizer), ``"random:<type>"`` (a `tiny_config` of
        that type), ``"random:qwen2-0.5b"`` or ``"random:llama3-8b"`` (full-size shapes), a
        local checkpoint directory, a Hugging Face model id (``"org/name"``: the local cache,
        else a download), a transformers config (seeded random weights) or a loaded model
        (used as is, moved to `device`).
    trust_remote_code:
        Let a checkpoint's own code (``auto_map`` classes) run.

    Raises
    ------
    UnsupportedModelError
        An architecture the engine cannot run (the message says why).
    ModelNotFoundError
        A string that is neither a directory nor a model id found in the cache or the hub.
    """
    from transformers import PretrainedConfig, PreTrainedModel

    from pagedcore.engine.models.support import check_architecture

    if isinstance(model, PreTrainedModel):
        check_architecture(model)
        given: Any = model
        return LoadedModel(given.to(device=device, dtype=dtype).eval(), None,
                           type(model).__name__, "a loaded model comes without a tokenizer; "
                           "pass tokenizer=")
    if isinstance(model, PretrainedConfig):
        check_architecture(model, trust_remote_code=trust_remote_code)
        return LoadedModel(random_model(model, dtype=dtype, device=device, seed=seed), None,
                           f"random {model.model_type}", "a config comes without a tokenizer; "
                           "pass tokenizer=")
    if not model.strip():
        raise ValueError("model is an empty string; give a checkpoint directory, a Hugging "
                         "Face model id, 'demo' or 'random:<type>'")
    if model == "demo":
        built = random_model(demo_config(), dtype=dtype, device=device, seed=seed)
        return LoadedModel(built, ByteTokenizer(), "demo")
    if model.startswith("random:"):
        kind = model.removeprefix("random:")
        config = random_config(kind)
        return LoadedModel(random_model(config, dtype=dtype, device=device, seed=seed), None,
                           model, f"{model!r} has random weights and no tokenizer")
    if os.path.isdir(model) or _looks_like_path(model):
        return _load_directory(os.path.basename(os.path.normpath(model)), model, dtype=dtype,
                               device=device, strict=strict,
                               trust_remote_code=trust_remote_code)
    from pagedcore.engine.models.hub import resolve_model_id

    root = resolve_model_id(model)
    return _load_directory(model, root, dtype=dtype, device=device, strict=strict,
                           trust_remote_code=trust_remote_code)
