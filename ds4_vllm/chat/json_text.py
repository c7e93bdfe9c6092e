"""JSON read the way the ds4 engine reads it, keeping every value's raw text.

The engine copies some JSON values into the prompt byte for byte (tool schemas, non-string tool
arguments, Anthropic `input`, Responses raw `output`), so the cache key depends on the client's
exact formatting. `parse_json` returns ordinary Python values whose objects, arrays and numbers
also carry `.raw`, the exact source text; the renderer uses it wherever the engine copies raw.

String semantics follow the engine's `json_string`: a string ends at its first NUL (C strings),
a lone UTF-16 surrogate escape stays a lone surrogate (encoded later with "surrogatepass", the
engine's bytes), and only the standard escapes are accepted. Numbers extend as far as C's
`strtod` reads. Malformed JSON raises `JsonTextError` naming the character offset.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: C `isspace` in the "C" locale: JSON whitespace for the engine, and what minifying removes.
C_SPACE = " \t\n\v\f\r"

_NUMBER = re.compile(
    r"[+-]?(?:inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?"
    r"|0x(?:[0-9a-f]+\.?[0-9a-f]*|\.[0-9a-f]+)(?:p[+-]?[0-9]+)?"
    r"|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)",
    re.IGNORECASE,
)
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_MAX_DEPTH = 256  # the engine's JSON_MAX_NESTING


class JsonTextError(ValueError):
    """Malformed JSON; `offset` is the character offset where reading failed."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"invalid JSON at offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


class RawObject(dict):
    """A JSON object with its source text. A repeated key keeps its last value, at the place of its
    last occurrence: the engine reads members in order, so the last one written wins, also over
    other keys that set the same thing (`thinking` and `think`, `id` and `tool_use_id`)."""

    raw: str


class RawArray(list):
    """A JSON array with its source text."""

    raw: str


class RawNumber(float):
    """A JSON number with its source text (the engine copies e.g. `1.50` or `1e3` verbatim)."""

    raw: str


def raw_text(value: Any) -> str:
    """The JSON text the engine would copy for `value`: its source text when known, else compact JSON."""
    raw = getattr(value, "raw", None)
    if raw is not None:
        return raw
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def skip_space(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in C_SPACE:
        pos += 1
    return pos


def read_string(text: str, pos: int) -> tuple[str, int]:
    """The unescaped string starting at `text[pos] == '"'` (cut at its first NUL) and the end offset."""
    if pos >= len(text) or text[pos] != '"':
        raise JsonTextError(pos, "expected a string")
    out: list[str] = []
    i = pos + 1
    n = len(text)
    while True:
        j = i
        while j < n and text[j] != '"' and text[j] != "\\":
            j += 1
        out.append(text[i:j])
        if j >= n:
            raise JsonTextError(pos, "unterminated string")
        if text[j] == '"':
            i = j + 1
            break
        esc = text[j + 1] if j + 1 < n else ""
        if esc in _ESCAPES:
            out.append(_ESCAPES[esc])
            i = j + 2
        elif esc == "u":
            cp = _hex4(text, j)
            i = j + 6
            if 0xD800 <= cp <= 0xDBFF and text.startswith("\\u", i) and _is_hex4(text, i):
                lo = int(text[i + 2 : i + 6], 16)
                i += 6  # the engine consumes the second escape even when it is not a low surrogate
                if 0xDC00 <= lo <= 0xDFFF:
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
            out.append(chr(cp))
        else:
            raise JsonTextError(j, f"invalid escape {esc!r}")
    return "".join(out).split("\0", 1)[0], i


def _is_hex4(text: str, at: int) -> bool:
    digits = text[at + 2 : at + 6]
    return len(digits) == 4 and all(c in "0123456789abcdefABCDEF" for c in digits)


def _hex4(text: str, at: int) -> int:
    if not _is_hex4(text, at):
        raise JsonTextError(at, "invalid \\u escape")
    return int(text[at + 2 : at + 6], 16)


def skip_value(text: str, pos: int) -> int:
    """End offset of the value starting at `pos` (after whitespace)."""
    return _read(text, skip_space(text, pos), 0, build=False)[1]


def parse_json(text: str | bytes) -> Any:
    """The whole document as Python values carrying `.raw` (trailing text after it is ignored,
    as the engine ignores it)."""
    if isinstance(text, bytes | bytearray | memoryview):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonTextError(exc.start, "body is not valid UTF-8") from None
    return _read(text, skip_space(text, 0), 0, build=True)[0]


def minify(raw: str) -> str:
    """Drop whitespace outside strings (`json_minify_raw_value`)."""
    out: list[str] = []
    in_string = escape = False
    for c in raw:
        if in_string:
            out.append(c)
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
            out.append(c)
        elif c not in C_SPACE:
            out.append(c)
    return "".join(out)


def _read(text: str, pos: int, depth: int, *, build: bool) -> tuple[Any, int]:
    if pos >= len(text):
        raise JsonTextError(pos, "expected a value, found the end")
    c = text[pos]
    if c == '"':
        return read_string(text, pos)
    if c == "{" or c == "[":
        if depth >= _MAX_DEPTH:
            raise JsonTextError(pos, f"nesting deeper than {_MAX_DEPTH}")
        return (_read_object if c == "{" else _read_array)(text, pos, depth, build)
    for literal, value in (("true", True), ("false", False), ("null", None)):
        if text.startswith(literal, pos):
            return value, pos + len(literal)
    m = _NUMBER.match(text, pos)
    if not m:
        raise JsonTextError(pos, f"unexpected character {c!r}")
    raw = m.group()
    try:
        number = RawNumber(raw)
    except ValueError:  # C99 hex float, or nan(chars)
        try:
            number = RawNumber(float.fromhex(raw))
        except ValueError:
            number = RawNumber("nan")
    number.raw = raw
    return number, m.end()


def _read_object(text: str, start: int, depth: int, build: bool) -> tuple[Any, int]:
    obj = RawObject() if build else None
    pos = skip_space(text, start + 1)
    if text.startswith("}", pos):
        pos += 1
    else:
        while True:
            key, pos = read_string(text, pos)
            pos = skip_space(text, pos)
            if not text.startswith(":", pos):
                raise JsonTextError(pos, "expected ':'")
            value, pos = _read(text, skip_space(text, pos + 1), depth + 1, build=build)
            if obj is not None:
                obj.pop(key, None)  # a repeated key moves to where it was last written
                obj[key] = value
            pos = skip_space(text, pos)
            if text.startswith("}", pos):
                pos += 1
                break
            if not text.startswith(",", pos):
                raise JsonTextError(pos, "expected ',' or '}'")
            pos = skip_space(text, pos + 1)
    if obj is not None:
        obj.raw = text[start:pos]
    return obj, pos


def _read_array(text: str, start: int, depth: int, build: bool) -> tuple[Any, int]:
    arr = RawArray() if build else None
    pos = skip_space(text, start + 1)
    if text.startswith("]", pos):
        pos += 1
    else:
        while True:
            value, pos = _read(text, pos, depth + 1, build=build)
            if arr is not None:
                arr.append(value)
            pos = skip_space(text, pos)
            if text.startswith("]", pos):
                pos += 1
                break
            if not text.startswith(",", pos):
                raise JsonTextError(pos, "expected ',' or ']'")
            pos = skip_space(text, pos + 1)
    if arr is not None:
        arr.raw = text[start:pos]
    return arr, pos


def json_string(s: str) -> str:
    """The engine's JSON string writer: only `"`, `\\` and control characters are escaped."""
    out = ['"']
    for c in s:
        if c == '"' or c == "\\":
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif c < " ":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    out.append('"')
    return "".join(out)
