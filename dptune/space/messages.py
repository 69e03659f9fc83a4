"""A search space's validation errors in the user's words: the keys as written, no validator internals.

pydantic names a union's member in an error's location (``function-after[...]``, ``literal['row']``,
a class name) and words its messages for programmers ("Input should be", "Value error,"):
:func:`format_errors` gives each problem as ``key.as.written: what is wrong (got VALUE)``, an unknown key
with the closest key allowed at that place ("did you mean"), and a value that is none of a union's
forms as one line naming the forms allowed.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from dptune.errors import shown
from dptune.space.spec import BACKBONE_FORMS, SearchSpace

#: What each of pydantic's error types tells the user (``ctx`` fills the braces); others keep pydantic's
#: message with "Input should be" as "expected".
_MESSAGES = {
    "missing": "required key is missing",
    "extra_forbidden": "unknown key",
    "string_type": "expected a string",
    "int_type": "expected a whole number",
    "int_parsing": "expected a whole number",
    "int_from_float": "expected a whole number, not a fraction",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "dict_type": "expected a mapping of keys",
    "model_type": "expected a mapping of keys",
    "model_attributes_type": "expected a mapping of keys",
    "literal_error": "not allowed; expected {expected}",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "too_short": "must hold at least {min_length} item(s)",
    "too_long": "must hold at most {max_length} item(s)",
    "string_too_short": "must hold at least {min_length} character(s)",
    "string_too_long": "must hold at most {max_length} characters",
    "finite_number": "must be a finite number (not NaN or infinity)",
    "value_error": "{error}",
    "assertion_error": "{error}",
}
_MAPPING_TYPES = ("dict_type", "model_type", "model_attributes_type")
#: The error types that say a value is of another form than a union's member takes (not a bad value of
#: that form): a union's members that answer only these are the forms the value is not.
_OTHER_FORM = frozenset(
    ("string_type", "int_type", "int_parsing", "float_type", "float_parsing", "bool_type", "bool_parsing")
    + ("list_type", "tuple_type", "literal_error", *_MAPPING_TYPES)
)


def format_errors(path: Path, error: ValidationError, data: dict[str, Any]) -> str:
    """pydantic's errors as the user's keys and plain words: a union's member tags left out of the key,
    the members the value is not the form of left out (or, if it is none of them, one line of the
    forms allowed), an unknown key with the closest allowed one."""
    problems: dict[tuple[Any, ...], list[tuple[ErrorDetails, bool]]] = {}
    for item in error.errors(include_url=False):
        keys, tag_last = _written_keys(item, data)
        problems.setdefault(keys, []).append((item, tag_last))
    lines: list[str] = []
    for keys, items in problems.items():
        forms = [item for item, tag_last in items if tag_last and item["type"] in _OTHER_FORM]
        rest = [item for item, tag_last in items if not (tag_last and item["type"] in _OTHER_FORM)]
        deeper = any(len(other) > len(keys) and other[: len(keys)] == keys for other in problems)
        key = ".".join(str(part) for part in keys) or "(top level)"
        if forms and not rest and not deeper:
            either = " or ".join(dict.fromkeys(_form(item, keys) for item in forms))
            lines.append(f"  - {key}: expected {either}{_got(forms[0])}")
            continue
        scalar = forms and rest and not isinstance(rest[0].get("input"), (dict, list))
        also = f", or {' or '.join(dict.fromkeys(_form(item, keys) for item in forms))}" if scalar else ""
        lines += [f"  - {key}: {_message(item, keys)}{also}{_got(item)}" for item in rest]
    lines = list(dict.fromkeys(lines))
    return "\n".join([f"{path}: invalid search space ({len(lines)} problem(s))", *lines])


def _written_keys(item: ErrorDetails, data: dict[str, Any]) -> tuple[tuple[Any, ...], bool]:
    """The key path of ``item`` as the user wrote it (a union member's tag, which pydantic adds to the
    location, is no key of the input and is left out), and whether its location ends in such a tag."""
    node: Any = data
    keys: list[Any] = []
    tag_last = False
    for depth, part in enumerate(item["loc"]):
        last = depth == len(item["loc"]) - 1
        if isinstance(node, dict) and part in node:
            keys.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            keys.append(part)
            node = node[part]
        elif last and item["type"] == "missing":
            keys.append(part)
        else:
            tag_last = last
    return tuple(keys), tag_last


def _message(item: ErrorDetails, keys: tuple[Any, ...]) -> str:
    """What is wrong at ``keys``, in plain words (an unknown key with the allowed one it is closest to)."""
    if item["type"] == "extra_forbidden":
        allowed = [*section_keys(keys[:-1]), *(("extends",) if len(keys) == 1 else ())]
        close = difflib.get_close_matches(str(keys[-1]), allowed, n=1)
        return f"unknown key; did you mean {close[0]}?" if close else f"unknown key; allowed here: {', '.join(allowed)}"
    if item["type"] in _MAPPING_TYPES and section_keys(keys):
        return f"expected {_form(item, keys)}"
    template = _MESSAGES.get(item["type"])
    if template is None:
        return item["msg"].replace("Input should be", "expected")
    return template.format(**{name: str(value) for name, value in (item.get("ctx") or {}).items()})


def _form(item: ErrorDetails, keys: tuple[Any, ...]) -> str:
    """The form a union's member takes, from its answer to a value of another form."""
    if item["type"] == "literal_error":
        return str((item.get("ctx") or {}).get("expected", "one of the names allowed"))
    if item["type"] in _MAPPING_TYPES:
        allowed = section_keys(keys)
        return f"a mapping {{{', '.join(allowed)}}}" if allowed else "a mapping of keys"
    return _MESSAGES.get(item["type"], item["msg"]).replace("Input should be ", "").removeprefix("expected ")


def _got(item: ErrorDetails) -> str:
    """`` (got VALUE)``, or nothing for a missing or unknown key and a mapping."""
    got = item.get("input")
    return "" if item["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f" (got {shown(got)})"


def section_keys(keys: Sequence[str | int]) -> list[str]:
    """The keys a space allows in the section at ``keys`` (a key path, list indices skipped, as a
    message names it), sorted; [] where ``keys`` names no section."""
    sections: list[type[BaseModel]] = [SearchSpace]
    for key in keys:
        if isinstance(key, int):
            continue
        fields = [section.model_fields[key] for section in sections if key in section.model_fields]
        sections = [found for info in fields for found in _sections_in(info.annotation)]
        if key == "backbone":
            sections += BACKBONE_FORMS
    return sorted({name for section in sections for name in section.model_fields})


def _sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The section models a field's type annotation holds (through unions, lists and ``Annotated``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [found for argument in get_args(annotation) for found in _sections_in(argument)]
