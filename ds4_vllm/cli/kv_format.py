"""How `ds4-kv` shows checkpoint fields: escaped text previews, display widths of wide and
combining characters, sizes, times and extension flag names."""

from __future__ import annotations

import datetime as _dt
import shutil
import unicodedata

from ds4_vllm.kvc import (
    ExtFlag,
)

PREVIEW_CHARS = 200

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_text(text: str) -> str:
    """Make untrusted text safe for a terminal: control/format characters become escapes."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs"):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def preview(text: bytes, limit: int = PREVIEW_CHARS) -> str:
    return escape_text(text[: limit * 4].decode("utf-8", "backslashreplace"))[:limit]


def _char_width(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def display_width(text: str) -> int:
    return sum(_char_width(ch) for ch in text)


def truncate(text: str, width: int) -> str:
    """Cut `text` to at most `width` terminal columns, marking the cut with '…'."""
    if width <= 0:
        return ""
    if display_width(text) <= width:
        return text
    out, used = [], 0
    for ch in text:
        w = _char_width(ch)
        if used + w > width - 1:
            break
        out.append(ch)
        used += w
    return "".join(out) + "…"


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def fmt_time(ts: int) -> str:
    if ts == 0:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):
        return str(ts)


def iso_time(ts: int) -> str | None:
    try:
        return _dt.datetime.fromtimestamp(ts, _dt.UTC).isoformat() if ts else None
    except (OverflowError, OSError, ValueError):
        return None


def ext_names(flags: int) -> list[str]:
    names = [f.name.lower().replace("_", "-") for f in ExtFlag if flags & f and f.name]
    unknown = flags & ~sum(ExtFlag)
    if unknown:
        names.append(f"unknown-0x{unknown:02x}")
    return names


def terminal_width() -> int:
    return max(40, shutil.get_terminal_size((120, 24)).columns)
