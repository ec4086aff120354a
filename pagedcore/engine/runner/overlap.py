"""Overlap scheduling, the runner's half: placeholder input ids, their device-side resolution,
the fence that keeps pinned input buffers from being rewritten under an upload, and the switch.

With overlap on, `LLM.step` schedules and prepares step N+1 while step N runs. A request that
step N samples has no host token yet; it carries ``Request.placeholder = -(1 + row)``, where
``row`` is its row among step N's sampled rows. The input batch writes that negative id where
the token goes, and `resolve_placeholders` replaces every negative id on the device with
``sampled[row]`` (one gather and one select over the step's ``[T]`` ids, no host sync, no index
upload: the id is its own index). The host learns the token one step later
(`pagedcore.engine.sampling.device_sample.SampledTokens.to_host`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "ASYNC_SCHEDULING_ENV",
    "InputFence",
    "async_scheduling_setting",
    "placeholder_for_row",
    "resolve_placeholders",
]

#: Environment variable overriding `LLM(async_scheduling=...)`: ``1`` on, ``0`` off.
ASYNC_SCHEDULING_ENV = "PAGEDCORE_ASYNC_SCHEDULING"

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def placeholder_for_row(row: int) -> int:
    """The input id standing for the token sampled in row `row` of the step in flight."""
    return -1 - row


def async_scheduling_setting(
    requested: bool | None, *, device_type: str
) -> tuple[bool, str | None]:
    """Whether steps overlap, and why not when they do not.

    `requested` None means the default: on for CUDA, off on the CPU (where the host computes
    the step itself, so there is nothing to overlap with). The environment variable
    ``PAGEDCORE_ASYNC_SCHEDULING`` (``0``/``1``) overrides both.

    Raises
    ------
    ValueError
        The environment variable holds something other than 0/1 (true/false, on/off).
    """
    raw = os.environ.get(ASYNC_SCHEDULING_ENV)
    if raw is not None and raw.strip() != "":
        value = raw.strip().lower()
        if value in _TRUE:
            requested = True
        elif value in _FALSE:
            requested = False
        else:
            raise ValueError(
                f"{ASYNC_SCHEDULING_ENV}={raw!r} is not a switch; set it to 1 (overlap "
                "scheduling on) or 0 (off), or unset it to use LLM(async_scheduling=...)"
            )
    if requested is None:
        requested = device_type == "cuda"
        if not requested:
            return False, "off by default on the CPU (async_scheduling=True turns it on)"
    if not requested:
        return False, "turned off (async_scheduling=False or PAGEDCORE_ASYNC_SCHEDULING=0)"
    return True, None


def resolve_placeholders(input_ids: torch.Tensor, sampled: torch.Tensor) -> None:
    """Replace, in place on the device, every placeholder id ``-(1 + row)`` of `input_ids`
    by ``sampled[row]``.

    Parameters
    ----------
    input_ids:
        ``[T]`` int64: the step's input ids (placeholders negative, every other id >= 0).
    sampled:
        ``[R]`` int64 on the same device: the tokens of the step in flight, by sampled row.
    """
    import torch

    if sampled.numel() == 0:
        return
    rows = input_ids.neg().sub_(1).clamp_(0, sampled.numel() - 1)
    torch.where(input_ids < 0, sampled.index_select(0, rows), input_ids, out=input_ids)


class InputFence:
    """Keeps the host from rewriting pinned input buffers before their last upload ran.

    Uploads from pinned memory are asynchronous: step N's copies may still be queued behind
    step N-1 when the host prepares step N+1 into the same buffers. `record` after a step's
    uploads, `wait` before the next step writes them (it waits for those copies only, never
    for the step's kernels). A no-op off CUDA.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: Any = None

    def record(self, device: torch.device) -> None:
        if device.type != "cuda":
            return
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        self._event = event

    def wait(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()
