"""A single-sequence request goes to the engine when its handler runs (`FanIn.start`,
`AsyncEngine.submit`), before its response is iterated; a submission nobody iterates is
aborted and its slot given back."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from pagedcore.serve.async_engine import AsyncEngine
from pagedcore.serve.core_loop import EngineInfo
from pagedcore.serve.protocol import CompletionRequest
from pagedcore.serve.serving import OpenAIServing


class _Fit:
    def check(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        pass


class _Process:
    """What `AsyncEngine` uses of an `EngineProcess`: records the commands sent."""

    def __init__(self) -> None:
        self.info = EngineInfo(model_name="m", tokenizer=None, max_model_len=64,
                               max_num_seqs=4, vocab_size=100, fit=_Fit(),
                               backend_names=("x",), device="cpu")
        self.attached = False
        self.alive = True
        self.commands: list[tuple[Any, ...]] = []

    def attach(self, loop: Any, on_message: Any) -> None:
        self.on_message = on_message
        self.attached = True

    def send(self, command: tuple[Any, ...]) -> None:
        self.commands.append(command)

    def close(self) -> None:
        pass


def _setup() -> tuple[_Process, AsyncEngine, OpenAIServing]:
    proc = _Process()
    engine = AsyncEngine(None, process=proc, max_waiting=0)  # type: ignore[arg-type]
    engine.start()
    return proc, engine, OpenAIServing(engine, model_names=["m"], max_n=4)


def _body(n: int = 1) -> CompletionRequest:
    return CompletionRequest(model="m", prompt=[5, 6, 7], max_tokens=2, stream=True, n=n,
                             ignore_eos=True)


def test_the_request_reaches_the_engine_before_its_response_is_iterated() -> None:
    async def main() -> list[bytes]:
        proc, engine, serving = _setup()
        fan, prompts = serving.completion(_body())
        adds = [c for c in proc.commands if c[0] == "add"]
        assert [(c[2], c[3].max_tokens) for c in adds] == [([5, 6, 7], 2)]
        events = serving.completion_stream(_body(), fan, prompts)
        rid = adds[0][1]
        proc.on_message(("step", [(rid, (rid, "", [9], None, None, None, 3, 0, 1, None)),
                                  (rid, (rid, "", [8], None, "length", None, 3, 0, 2, None))],
                         None))
        chunks = [e async for e in events]
        assert engine.num_in_flight == 0 and not engine._streams
        assert not [c for c in proc.commands if c[0] == "abort"]  # it finished: no abort
        return chunks

    chunks = asyncio.run(main())
    assert b'"finish_reason":"length"' in chunks[-2] and chunks[-1] == b"data: [DONE]\n\n"


def test_a_submission_nobody_iterates_is_aborted_and_its_slot_returned() -> None:
    async def main() -> None:
        proc, engine, serving = _setup()
        fan, prompts = serving.completion(_body())
        events = serving.completion_stream(_body(), fan, prompts)
        assert engine.num_in_flight == 1
        rid = proc.commands[0][1]
        del fan, events  # the client left before the response started
        gc.collect()
        assert proc.commands[-1] == ("abort", rid)
        assert engine.num_in_flight == 0 and not engine._streams

    asyncio.run(main())


def test_several_samples_start_when_iterated() -> None:
    async def main() -> None:
        proc, engine, serving = _setup()
        fan, _ = serving.completion(_body(n=2))
        assert proc.commands == [] and engine.num_in_flight == 2  # admitted, not sent
        del fan
        gc.collect()
        assert engine.num_in_flight == 0 and proc.commands == []

    asyncio.run(main())
