"""A BPE tokenizer trained in the test on local text, and a tiny chat checkpoint built on it
(shared by the engine, text and serve tests; tests/helpers is on pytest's pythonpath)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: Local training text with multi-byte characters (é: 2 bytes, 日本: 3 bytes each).
CORPUS = [
    "The café serves crème brûlée and a résumé of the day.",
    "日本の首都は東京です。日本語を話します。",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "Hello world! Hello again, world. Élodie said déjà vu.",
    "A block table maps logical blocks to physical blocks; 日本 and é are fine.",
] * 20

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
#: Ids 0-6 in this order: ``</s>`` is 2 and ``<|end|>`` (the end of a turn) is 4, the two EOS
#: ids a multi-EOS checkpoint declares (``generation_config.eos_token_id = [2, 4]``).
SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|end|>", "<|user|>", "<|assistant|>"]
EOS_IDS = [2, 4]


def train_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE trained here on `CORPUS`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_chat_checkpoint(path: Path, *, multi_eos: bool = False,
                         generation: dict[str, Any] | None = None) -> Path:
    """A tiny Llama with random weights (initializer_range 0.1) + the trained tokenizer and
    chat template, saved with ``save_pretrained`` into `path`.

    ``multi_eos``: ``generation_config.eos_token_id = [2, 4]`` (``</s>`` and ``<|end|>``, as
    Llama 3 and Qwen instruct models ship two ids), and the ``<|end|>`` row of the output
    layer scaled up so greedy decoding really ends turns on id 4. `generation`: more
    generation_config fields (temperature, top_p, ...).
    """
    from transformers import GenerationConfig

    from pagedcore.engine.models.loading import random_model, tiny_config

    tok = train_tokenizer()
    config = tiny_config("llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = random_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    if multi_eos:
        with torch.no_grad():
            model.lm_head.weight[EOS_IDS[1]] *= 3.0
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=list(EOS_IDS),
            pad_token_id=tok.pad_token_id, **(generation or {}))
    elif generation:
        model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, **generation)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
