"""Helpers of the serve tests: a trained BPE tokenizer, a tiny chat checkpoint, live servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedcore.engine.llm import LLM
from pagedcore.serve.app import build_app
from pagedcore.serve.async_engine import AsyncEngine
from pagedcore.serve.metrics import ServeMetrics
from pagedcore.serve.server import ServerThread

#: The demo model's engine arguments every serve test uses (small KV budget, short length).
DEMO_KW = dict(max_model_len=256, max_num_seqs=256, kv_cache_memory_bytes=16 * 2**20,
               backend="reference")

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
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


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


def make_chat_checkpoint(path: Path) -> Path:
    """A tiny Llama with random weights + the trained tokenizer and chat template, saved with
    ``save_pretrained`` into `path`."""
    from pagedcore.engine.models.loading import random_model, tiny_config

    tok = train_tokenizer()
    config = tiny_config("llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = random_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class LiveServer:
    """An `LLM` behind a live uvicorn server on 127.0.0.1 (stopped with `stop`)."""

    def __init__(self, model: str, *, max_waiting: int = 1024, api_key: str | None = None,
                 **llm_kwargs: Any) -> None:
        llm_kwargs.setdefault("device", "cpu")
        # The reference backend, always: in a whole-suite run the Triton tests' conftest sets
        # TRITON_INTERPRET=1, which makes `triton` selectable on CPU (in the interpreter, far
        # too slow for hundreds of streams).
        llm_kwargs.setdefault("backend", "reference")
        self.model = model
        self.llm = LLM(model, **llm_kwargs)
        self.tokenizer = self.llm.tokenizer
        self.engine = AsyncEngine(self.llm, max_waiting=max_waiting)
        self.metrics = ServeMetrics("m", self.engine.stats)
        self.engine.metrics = self.metrics
        self.model_name = "m"
        app = build_app(self.engine, model_names=[self.model_name], api_key=api_key,
                        metrics=self.metrics, max_n=8)
        self.server = ServerThread(app).start()
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()
