"""Type and range checks at the engine's edge, with messages that name the field and the fix.

Every check returns a problem string (or None) instead of raising, so a caller can report
every bad field of one object at once; `raise_problems` turns them into one error.
No silent coercion: a bool is not an int, a str is not a number, a float is not a token id.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_SEED",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "Problems",
    "as_index",
    "check_bool",
    "check_flag",
    "check_int",
    "check_int_sequence",
    "check_real",
    "describe",
    "raise_problems",
]

#: Largest seed a torch generator takes.
MAX_SEED = 2**64 - 1


class InvalidArgumentError(ValueError):
    """A user-supplied argument has a wrong value (the message names it and the fix).

    `fields` names the arguments at fault, first first, where the check knew them (a server
    reports the first as its error's ``param``); empty otherwise.
    """

    fields: tuple[str, ...] = ()


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """A user-supplied argument has a wrong type (also a ValueError, like every rejection)."""


def describe(value: Any) -> str:
    """``"str 'abc'"``: the type name and a short repr of `value`."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _is_bool(value: Any) -> bool:
    # numpy.bool_ has __index__ but is a truth value, not a number.
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def as_index(value: Any) -> int | None:
    """`value` as an int when it is a true integer (int, numpy / torch integer), else None."""
    if _is_bool(value) or isinstance(value, float):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


class Problems:
    """The problems found in one object, split by kind (type or value), and the fields they
    are about (where the check knew its field's name)."""

    __slots__ = ("fields", "type_errors", "value_errors")

    def __init__(self) -> None:
        self.type_errors: list[str] = []
        self.value_errors: list[str] = []
        self.fields: list[str] = []

    def type(self, message: str, field: str | None = None) -> None:
        self.type_errors.append(message)
        self._field(field)

    def value(self, message: str, field: str | None = None) -> None:
        self.value_errors.append(message)
        self._field(field)

    def _field(self, field: str | None) -> None:
        if field and field not in self.fields:
            self.fields.append(field)

    def __bool__(self) -> bool:
        return bool(self.type_errors or self.value_errors)


def raise_problems(what: str, problems: Problems) -> None:
    """Raise one error listing every problem (a TypeError too when any is about a type)."""
    if not problems:
        return
    message = f"invalid {what}: " + "; ".join(problems.type_errors + problems.value_errors)
    error = (InvalidArgumentTypeError if problems.type_errors else InvalidArgumentError)(message)
    error.fields = tuple(problems.fields)
    raise error


def check_int(
    problems: Problems,
    name: str,
    value: Any,
    *,
    low: int | None = None,
    high: int | None = None,
    allow_none: bool = False,
    expected: str | None = None,
) -> int | None:
    """`value` as an int when it is one within ``[low, high]``; else record a problem."""
    if value is None and allow_none:
        return None
    if expected is None:
        if low is not None and high is not None:
            expected = f"an int in [{low}, {high}]"
        elif low is not None:
            expected = f"an int >= {low}"
        else:
            expected = "an int"
        if allow_none:
            expected += " or None"
    as_int = as_index(value)
    if as_int is None:
        hint = ""
        if isinstance(value, str) and value.strip().lstrip("+-").isdecimal():
            hint = f" (pass {int(value)} without quotes)"
        problems.type(f"{name} must be {expected}, got {describe(value)}{hint}", name)
        return None
    if (low is not None and as_int < low) or (high is not None and as_int > high):
        problems.value(f"{name} must be {expected}, got {as_int}", name)
        return None
    return as_int


def check_real(
    problems: Problems,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    expected: str,
) -> float | None:
    """`value` as a float when it is a finite real number in range; else record a problem."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        problems.type(f"{name} must be {expected}, got {describe(value)}", name)
        return None
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        problems.type(f"{name} must be {expected}, got {describe(value)}", name)
        return None
    if math.isnan(as_float) or math.isinf(as_float):
        problems.value(f"{name} must be {expected}, got {as_float}", name)
        return None
    if low is not None and (as_float < low or (low_open and as_float == low)):
        problems.value(f"{name} must be {expected}, got {value!r}", name)
        return None
    if high is not None and as_float > high:
        problems.value(f"{name} must be {expected}, got {value!r}", name)
        return None
    return as_float


def check_bool(problems: Problems, name: str, value: Any) -> bool | None:
    """`value` when it is a real bool (not a truthy string or an int); else record a problem."""
    if isinstance(value, bool):
        return value
    if _is_bool(value):
        return bool(value)
    problems.type(f"{name} must be True or False, got {describe(value)}", name)
    return None


def check_flag(name: str, value: Any, *, allow_none: bool = False) -> bool | None:
    """`value` when it is a real bool (None too with `allow_none`); else an
    `InvalidArgumentTypeError` naming `name` (a truthy string such as ``"no"`` is no switch)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        return value
    if _is_bool(value):
        return bool(value)
    expected = "True, False or None" if allow_none else "True or False"
    raise InvalidArgumentTypeError(f"{name} must be {expected}, got {describe(value)}")


def check_int_sequence(
    problems: Problems, name: str, value: Any, *, low: int = 0, allow_none: bool = True
) -> tuple[int, ...] | None:
    """`value` as a tuple of ints >= `low` (a list or tuple; not a str, bytes or mapping)."""
    if value is None and allow_none:
        return ()
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Sequence):
        hint = ""
        if isinstance(value, str) and value.strip().isdecimal():
            hint = f" (did you mean [{int(value)}]?)"
        elif as_index(value) is not None:
            hint = f" (did you mean [{as_index(value)}]?)"
        problems.type(f"{name} must be a list of ints >= {low}, got {describe(value)}{hint}", name)
        return None
    out: list[int] = []
    for item in value:
        as_int = as_index(item)
        if as_int is None:
            problems.type(
                f"{name} must be a list of ints >= {low}, got an element {describe(item)}", name
            )
            return None
        if as_int < low:
            problems.value(f"{name} must be a list of ints >= {low}, got an element {as_int}", name)
            return None
        out.append(as_int)
    return tuple(out)
