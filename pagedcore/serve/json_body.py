"""A request body from its raw bytes: malformed JSON and pydantic's validation errors as
400s naming the field at fault and what it accepts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from pagedcore.serve.errors import BadRequestError

__all__ = ["parse_body"]


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; BadRequestError naming the field for malformed JSON or bad types."""
    import json

    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}",
                              code="invalid_json") from exc
    except RecursionError as exc:  # nested deeper than the parser's recursion limit
        raise BadRequestError("the request body nests JSON arrays or objects too deeply",
                              code="invalid_json") from exc
    if not isinstance(data, dict):
        raise BadRequestError(f"the request body must be a JSON object, got "
                              f"{type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        errors = exc.errors()
        if not errors[0]["loc"]:  # the body as a whole (e.g. a lone surrogate escape)
            raise BadRequestError(f"the request body is not valid JSON: {errors[0]['msg']}",
                                  code="invalid_json") from exc
        loc, message = _describe_error(errors)
        raise BadRequestError(f"invalid field {loc!r}: {message}",
                              param=str(errors[0]["loc"][0]), code="invalid_type") from exc


#: What a field whose type is a union accepts, said for the user.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids (integers) or a list of such "
              "lists",
    "stop": "a string or a list of strings",
    "content": 'a string, null or a list of text parts ({"type": "text", "text": "..."})',
}


def _describe_error(errors: list[Any]) -> tuple[str, str]:
    """The dotted path of the field at fault and what is wrong with it.

    A union field (``prompt``, ``stop``, a message's ``content``) fails once per member, each
    error's path holding the member's tag (``prompt.str``, ``prompt.list[int].0``). When one
    member got deeper into the value than the others, the value has that member's shape and
    its error is the one to report (``prompt.0.1``: not an integer); else the value matches
    no member, and the message says what the field accepts.
    """
    first = errors[0]["loc"]
    same = [e for e in errors if e["loc"][:1] == first[:1]]  # (other fields may fail too)
    n = 0
    while all(len(e["loc"]) > n and e["loc"][n] == first[n] for e in same):
        n += 1
    if len(same) > 1 and all(len(e["loc"]) > n and _is_union_tag(e["loc"][n]) for e in same):
        field = [str(p) for p in first[:n]]
        deepest = max(len(e["loc"]) for e in same)
        best = [e for e in same if len(e["loc"]) == deepest]
        if len(best) == 1 and deepest > n + 1:
            e = best[0]
            return ".".join(field + [str(p) for p in e["loc"][n + 1:]]), e["msg"] + _got(e)
        named = [p for p in field if not p.isdigit()]
        accepts = _UNION_FIELDS.get(named[-1] if named else "") or " or ".join(
            sorted({str(e["loc"][n]) for e in same}))
        return ".".join(field), f"must be {accepts}" + _got(same[0])
    return ".".join(str(p) for p in first), errors[0]["msg"] + _got(errors[0])


def _is_union_tag(item: Any) -> bool:
    """Whether a path item of a pydantic error names a union member (``str``,
    ``list[int]``) rather than a field or a list index."""
    return isinstance(item, str) and (item in ("str", "int", "float", "bool") or "[" in item)


def _got(error: Any) -> str:
    """`` (got ...)`` with the value at fault, unless it is a container or too long."""
    got = error.get("input")
    if isinstance(got, (dict, list)):
        return ""
    text = repr(got)
    return f" (got {text if len(text) <= 60 else text[:57] + '...'})"
