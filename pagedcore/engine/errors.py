"""What the engine raises when a step fails, and the message that explains it."""

from __future__ import annotations

from collections.abc import Sequence

from pagedcore.engine.outputs import RequestOutput

__all__ = ["EngineStepError", "step_failure_message"]


class EngineStepError(RuntimeError):
    """A step failed (the model runner, a backend or the sampler raised); the engine lives on.

    The requests of the failed step (and their sibling samples) were finished with
    ``finish_reason == "error"`` and their blocks freed; everything else in the engine is intact
    and later steps run normally. The original exception is ``__cause__``.

    Attributes
    ----------
    outputs:
        From `LLM.step`: the final outputs of the failed requests (tokens generated before the
        failure included, ``error`` set), and of any request rejected while scheduling the
        step. From `LLM.generate`: one output per prompt, in order: finished ones complete,
        failed ones with ``finish_reason == "error"``, the rest aborted (``"abort"``) with the
        tokens they had.
    """

    def __init__(self, message: str, *, outputs: Sequence[RequestOutput] = ()) -> None:
        super().__init__(message)
        self.outputs: list[RequestOutput] = list(outputs)


def step_failure_message(exc: BaseException, step: int, request_ids: Sequence[str]) -> str:
    """One line naming the step, the exception and the requests it finished."""
    shown = ", ".join(repr(r) for r in request_ids[:8])
    more = f" and {len(request_ids) - 8} more" if len(request_ids) > 8 else ""
    return (
        f"engine step {step} failed with {type(exc).__name__}: {exc}; its "
        f"{len(request_ids)} request(s) [{shown}{more}] were finished with finish_reason "
        "'error' and their KV blocks freed (tokens generated before the failure are kept in "
        "their outputs); other requests are unaffected and the engine keeps serving"
    )
