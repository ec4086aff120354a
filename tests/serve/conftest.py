"""Fixtures of the serve tests: live servers over the demo model and a tiny chat checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_helpers import DEMO_KW, LiveServer, make_chat_checkpoint
from thread_helpers import one_thread

_one_thread = pytest.fixture(scope="session", autouse=True)(one_thread)


@pytest.fixture(scope="session")
def demo_server() -> Iterator[LiveServer]:
    server = LiveServer("demo", **DEMO_KW)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat-ckpt"))


@pytest.fixture(scope="session")
def chat_server(chat_checkpoint: Path) -> Iterator[LiveServer]:
    server = LiveServer(str(chat_checkpoint), max_model_len=256,
                        enable_tokenizer_info_endpoint=True)
    yield server
    server.stop()
