"""Helpers of the serve tests: live servers (the tokenizer and checkpoint helpers are shared
with the engine tests: tests/helpers/tokenizer_helpers.py, on pytest's pythonpath)."""

from __future__ import annotations

from typing import Any

from tokenizer_helpers import CORPUS, make_chat_checkpoint, train_tokenizer

from pagedcore.engine.llm import LLM
from pagedcore.serve.app import build_app
from pagedcore.serve.async_engine import AsyncEngine
from pagedcore.serve.metrics import ServeMetrics
from pagedcore.serve.server import ServerThread

#: The demo model's engine arguments every serve test uses (small KV budget, short length).
DEMO_KW = dict(max_model_len=256, max_num_seqs=256, kv_cache_memory_bytes=16 * 2**20,
               backend="reference")

__all__ = ["CORPUS", "DEMO_KW", "LiveServer", "make_chat_checkpoint", "train_tokenizer"]


class LiveServer:
    """An `LLM` behind a live uvicorn server on 127.0.0.1 (stopped with `stop`)."""

    def __init__(self, model: str, *, max_waiting: int = 1024, api_key: str | None = None,
                 enable_tokenizer_info_endpoint: bool = False, **llm_kwargs: Any) -> None:
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
                        metrics=self.metrics, max_n=8,
                        enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint)
        self.server = ServerThread(app).start()
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()
