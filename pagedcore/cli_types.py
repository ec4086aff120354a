"""click parameter types shared by every `pagedcore` command: user mistakes become one-line
usage errors (exit code 2) before any work starts, never tracebacks or silent defaults."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # click >= 8.2 types ParamType as a generic; 8.1 does not subscript it
    _IntListType = click.ParamType[list[int]]
    _IntType = click.ParamType[int]
    _StrType = click.ParamType[str]
else:
    _IntListType = _IntType = _StrType = click.ParamType

__all__ = [
    "BACKEND",
    "DEVICE",
    "BackendName",
    "ChatTemplate",
    "Device",
    "FiniteFloat",
    "IntList",
    "MemorySize",
    "OutputPath",
    "positive_int",
]


class FiniteFloat(click.FloatRange):
    """`click.FloatRange` without NaN and infinity (``--kv-cache-mb nan`` is a usage error:
    every comparison with NaN is false, so a range alone lets it through)."""

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        converted = super().convert(value, param, ctx)
        if isinstance(converted, float) and not math.isfinite(converted):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return converted


def positive_int(minimum: int = 1) -> click.IntRange:
    """An int option of at least `minimum` (``--num-prompts -1`` is a usage error)."""
    return click.IntRange(min=minimum)


class IntList(_IntListType):
    """A comma list of integers, each at least `min_value`: ``"512,1024"`` -> ``[512, 1024]``.

    The one list type of every bench (``--sizes``, ``--lengths``, ``--budgets``, ...).
    """

    name = "INT[,INT...]"

    def __init__(self, min_value: int | None = 1) -> None:
        self.min_value = min_value

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        items = [part.strip() for part in str(value).split(",")]
        if not any(items):
            self.fail(f"expected a comma list of integers, got {value!r}", param, ctx)
        numbers: list[int] = []
        for item in items:
            if not item:
                continue
            try:
                number = int(item)
            except ValueError:
                self.fail(f"{item!r} in {value!r} is not an integer (expected e.g. "
                          "'512,1024')", param, ctx)
            if self.min_value is not None and number < self.min_value:
                self.fail(f"{number} in {value!r} is below the minimum {self.min_value}",
                          param, ctx)
            numbers.append(number)
        return numbers


_SIZE_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
               "gb": 10**9, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}


class MemorySize(_IntType):
    """A byte count: ``4GiB``, ``512MiB``, ``1e9`` or a plain number of bytes."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        lowered = str(value).strip().lower()
        number, scale = lowered, 1
        for suffix in sorted(_SIZE_UNITS, key=len, reverse=True):
            if lowered.endswith(suffix):
                number, scale = lowered.removesuffix(suffix).strip(), _SIZE_UNITS[suffix]
                break
        try:
            size = int(float(number) * scale)
        except (ValueError, OverflowError):
            self.fail(f"{value!r} is not a size such as 4GiB, 512MiB or 1e9", param, ctx)
        if size <= 0:
            self.fail(f"{value!r} must be positive", param, ctx)
        return size


class Device(_StrType):
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA is refused here when torch sees no CUDA device."""

    name = "cpu|cuda[:N]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        text = str(value).strip().lower()
        kind, _, index = text.partition(":")
        if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdecimal())):
            self.fail(f"{value!r} is not a device; use cpu, cuda or cuda:N", param, ctx)
        if kind == "cuda":
            import torch

            if not torch.cuda.is_available():
                self.fail(f"{value!r}: no CUDA device is available here "
                          "(torch.cuda.is_available() is False); use --device cpu", param, ctx)
            if index and int(index) >= torch.cuda.device_count():
                self.fail(f"{value!r}: this machine has {torch.cuda.device_count()} CUDA "
                          "device(s)", param, ctx)
        return text


class BackendName(_StrType):
    """The name of a registered attention backend (unknown names list the known ones)."""

    name = "BACKEND"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        from pagedcore.plugins.errors import PluginError
        from pagedcore.plugins.registry import get_registry

        name = str(value)
        try:
            get_registry().get(name)
        except PluginError as err:
            self.fail(str(err), param, ctx)
        return name


class OutputPath(click.Path):
    """A file to write (``--json PATH``): its directory must exist, checked before any run."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False, writable=True)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        parent = os.path.dirname(os.path.abspath(os.fspath(path)))
        if not os.path.isdir(parent):
            self.fail(f"directory {parent!r} does not exist; create it first", param, ctx)
        return path


class ChatTemplate(_StrType):
    """A Jinja chat template: the path of a file holding one, or the template itself on one
    line (``--chat-template tmpl.jinja`` or ``--chat-template "{% for m in messages %}..."``,
    as ``vllm serve`` takes it). Checked to parse before the model loads."""

    name = "FILE|TEMPLATE"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        text = str(value)
        if os.path.isfile(text):
            try:
                with open(text, encoding="utf-8-sig") as f:  # (a byte-order mark dropped)
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                self.fail(f"cannot read the chat template file {value!r}: {exc}", param, ctx)
        elif "{{" not in text and "{%" not in text:
            self.fail(f"{value!r} is neither a file nor a Jinja template (a template holds "
                      "'{{ ... }}' or '{% ... %}'); give the path of a template file",
                      param, ctx)
        if not text.strip():
            self.fail(f"the chat template {value!r} is empty", param, ctx)
        import jinja2

        try:
            _template_environment().parse(text)
        except jinja2.TemplateSyntaxError as exc:
            self.fail(f"the chat template does not parse: {exc.message} (line {exc.lineno})",
                      param, ctx)
        return text


def _template_environment() -> Any:
    """A Jinja environment that parses what transformers renders: loop controls (``{% break
    %}``, ``{% continue %}``) and the ``{% generation %}...{% endgeneration %}`` block of
    assistant-mask templates (parsed as its body)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols

    class GenerationBlock(Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance variable)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return jinja2.Environment(extensions=[loopcontrols, GenerationBlock])


DEVICE = Device()
BACKEND = BackendName()
