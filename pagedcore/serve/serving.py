"""The OpenAI endpoints' logic, independent of the web framework.

`OpenAIServing` turns a validated body into engine sequences (one per prompt and sample),
runs them through `AsyncEngine.generate` concurrently (`FanIn`), and builds OpenAI's response
objects or stream chunks from the deltas.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.engine.validation import MAX_SEED
from pagedcore.serve.errors import BadRequestError, ServeError, error_body
from pagedcore.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingLimits,
    TokenizeRequest,
    sampling_params,
)
from pagedcore.serve.responses import (
    ChunkTemplate,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    next_offset,
    prompt_logprobs_json,
    sse,
    top_prompt_logprobs,
    usage,
)

if TYPE_CHECKING:
    from pagedcore.engine.sampling.sampling_params import SamplingParams
    from pagedcore.serve.async_engine import AsyncEngine, StreamDelta

__all__ = ["FanIn", "OpenAIServing", "Sequence_"]

_DONE = b"data: [DONE]\n\n"
#: Prompt text (characters) above which a request is tokenized on a worker thread instead of
#: the event loop (a 4 MB prompt takes seconds to tokenize; short ones are not worth a hop).
OFF_LOOP_CHARS = 32_768


@attrs.frozen
class Sequence_:
    """One engine sequence of a request: which choice, which prompt, its parameters."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


class FanIn:
    """Run several sequences at once and merge their deltas, in arrival order.

    Admission happens at construction (all sequences or none: `QueueFullError` otherwise);
    closing the iterator early (a client disconnect) cancels every sequence, which aborts its
    engine request.
    """

    def __init__(self, engine: AsyncEngine, seqs: Sequence[Sequence_]) -> None:
        self.engine = engine
        self.seqs = list(seqs)
        engine.reserve(len(self.seqs))
        self._unstarted = len(self.seqs)
        self._single: AsyncGenerator[StreamDelta, None] | None = None

    def start(self) -> None:
        """Send a single sequence to the engine now (`AsyncEngine.generate`), before the
        response iterates it: in a burst of requests each one then reaches the engine when
        its handler has run, not once the event loop has come round to every response's
        body. Several sequences start when iterated (each on a task of its own)."""
        if len(self.seqs) == 1 and self._single is None:
            seq = self.seqs[0]
            self._unstarted = 0  # generate releases the slot from here on
            self._single = self.engine.generate(
                seq.prompt_token_ids, seq.params, request_id=f"{uuid.uuid4().hex[:16]}-0",
                reserved=True)

    def __del__(self) -> None:
        # Admitted but never iterated (e.g. the client left before its response started):
        # give the slots back, or they would be lost for good.
        if getattr(self, "_unstarted", 0):
            self.engine.release(self._unstarted)
            self._unstarted = 0

    async def _pump(self, seq: Sequence_, out: asyncio.Queue[Any], rid: str) -> None:
        self._unstarted -= 1  # generate releases this slot from here on
        try:
            async for delta in self.engine.generate(seq.prompt_token_ids, seq.params,
                                                    request_id=rid, reserved=True):
                out.put_nowait((seq.index, delta))
        except Exception as exc:
            out.put_nowait((seq.index, exc))

    def single(self) -> AsyncGenerator[StreamDelta, None] | None:
        """With one sequence (the common case): its deltas straight from
        `AsyncEngine.generate` (no task, no second queue, no pairing with the index); the
        caller closes the generator. None with several sequences (iterate the `FanIn`)."""
        if len(self.seqs) != 1:
            return None
        self.start()
        single, self._single = self._single, None
        assert single is not None
        return single

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        base = uuid.uuid4().hex[:16]
        deltas = self.single()
        if deltas is not None:
            index = self.seqs[0].index
            try:
                async for delta in deltas:
                    yield index, delta
            finally:
                await deltas.aclose()
            return
        out: asyncio.Queue[Any] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(s, out, f"{base}-{s.index}"))
                 for s in self.seqs]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._unstarted:
                self.engine.release(self._unstarted)
                self._unstarted = 0


class OpenAIServing:
    """Completions and chat completions over an `AsyncEngine`.

    Parameters
    ----------
    engine:
        The running engine.
    model_names:
        Names the ``model`` field may take (the first is reported back).
    max_n:
        Most samples (``n``) per prompt.
    chat_template:
        A Jinja chat template used instead of the tokenizer's (``pagedcore serve
        --chat-template``); None: the tokenizer's own.
    """

    def __init__(self, engine: AsyncEngine, *, model_names: Sequence[str], max_n: int,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.model_names = list(model_names)
        self.chat_template = chat_template
        self.limits = SamplingLimits(max_model_len=engine.max_model_len, max_n=max_n,
                                     vocab_size=engine.vocab_size)
        self.vocab_size = engine.vocab_size

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ---- inputs ----------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        from pagedcore.serve.errors import NotFoundError

        if name not in self.model_names:
            raise NotFoundError(f"the model {name!r} does not exist; this server serves "
                                f"{self.model_names}", param="model", code="model_not_found")

    def _encode(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequestError("this model has no tokenizer: send the prompt as token "
                                      "ids (a list of integers)", param=param)
            return [int(t) for t in self.tokenizer.encode(prompt)]
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequestError(f"token ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {self.vocab_size}); use ids of this model's tokenizer "
                                  "(/tokenize gives them)", param=param, code="invalid_value")
        return list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The token ids of the conversation through the tokenizer's chat template."""
        if not body.messages:
            raise BadRequestError("messages is empty; give at least one message",
                                  param="messages", code="invalid_value")
        from pagedcore.engine.chat import ChatTemplateError, chat_prompt_ids

        try:
            return chat_prompt_ids(self.tokenizer, [m.as_template_dict() for m in body.messages],
                                   model_name=self.model_names[0],
                                   chat_template=self.chat_template,
                                   add_generation_prompt=body.add_generation_prompt)
        except ChatTemplateError as exc:
            no_template = "no chat template" in str(exc) or "no (transformers)" in str(exc)
            message = str(exc)
            if "no (transformers)" in str(exc) and self.chat_template is not None:
                message = (f"the model {self.model_names[0]!r} has no transformers tokenizer, "
                           "so no chat template can be applied (--chat-template included); "
                           "use /v1/completions with a prompt")
            elif no_template:
                message = (f"the model {self.model_names[0]!r} has no chat template, so "
                           "/v1/chat/completions cannot format messages; use /v1/completions "
                           "with a prompt, or restart the server with --chat-template FILE "
                           "(or serve a checkpoint whose tokenizer defines a chat_template)")
            raise BadRequestError(message, param="messages",
                                  code="no_chat_template" if no_template else None) from exc

    def _sequences(self, body: CompletionRequest | ChatCompletionRequest,
                   prompts: list[list[int]], num_logprobs: int | None,
                   param: str) -> list[Sequence_]:
        if body.stop_strings() and self.tokenizer is None:
            raise BadRequestError("stop strings need a tokenizer, and this model has none; "
                                  "use stop_token_ids", param="stop")
        seqs = []
        prompt_logprobs = body.prompt_logprobs
        echo = isinstance(body, CompletionRequest) and body.echo
        if echo and num_logprobs is not None:
            # The echoed prompt's own logprobs: every sample computes them (its choice
            # starts with them, streamed or not).
            prompt_logprobs = max(prompt_logprobs or 0, num_logprobs)
        for p_index, ids in enumerate(prompts):
            params = sampling_params(body, num_prompt_tokens=len(ids), limits=self.limits,
                                     num_logprobs=num_logprobs, prompt_logprobs=prompt_logprobs)
            try:
                self.engine.check_prompt(len(ids), params.max_tokens)
            except BadRequestError as exc:
                exc.param = param
                raise
            for j in range(body.n):
                # Sample j's seed, wrapped into the seed range as `LLM` does for n > 1.
                seeded = params if params.seed is None else params.replace(
                    seed=(params.seed + j) % (MAX_SEED + 1))
                if j and prompt_logprobs is not None and not echo:
                    # The prompt's first sample computes them for every choice of the prompt.
                    seeded = seeded.replace(prompt_logprobs=None)
                seqs.append(Sequence_(p_index * body.n + j, p_index, ids, seeded))
        return seqs

    def _fan_in(self, body: CompletionRequest | ChatCompletionRequest,
                seqs: list[Sequence_]) -> FanIn:
        fan = FanIn(self.engine, seqs)
        fan.start()  # a single sequence goes to the engine before the response starts
        return fan

    # ---- tokenizer endpoints ---------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """``/tokenize``: the token ids of ``prompt``, or of ``messages`` through the chat
        template (as /v1/chat/completions would send them to the engine)."""
        if body.model is not None:  # (optional here, as in vLLM)
            self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequestError("give exactly one of prompt (a text) or messages (a "
                                  "conversation)", param="prompt", code="invalid_value")
        tokenizer = self._needs_tokenizer("tokenize")
        from transformers import PreTrainedTokenizerBase

        transformers_kind = isinstance(tokenizer, PreTrainedTokenizerBase)
        if body.add_special_tokens is not None and not transformers_kind:
            raise BadRequestError("this model's tokenizer takes no add_special_tokens (it is "
                                  "not a transformers tokenizer); leave it out",
                                  param="add_special_tokens", code="unsupported")
        if body.prompt is not None:
            prompt = body.prompt
            kw = {} if body.add_special_tokens is None else {
                "add_special_tokens": body.add_special_tokens}

            def encode() -> list[int]:  # (as /v1/completions encodes a prompt by default)
                return [int(t) for t in tokenizer.encode(prompt, **kw)]

            ids = await asyncio.to_thread(encode) if len(prompt) > OFF_LOOP_CHARS else encode()
        else:
            chat = ChatCompletionRequest(model=self.model_names[0],
                                         messages=body.messages or [],
                                         add_generation_prompt=body.add_generation_prompt)
            ids = (await self.chat_prompts(chat))[0]
            if body.add_special_tokens:  # (off by default: the template wrote them)
                from pagedcore.engine.chat import chat_prompt

                def render() -> list[int]:
                    text, _ = chat_prompt(
                        tokenizer, [m.as_template_dict() for m in chat.messages],
                        model_name=self.model_names[0], chat_template=self.chat_template,
                        add_generation_prompt=body.add_generation_prompt)
                    return [int(t) for t in tokenizer.encode(text, add_special_tokens=True)]

                long = sum(m.text_length() for m in chat.messages) > OFF_LOOP_CHARS
                ids = await asyncio.to_thread(render) if long else render()
        token_strs = None  # (null unless asked, as vLLM's response has it)
        if body.return_token_strs:
            token_strs = (tokenizer.convert_ids_to_tokens(ids) if transformers_kind
                          else [str(tokenizer.decode([t])) for t in ids])
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": token_strs}

    def tokenizer_info(self) -> dict[str, Any]:
        """``/tokenizer_info`` (vLLM's, behind ``--enable-tokenizer-info-endpoint``): the
        tokenizer's configuration as ``tokenizer_config.json`` has it (its ``init_kwargs``,
        without the paths of its files), its class, and the server's ``--chat-template``."""
        tokenizer = self._needs_tokenizer("describe")
        config = {k: _jsonable(v) for k, v in
                  (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if k not in ("vocab_file", "merges_file", "tokenizer_file")}
        config["tokenizer_class"] = type(tokenizer).__name__
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return config

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """``/detokenize``: the text of ``tokens``."""
        if body.model is not None:
            self.check_model(body.model)
        tokenizer = self._needs_tokenizer("detokenize")
        bad = [t for t in body.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequestError(f"token ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {self.vocab_size})", param="tokens",
                                  code="invalid_value")
        return {"prompt": str(tokenizer.decode(body.tokens))}

    def _needs_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise BadRequestError(f"this model has no tokenizer, so there is nothing to {what} "
                                  "with; send token ids to /v1/completions instead",
                                  code="no_tokenizer")
        return self.tokenizer

    # ---- completions -----------------------------------------------------------------------

    async def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The token ids of each prompt of `body` (its model checked first). Text longer
        than `OFF_LOOP_CHARS` is tokenized on a worker thread: one long prompt must not stall
        the event loop, and with it every other stream and ``/health``."""
        self.check_model(body.model)
        prompts = body.prompts()
        if sum(len(p) for p in prompts if isinstance(p, str)) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(self._encode_all, prompts)
        return self._encode_all(prompts)

    def _encode_all(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        return [self._encode(p, "prompt") for p in prompts]

    def completion(self, body: CompletionRequest,
                   prompts: list[list[int]] | None = None) -> tuple[FanIn, list[list[int]]]:
        """Validate and admit a completions request (`prompts`: its `completion_prompts`,
        else tokenized here); its sequences and prompts."""
        self.check_model(body.model)
        if body.echo and self.tokenizer is None:
            raise BadRequestError("echo needs a tokenizer to give the prompt back as text, and "
                                  "this model has none; leave echo out", param="echo")
        if prompts is None:
            prompts = self._encode_all(body.prompts())
        seqs = self._sequences(body, prompts, body.logprobs, "prompt")
        return self._fan_in(body, seqs), prompts

    async def completion_response(self, body: CompletionRequest, fan: FanIn,
                                  prompts: list[list[int]]) -> dict[str, Any]:
        """Run to the end; the ``text_completion`` object."""
        texts, acc = await _collect(fan)
        echoes = self._echo_texts(body, prompts)
        choices = []
        for seq in fan.seqs:
            a = acc[seq.index]
            if body.echo_only:  # the one token generated is not part of the answer
                texts[seq.index], a["ids"], a["logprobs"], a["generated"] = "", [], [], 0
                a["finish"], a["stop_reason"] = "length", None
            echo = "" if echoes is None else echoes[seq.prompt_index]
            logprobs = None
            if body.logprobs is not None:
                echoed = None if echoes is None else echo_logprobs(
                    self.tokenizer, prompts[seq.prompt_index], a["prompt_logprobs"],
                    k=body.logprobs)
                # Offsets run on through the echoed prompt's tokens (one count, as streamed).
                logprobs = completion_logprobs(self.tokenizer, a["ids"], a["logprobs"],
                                               k=body.logprobs,
                                               text_offset=next_offset(echoed, 0))
                if echoed is not None:
                    logprobs = join_logprobs(echoed, logprobs)
            choice = {"index": seq.index, "text": echo + texts[seq.index], "logprobs": logprobs,
                      "finish_reason": a["finish"], "stop_reason": a["stop_reason"]}
            if body.prompt_logprobs is not None:
                # The sample that computed them (with echo and logprobs: every sample).
                first = a if a["prompt_logprobs"] is not None else acc[seq.prompt_index * body.n]
                choice["prompt_logprobs"] = prompt_logprobs_json(top_prompt_logprobs(
                    first["prompt_logprobs"], prompts[seq.prompt_index], body.prompt_logprobs))
            choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_names[0], "choices": choices,
                "usage": _usage(prompts, acc, fan)}

    def _echo_texts(self, body: CompletionRequest,
                    prompts: list[list[int]]) -> list[str] | None:
        """With ``echo``, each prompt's text (a prompt given as token ids: decoded)."""
        if not body.echo:
            return None
        given = body.prompts()
        return [p if isinstance(p, str) else str(self.tokenizer.decode(ids))
                for p, ids in zip(given, prompts, strict=True)]

    def completion_stream(self, body: CompletionRequest, fan: FanIn,
                          prompts: list[list[int]]) -> AsyncIterator[bytes]:
        """The SSE stream of a completions request."""
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_names[0]
        if body.logprobs is None and body.prompt_logprobs is None and not body.echo:
            # Text only, the common case: prebuilt chunk bytes (one per token at interval 1).
            return self._text_stream(fan, prompts, rid, created, model, chat=False,
                                     include_usage=body.include_usage)
        return self._completion_events(body, fan, prompts, rid, created, model)

    async def _completion_events(self, body: CompletionRequest, fan: FanIn,
                                 prompts: list[list[int]], rid: str, created: int,
                                 model: str) -> AsyncIterator[bytes]:
        """`completion_stream` with logprobs, prompt logprobs or echo: a dict per chunk (with
        echo, a choice's first chunk is its prompt's text, and logprobs)."""
        acc: dict[int, dict[str, Any]] = {}
        offsets: dict[int, int] = {}
        held = _HeldTokens()
        echoes = self._echo_texts(body, prompts)
        prompt_of = {seq.index: seq.prompt_index for seq in fan.seqs}
        try:
            async for index, d in fan:
                _accumulate(acc, index, d)
                if echoes is not None and index not in offsets:
                    chunk, offsets[index] = self._echo_chunk(
                        body, d, prompts[prompt_of[index]], echoes[prompt_of[index]], rid,
                        created, model, index)
                    yield chunk
                    d = d._replace(prompt_logprobs=None)  # sent with the prompt's chunk
                if body.echo_only:
                    acc[index]["generated"] = 0
                    if d.finish_reason is not None:
                        yield sse(completion_chunk(rid, created, model, index, "", "length"))
                    continue
                if not (d.text or d.finish_reason or (d.token_ids and self.tokenizer is None)
                        or d.prompt_logprobs is not None):
                    held.hold(index, d)
                    continue
                logprobs = None
                ids, token_logprobs = held.release(index, d)
                if body.logprobs is not None and token_logprobs is not None:
                    logprobs = completion_logprobs(self.tokenizer, ids, token_logprobs,
                                                   k=body.logprobs,
                                                   text_offset=offsets.get(index, 0))
                    # The next chunk's tokens go on from this one's, counted as in the
                    # response without streaming (token texts, which need not add up to the
                    # chunk's text: skipped special tokens, pieces of a character).
                    offsets[index] = next_offset(logprobs, offsets.get(index, 0))
                yield sse(completion_chunk(rid, created, model, index, d.text, d.finish_reason,
                                           logprobs, prompt_logprobs_json(d.prompt_logprobs)))
            if body.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": model, "choices": [], "usage": _usage(prompts, acc, fan)})
        except ServeError as exc:
            yield sse(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code))
        yield _DONE

    def _echo_chunk(self, body: CompletionRequest, d: StreamDelta, prompt: list[int],
                    echo: str, rid: str, created: int, model: str,
                    index: int) -> tuple[bytes, int]:
        """A choice's first chunk with ``echo``: its prompt's text, the prompt tokens'
        logprobs (with ``logprobs``) and ``prompt_logprobs`` (when asked); and the text
        offset its completion's tokens start at."""
        logprobs = None
        if body.logprobs is not None:
            logprobs = echo_logprobs(self.tokenizer, prompt, d.prompt_logprobs, k=body.logprobs)
        asked = None
        if body.prompt_logprobs is not None:
            asked = prompt_logprobs_json(top_prompt_logprobs(d.prompt_logprobs, prompt,
                                                             body.prompt_logprobs))
        return (sse(completion_chunk(rid, created, model, index, echo, None, logprobs, asked)),
                next_offset(logprobs, len(echo)))

    async def _text_stream(self, fan: FanIn, prompts: list[list[int]], rid: str,
                           created: int, model: str, *, chat: bool,
                           include_usage: bool,
                           preamble: Sequence[bytes] = ()) -> AsyncIterator[bytes]:
        """The SSE events of a stream without logprobs (completions or chat): `preamble`,
        each delta's chunk from a `ChunkTemplate`, then the usage chunk if asked, then
        ``[DONE]``; what the dict path sends, byte for byte, at a fraction of its cost per
        token."""
        for first in preamble:
            yield first
        templates = {s.index: ChunkTemplate(rid, created, model, s.index, chat=chat)
                     for s in fan.seqs}
        ids_as_text = self.tokenizer is None and not chat  # token ids count as content
        last: dict[int, StreamDelta] = {}
        try:
            one = fan.single()
            if one is not None:
                index = fan.seqs[0].index
                text_event = templates[index].text_event
                try:
                    async for d in one:
                        last[index] = d
                        if d.text or d.finish_reason or (ids_as_text and d.token_ids):
                            yield text_event(d.text, d.finish_reason)
                finally:
                    await one.aclose()
            else:
                async for index, d in fan:
                    last[index] = d
                    if d.text or d.finish_reason or (ids_as_text and d.token_ids):
                        yield templates[index].text_event(d.text, d.finish_reason)
            if include_usage:
                acc = {i: {"generated": d.num_generated_tokens, "cached": d.num_cached_tokens}
                       for i, d in last.items()}
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield sse({"id": rid, "object": obj, "created": created, "model": model,
                           "choices": [], "usage": _usage(prompts, acc, fan)})
        except ServeError as exc:
            yield sse(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code))
        yield _DONE

    # ---- chat ------------------------------------------------------------------------------

    async def chat_prompts(self, body: ChatCompletionRequest) -> list[list[int]]:
        """The token ids of the conversation (its model checked first), on a worker thread
        when the messages hold more than `OFF_LOOP_CHARS` characters of text."""
        self.check_model(body.model)
        if sum(m.text_length() for m in body.messages) > OFF_LOOP_CHARS:
            return [await asyncio.to_thread(self.chat_prompt, body)]
        return [self.chat_prompt(body)]

    def chat(self, body: ChatCompletionRequest,
             prompts: list[list[int]] | None = None) -> tuple[FanIn, list[list[int]]]:
        """Validate and admit a chat request (`prompts`: its `chat_prompts`, else rendered
        and tokenized here); its sequences and (one) prompt."""
        self.check_model(body.model)
        if prompts is None:
            prompts = [self.chat_prompt(body)]
        seqs = self._sequences(body, prompts, body.num_logprobs, "messages")
        return self._fan_in(body, seqs), prompts

    async def chat_response(self, body: ChatCompletionRequest, fan: FanIn,
                            prompts: list[list[int]]) -> dict[str, Any]:
        """Run to the end; the ``chat.completion`` object."""
        texts, acc = await _collect(fan)
        choices = []
        for seq in fan.seqs:
            a = acc[seq.index]
            logprobs = None
            if body.num_logprobs is not None:
                logprobs = chat_logprobs(self.tokenizer, a["ids"], a["logprobs"],
                                         k=body.num_logprobs)
            choices.append({"index": seq.index,
                            "message": {"role": "assistant", "content": texts[seq.index]},
                            "logprobs": logprobs, "finish_reason": a["finish"],
                            "stop_reason": a["stop_reason"]})
        response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                    "created": int(time.time()), "model": self.model_names[0],
                    "choices": choices, "usage": _usage(prompts, acc, fan)}
        if body.prompt_logprobs is not None:  # (one prompt: at the top, as vLLM has it)
            response["prompt_logprobs"] = prompt_logprobs_json(acc[0]["prompt_logprobs"])
        return response

    def chat_stream(self, body: ChatCompletionRequest, fan: FanIn,
                    prompts: list[list[int]]) -> AsyncIterator[bytes]:
        """The SSE stream of a chat request (a first chunk per choice carries the role)."""
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created, model = int(time.time()), self.model_names[0]
        roles = [sse(chat_chunk(rid, created, model, seq.index,
                                {"role": "assistant", "content": ""}, None)) for seq in fan.seqs]
        if body.num_logprobs is None and body.prompt_logprobs is None:
            return self._text_stream(fan, prompts, rid, created, model, chat=True,
                                     include_usage=body.include_usage, preamble=roles)
        return self._chat_events(body, fan, prompts, rid, created, model, roles)

    async def _chat_events(self, body: ChatCompletionRequest, fan: FanIn,
                           prompts: list[list[int]], rid: str, created: int, model: str,
                           roles: list[bytes]) -> AsyncIterator[bytes]:
        """`chat_stream` with logprobs or prompt logprobs: a dict per chunk."""
        acc: dict[int, dict[str, Any]] = {}
        held = _HeldTokens()
        try:
            for role in roles:
                yield role
            async for index, d in fan:
                _accumulate(acc, index, d)
                if not (d.text or d.finish_reason or d.prompt_logprobs is not None):
                    held.hold(index, d)
                    continue
                logprobs = None
                ids, token_logprobs = held.release(index, d)
                if body.num_logprobs is not None and token_logprobs is not None:
                    logprobs = chat_logprobs(self.tokenizer, ids, token_logprobs,
                                             k=body.num_logprobs)
                delta = {"content": d.text} if d.text else {}
                chunk = chat_chunk(rid, created, model, index, delta, d.finish_reason, logprobs)
                if d.prompt_logprobs is not None:
                    chunk["prompt_logprobs"] = prompt_logprobs_json(d.prompt_logprobs)
                yield sse(chunk)
            if body.include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [], "usage": _usage(prompts, acc, fan)})
        except ServeError as exc:
            yield sse(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code))
        yield _DONE


class _HeldTokens:
    """Per choice, the tokens (and logprobs) of deltas that sent no chunk because their text
    is held back (part of a multi-byte character, or of what may still become a stop
    string); they go out with the choice's next chunk, so a stream carries one logprobs entry
    per generated token, as the response without streaming does."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[int, tuple[list[int], list[Any]]] = {}

    def hold(self, index: int, d: StreamDelta) -> None:
        """Keep `d`'s tokens and logprobs for choice `index`'s next chunk."""
        if d.logprobs is not None and d.token_ids:
            ids, logprobs = self._held.setdefault(index, ([], []))
            ids.extend(d.token_ids)
            logprobs.extend(d.logprobs)

    def release(self, index: int, d: StreamDelta) -> tuple[Sequence[int], Sequence[Any] | None]:
        """The token ids and logprobs choice `index`'s chunk for `d` carries: those held for
        it, then `d`'s own."""
        held = self._held.pop(index, None)
        if held is None:
            return d.token_ids, d.logprobs
        ids, logprobs = held
        return ids + list(d.token_ids), logprobs + list(d.logprobs or ())


def _jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: special tokens (transformers' ``AddedToken``) as their
    text, mappings with string keys, tuples and sets as lists, anything else unknown as its
    ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "content"):  # an AddedToken
        return str(value.content)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value)


def _accumulate(acc: dict[int, dict[str, Any]], index: int, d: StreamDelta) -> None:
    a = acc.setdefault(index, {"text": [], "ids": [], "logprobs": [], "finish": None,
                               "stop_reason": None, "generated": 0, "cached": 0,
                               "prompt_logprobs": None})
    if d.prompt_logprobs is not None:
        a["prompt_logprobs"] = d.prompt_logprobs
    a["text"].append(d.text)
    a["ids"].extend(d.token_ids)
    if d.logprobs is not None:
        a["logprobs"].extend(d.logprobs)
    a["generated"] = d.num_generated_tokens
    a["cached"] = d.num_cached_tokens
    if d.finish_reason is not None:
        a["finish"], a["stop_reason"] = d.finish_reason, d.stop_reason


async def _collect(fan: FanIn) -> tuple[dict[int, str], dict[int, dict[str, Any]]]:
    acc: dict[int, dict[str, Any]] = {}
    async for index, d in fan:
        _accumulate(acc, index, d)
    return {i: "".join(a["text"]) for i, a in acc.items()}, acc


def _usage(prompts: list[list[int]], acc: dict[int, dict[str, Any]], fan: FanIn) -> dict[str, Any]:
    cached: dict[int, int] = {}
    for seq in fan.seqs:
        if seq.index in acc:
            cached[seq.prompt_index] = max(cached.get(seq.prompt_index, 0),
                                           acc[seq.index]["cached"])
    return usage(sum(len(p) for p in prompts), sum(a["generated"] for a in acc.values()),
                 sum(cached.values()))
