"""Offline use of `LLM`: `generate`, `stream` and `chat` over many prompts.

`OfflineGeneration` is a base class of `pagedcore.engine.llm.LLM`: it queues prompts through
`LLM.add_request` (validating every prompt first, so a bad one queues nothing), drives
`LLM.step` until they finish, and on early exit or error aborts what it queued, so no request
of a call is left behind in the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pagedcore.engine.chat import Conversation, chat_prompt, normalize_conversations
from pagedcore.engine.distributed.group import TensorParallelError
from pagedcore.engine.errors import EngineStepError
from pagedcore.engine.output_builder import ParentRequest, PromptType, normalize_prompts
from pagedcore.engine.outputs import RequestOutput
from pagedcore.engine.request_checks import check_request
from pagedcore.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedcore.engine.scheduling.scheduler import Scheduler

__all__ = ["OfflineGeneration"]


class OfflineGeneration:
    """`generate` / `stream` for `LLM` (a base class of it), built on its online API."""

    # Set by `LLM.__init__`.
    scheduler: Scheduler
    _parents: dict[str, ParentRequest]
    _ids: Iterator[int]  # an itertools.count
    max_logprobs: int
    max_n: int

    tokenizer: Any
    model_name: str

    if TYPE_CHECKING:

        def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]: ...

        def _resolve(
            self, params: SamplingParams | None, num_prompt_tokens: int
        ) -> tuple[SamplingParams, dict[str, Any], list[list[int]]]: ...

        def add_request(
            self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
            *, delta: bool = False,
        ) -> None: ...

        def abort(self, request_id: str) -> RequestOutput: ...

        def step(self, *, finished_only: bool = False) -> list[RequestOutput]: ...

    def _add_all(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        *,
        delta: bool = False,
    ) -> list[str]:
        prompt_list, params_list = normalize_prompts(prompts, sampling_params)
        # Validate everything first so a bad prompt queues nothing.
        for prompt, params in zip(prompt_list, params_list, strict=True):
            if params is not None:
                check_request(params, max_logprobs=self.max_logprobs, max_n=self.max_n)
            _, ids = self._tokenize(prompt)
            self._resolve(params, len(ids))
        ids_out = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            request_id = f"gen-{next(self._ids)}"
            self.add_request(request_id, prompt, params, delta=delta)
            ids_out.append(request_id)
        return ids_out

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Queue `prompts` and yield each request's new output every time it changes.

        Every yielded `RequestOutput` is a delta (``delta=True``): its completions hold the
        token ids, text and logprobs produced since the request's previous output, so the
        texts of one request's outputs concatenate to its whole text (vLLM's
        ``output_kind=DELTA``). The last one has ``finished=True`` and the finish reason.

        Closing the generator early (``break`` out of the loop, ``close()``, garbage
        collection) or an exception aborts the requests it queued that have not finished,
        freeing their blocks. A failed step raises `EngineStepError` (see `step`).
        """
        ids = set(self._add_all(prompts, sampling_params, delta=True))
        remaining = set(ids)
        try:
            while remaining:
                for out in self.step():
                    if out.request_id in ids:
                        if out.finished:
                            remaining.discard(out.request_id)
                        yield out
        finally:
            self._abort_quietly(remaining)

    def _abort_quietly(self, request_ids: Iterable[str]) -> dict[str, RequestOutput]:
        """Abort those of `request_ids` still in the engine; their final outputs by id."""
        return {rid: self.abort(rid) for rid in request_ids if rid in self._parents}

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one finished `RequestOutput` per prompt, in order.

        Parameters
        ----------
        prompts:
            One prompt or a list (text, token ids, or vLLM-style dicts).
        sampling_params:
            One for all prompts, or one per prompt (None: defaults).
        use_tqdm:
            Show a progress bar of finished requests (vLLM's name; drawn with rich).
        on_step:
            Called with each step's changed outputs.

        Raises
        ------
        EngineStepError
            A step failed. Its ``outputs`` hold one output per prompt, in order: finished ones,
            the failed step's (``finish_reason == "error"``), and the rest aborted with the
            tokens they had. On this and any other exception (KeyboardInterrupt included) no
            request of this call is left in the engine, which keeps serving.
        TensorParallelError
            A rank failed and the engine is stopped; ``outputs`` as for `EngineStepError`.
        """
        ids = self._add_all(prompts, sampling_params)
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        progress: Any = None
        if use_tqdm:
            from rich.progress import Progress

            progress = Progress(transient=True)
            progress.start()
            task = progress.add_task("generating", total=len(ids))
        try:
            while len(done) < len(ids):
                outs = self.step(finished_only=on_step is None)
                for out in outs:
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                if on_step is not None:
                    on_step(outs)
                if progress is not None:
                    progress.update(task, completed=len(done))
                if not outs and not self.scheduler.has_unfinished_requests():
                    break
        except BaseException as exc:
            # Leave nothing of this call behind in the engine.
            if isinstance(exc, (EngineStepError, TensorParallelError)):
                done.update((o.request_id, o) for o in exc.outputs if o.request_id in wanted)
                done.update(self._abort_quietly(i for i in ids if i not in done))
                exc.outputs = [done[i] for i in ids if i in done]
            else:
                done.update(self._abort_quietly(i for i in ids if i not in done))
            raise
        finally:
            if progress is not None:
                progress.stop()
        # A request lost to an internal failure still gets its (final) output.
        done.update(self._abort_quietly(i for i in ids if i not in done))
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Answer one conversation or several through the tokenizer's chat template.

        Parameters
        ----------
        messages:
            One conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of
            conversations.
        sampling_params:
            One for all conversations, or one each (None: the engine's defaults).
        chat_template:
            A Jinja template to use instead of the tokenizer's.
        add_generation_prompt:
            End the prompt with the assistant's turn marker.
        template_kwargs:
            Extra template variables.

        Returns
        -------
        list[RequestOutput]
            One finished output per conversation, in order (see `generate`).

        Raises
        ------
        ChatTemplateError
            (an InvalidArgumentError) The model has no tokenizer or chat template, or the
            template failed; nothing is queued.
        """
        conversations = normalize_conversations(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            text, ids = chat_prompt(
                self.tokenizer, conversation, model_name=self.model_name,
                chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                **template_kwargs)
            # The rendered text rides along as the output's `prompt` (as vLLM's chat gives).
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
