"""Reading request fields as the ds4 engine reads them; a field of the wrong type is refused by name.

The engine keeps strings as C strings, so text after a NUL is gone (`cstr`). Request bodies come
as raw JSON (bytes/str, read by `json_text.parse_json`, which keeps every value's source text) or
as parsed Python values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .json_text import JsonTextError, json_string, parse_json


class RenderError(ValueError):
    """A request the engine refuses (it answers HTTP 400); the message names the field."""


def cstr(s: str) -> str:
    """The engine keeps strings as C strings: text after a NUL is gone."""
    return s.split("\0", 1)[0]


def str_field(obj: Mapping, key: str, path: str) -> str:
    """`obj[key]`, which must be a string (`path.key` names it in the error)."""
    value = obj[key]
    if not isinstance(value, str):
        raise RenderError(f"{path}.{key}: expected a string, got {type(value).__name__}")
    return cstr(value)


def opt_str_field(obj: Mapping, key: str, path: str) -> str | None:
    """`str_field`, or None when the key is absent."""
    return str_field(obj, key, path) if key in obj else None


def object_value(value: Any, path: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise RenderError(f"{path}: expected an object, got {type(value).__name__}")
    return value


def array_value(value: Any, path: str) -> Sequence:
    if not isinstance(value, list | tuple):
        raise RenderError(f"{path}: expected an array, got {type(value).__name__}")
    return value


def load_request(request: Mapping | bytes | str, what: str) -> Mapping:
    """A request body as a mapping: raw JSON is parsed (keeping source texts); `what` names the API."""
    if isinstance(request, bytes | bytearray | memoryview | str):
        try:
            request = parse_json(request)
        except JsonTextError as exc:
            raise RenderError(f"{what} body: {exc}") from None
    return object_value(request, f"{what} body")


def json_content(value: Any, path: str) -> str:
    """Message content (`json_content`): a string, or the concatenated strings and `text` fields
    of an array; null and other values give ""."""
    if isinstance(value, str):
        return cstr(value)
    if not isinstance(value, list | tuple):
        return ""
    parts: list[str] = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            parts.append(cstr(part))
        elif isinstance(part, Mapping) and "text" in part:
            parts.append(str_field(part, "text", f"{path}[{i}]"))
    return "".join(parts)


def json_escape(s: str) -> str:
    """The engine's JSON string writer over its C string (text after a NUL is gone)."""
    return json_string(cstr(s))
