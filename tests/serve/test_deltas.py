"""The front end's delta plumbing without a server: merging a backlog of raw deltas, and the
per-request mailbox (`RequestStream`) the event loop fills."""

from __future__ import annotations

import asyncio

from pagedcore.serve.deltas import CoreError, StreamDelta, merge_deltas, merge_raw_deltas
from pagedcore.serve.engine_thread import RequestStream


def _raw(text: str, tokens: list[int], *, lp: list[dict[int, float]] | None = None,
         finish: str | None = None, generated: int = 0, plp: list[None] | None = None) -> tuple:
    return ("r", text, tokens, lp, finish, None if finish is None else 7, 5, 2, generated, plp)


def test_merge_raw_deltas_equals_pairwise_merging() -> None:
    raws = [_raw("a", [1], generated=1, plp=[None]), _raw("", [], generated=1),
            _raw("bc", [2, 3], lp=[{2: -0.5}, {3: -0.1}], generated=3),
            _raw("d", [4], finish="stop", generated=4)]
    merged = merge_raw_deltas(raws)
    pairwise = StreamDelta._make(raws[0])
    for raw in raws[1:]:
        pairwise = merge_deltas(pairwise, StreamDelta._make(raw))
    assert merged == pairwise
    assert (merged.text, merged.token_ids, merged.finish_reason, merged.stop_reason,
            merged.num_generated_tokens) == ("abcd", [1, 2, 3, 4], "stop", 7, 4)
    assert merged.logprobs == [{2: -0.5}, {3: -0.1}] and merged.prompt_logprobs == [None]
    assert merge_raw_deltas(raws[:1]) == StreamDelta._make(raws[0])
    assert raws[0][2] == [1]  # the inputs are not mutated


def test_request_stream_takes_every_item_waiting_and_survives_cancel() -> None:
    async def main() -> None:
        stream = RequestStream(asyncio.get_running_loop())
        waiting = asyncio.ensure_future(stream.take())
        await asyncio.sleep(0)
        waiting.cancel()  # a consumer that went away: a later push must not fail
        await asyncio.gather(waiting, return_exceptions=True)
        stream.push(_raw("x", [9]))
        stream.push(CoreError("failed", "boom"))
        assert [type(i).__name__ for i in await stream.take()] == ["tuple", "CoreError"]
        later = asyncio.ensure_future(stream.take())
        await asyncio.sleep(0)
        assert not later.done()
        asyncio.get_running_loop().call_soon(stream.put, _raw("y", [8]))  # the thread path
        assert [i[1] for i in await asyncio.wait_for(later, 5)] == ["y"]

    asyncio.run(main())
