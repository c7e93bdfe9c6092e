"""`ds4-kv`: list, inspect, verify, garbage-collect and remove ds4 KVC checkpoint files.

A thin argparse front end over `ds4_vllm.kvc` and `ds4_vllm.store.eviction`. Results go
to stdout; errors go to stderr as one line each, with a non-zero exit and no traceback.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ds4_vllm.cli.kv_format import (
    PREVIEW_CHARS,
    escape_text,
    ext_names,
    fmt_time,
    human_size,
    iso_time,
    preview,
    terminal_width,
    truncate,
)
from ds4_vllm.kvc import (
    Checkpoint,
    CheckpointIndex,
    IndexEntry,
    KvcFormatError,
    clean_temp_files,
    open_checkpoint,
    read_prefix,
)
from ds4_vllm.kvc.constants import KV_SUFFIX, TMP_NAME_RE
from ds4_vllm.store.eviction import MIB, EvictionEntry, eviction_score, plan_eviction

PROG = "ds4-kv"


def out(line: str = "") -> None:
    print(line)


def err(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr)


# ---------------------------------------------------------------------------
# ls
# ---------------------------------------------------------------------------

SORT_KEYS: dict[str, Callable[[IndexEntry], Any]] = {
    "name": lambda e: e.path.name,
    "tokens": lambda e: e.header.tokens,
    "reason": lambda e: e.header.reason,
    "quant": lambda e: e.header.quant_bits,
    "hits": lambda e: e.header.hits,
    "size": lambda e: e.file_size,
    "created": lambda e: e.header.created_at,
    "last_used": lambda e: e.header.last_used or e.header.created_at,
    "text_bytes": lambda e: e.text_bytes,
}


def cmd_ls(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    if not directory.is_dir():
        err(f"error: {directory}: not a directory")
        return 1
    index = CheckpointIndex(directory, keep_text=True)
    index.refresh()
    entries = sorted(
        index.entries, key=lambda e: (SORT_KEYS[args.sort](e), e.path.name), reverse=args.reverse
    )
    width = terminal_width()
    rows = [
        [
            e.sha1,
            str(e.header.tokens),
            e.header.reason_name,
            str(e.header.quant_bits),
            str(e.header.hits),
            human_size(e.file_size),
            fmt_time(e.header.created_at),
            fmt_time(e.header.last_used),
            preview(e.text or b"", 120),
        ]
        for e in entries
    ]
    headers = ["SHA1", "TOKENS", "REASON", "QUANT", "HITS", "SIZE", "CREATED", "LAST USED", "TEXT"]
    right = {"TOKENS", "QUANT", "HITS", "SIZE"}
    cols = list(range(8))
    widths = {i: max([len(headers[i])] + [len(r[i]) for r in rows]) for i in cols}

    def text_room() -> int:
        return width - sum(widths[i] for i in cols) - 2 * len(cols)

    # Narrow terminal: shorten the hash, then drop the time columns, before the text goes.
    if text_room() < 16:
        widths[0] = 12
    for drop in (6, 7):
        if text_room() < 16:
            cols.remove(drop)

    def render(cells: list[str]) -> str:
        parts = []
        for i in cols:
            cell = cells[i][: widths[i]]
            parts.append(cell.rjust(widths[i]) if headers[i] in right else cell.ljust(widths[i]))
        line = "  ".join(parts) + "  " + truncate(cells[8], max(0, text_room()))
        return truncate(line.rstrip(), width)

    out(render(headers))
    for row in rows:
        out(render(row))
    total = sum(e.file_size for e in entries)
    out(
        f"{len(entries)} checkpoint{'s' if len(entries) != 1 else ''}, {human_size(total)} total ({total} bytes)"
    )
    if index.invalid:
        err(
            f"{len(index.invalid)} invalid .kv file(s) not listed; run `{PROG} verify {directory}` for details"
        )
    return 0


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------


def inspect_dict(ck: Checkpoint) -> dict[str, Any]:
    """The JSON document of `inspect --json` (field list in docs/kvc.md)."""
    h = ck.header
    p = ck.payload
    layers = []
    for lay in p.layout.layers:
        layers.append(
            {
                "index": lay.index,
                "ratio": lay.ratio,
                "sections": {
                    s.name: {"offset": ck.payload_offset + s.offset, "shape": list(s.shape)}
                    for s in lay.sections
                },
            }
        )
    return {
        "path": str(ck.path) if ck.path else None,
        "size": ck.file_size,
        "sha1": ck.sha1,
        "name_matches_text": ck.name_matches,
        "magic": "KVC",
        "version": 1,
        "quant_bits": h.quant_bits,
        "reason": h.reason,
        "reason_name": h.reason_name,
        "ext_flags": h.ext_flags,
        "ext_flag_names": ext_names(h.ext_flags),
        "key_kind": h.key_kind,
        "tokens": h.tokens,
        "hits": h.hits,
        "ctx_size": h.ctx_size,
        "created_at": h.created_at,
        "last_used": h.last_used,
        "created_at_iso": iso_time(h.created_at),
        "last_used_iso": iso_time(h.last_used),
        "payload_bytes": h.payload_bytes,
        "text_bytes": ck.text_bytes,
        "text_preview": ck.text[: PREVIEW_CHARS * 4].decode("utf-8", "replace")[:PREVIEW_CHARS],
        "text_offset": 52,
        "payload_offset": ck.payload_offset,
        "trailer_offset": ck.trailer_offset,
        "trailer_bytes": ck.tool_map.nbytes,
        "trailing_bytes": ck.trailing_bytes,
        "payload_header": p.header.as_dict(),
        "n_comp": list(p.n_comp),
        "n_index_comp": list(p.n_index_comp),
        "layers": layers,
        "ktm_present": ck.tool_map.present,
        "ktm_entries": len(ck.tool_map.entries),
        "ktm_ids": ck.tool_map.ids,
    }


def _shape(sec: dict[str, Any] | None) -> str:
    return "x".join(str(d) for d in sec["shape"]) if sec else "-"


def cmd_inspect(args: argparse.Namespace) -> int:
    with open_checkpoint(args.file, check_name=False) as ck:
        doc = inspect_dict(ck)
    if args.json:
        out(json.dumps(doc, indent=2))
        return 0
    name = {
        True: "matches SHA-1 of the text",
        False: f"MISMATCH (text SHA-1 is {doc['sha1']})",
        None: "not a <sha1>.kv name",
    }
    flags = ", ".join(doc["ext_flag_names"]) or "none"
    lines = [
        ("file", doc["path"]),
        ("size", f"{doc['size']} bytes ({human_size(doc['size'])})"),
        ("name", name[doc["name_matches_text"]]),
        ("quant_bits", doc["quant_bits"]),
        ("reason", f"{doc['reason']} ({doc['reason_name']})"),
        ("ext_flags", f"0x{doc['ext_flags']:02x} ({flags})"),
        ("key_kind", doc["key_kind"]),
        ("tokens", doc["tokens"]),
        ("hits", doc["hits"]),
        ("ctx_size", doc["ctx_size"]),
        ("created_at", f"{doc['created_at']} ({fmt_time(doc['created_at'])})"),
        ("last_used", f"{doc['last_used']} ({fmt_time(doc['last_used'])})"),
        ("payload_bytes", doc["payload_bytes"]),
        ("text_bytes", doc["text_bytes"]),
    ]
    width = terminal_width()
    for key, value in lines:
        out(truncate(f"{key + ':':<16}{value}", width))
    out(truncate(f"{'text:':<16}{escape_text(doc['text_preview'])}", width))
    out("payload header:")
    for key, value in doc["payload_header"].items():
        shown = f"0x{value:08x} (DSV4)" if key == "magic" else value
        out(f"  {key + ':':<14}{shown}")
    out("layers:")
    cols = ["raw", "comp", "state_kv", "index_comp", "index_state_kv"]
    out(f"  {'layer':>5} {'ratio':>5}  " + "  ".join(f"{c:<12}" for c in cols))
    for lay in doc["layers"]:
        cells = "  ".join(f"{_shape(lay['sections'].get(c)):<12}" for c in cols)
        out(truncate(f"  {lay['index']:>5} {lay['ratio']:>5}  {cells}".rstrip(), width))
    out(f"{'ktm:':<16}{doc['ktm_entries']} entries ({doc['trailer_bytes']} bytes)")
    for tool_id in doc["ktm_ids"]:
        out(truncate(f"  {escape_text(tool_id)}", width))
    if doc["trailing_bytes"]:
        out(f"{'trailing_bytes:':<16}{doc['trailing_bytes']}")
    return 0


# ---------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------


def verify_file(path: Path) -> str | None:
    """None when `path` is a fully valid checkpoint, else why it is not (one line)."""
    try:
        with open_checkpoint(path, check_name=True, strict_trailer=True) as ck:
            if ck.trailing_bytes:
                return f"{ck.trailing_bytes} unexpected bytes after the payload/trailer at byte {ck.file_size - ck.trailing_bytes}"
    except KvcFormatError as exc:
        at = f" at byte {exc.offset}" if exc.offset is not None else ""
        return f"{exc.field}{at}: {exc.reason}"
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}"
    return None


def _expand(paths: Iterable[str]) -> tuple[list[Path], list[tuple[Path, str]]]:
    files, problems = [], []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files.extend(sorted(c for c in p.iterdir() if c.name.endswith(KV_SUFFIX) and c.is_file()))
        elif p.exists():
            files.append(p)
        else:
            problems.append((p, "no such file or directory"))
    return files, problems


def cmd_verify(args: argparse.Namespace) -> int:
    files, problems = _expand(args.paths)
    bad = list(problems)
    for f in files:
        reason = verify_file(f)
        if reason is None:
            if args.verbose:
                out(f"ok   {f}")
        else:
            bad.append((f, reason))
    for f, reason in bad:
        out(escape_text(f"BAD  {f}: {reason}"))
    out(
        f"{len(files)} file{'s' if len(files) != 1 else ''} checked, {len(files) + len(problems) - len(bad)} valid, {len(bad)} bad"
    )
    return 1 if bad else 0


# ---------------------------------------------------------------------------
# gc, rm, text
# ---------------------------------------------------------------------------


def cmd_gc(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    if not directory.is_dir():
        err(f"error: {directory}: not a directory")
        return 1
    if args.max_mb < 0:
        err("error: --max-mb must be >= 0")
        return 2
    budget = int(args.max_mb * MIB)
    index = CheckpointIndex(directory, keep_text=False)
    index.refresh()
    now = _dt.datetime.now().timestamp()
    entries = [
        EvictionEntry(
            str(e.path), e.file_size, e.header.tokens, e.header.hits, e.header.created_at, e.header.last_used
        )
        for e in index.entries
    ]
    verb = "would remove" if args.dry_run else "removed"
    failed = 0
    freed = 0
    removed = 0
    for victim in plan_eviction(entries, budget, now):
        if not args.dry_run:
            try:
                os.unlink(victim.path)
            except FileNotFoundError:
                continue  # someone else removed it: the space is free either way
            except OSError as exc:
                err(f"error: cannot remove {victim.path}: {exc.strerror or exc}")
                failed += 1
                break  # as ds4: stop the pass on a failed unlink
        removed += 1
        freed += victim.file_size
        out(
            f"{verb} {Path(victim.path).name} tokens={victim.tokens} hits={victim.hits} "
            f"size={victim.file_size / MIB:.1f} MiB score={eviction_score(victim, now):.6g}"
        )
    for tmp in clean_temp_files(directory, dry_run=args.dry_run):
        out(f"{verb} stale temp file {tmp.name}")
    total = index.total_bytes - freed
    out(
        f"{verb} {removed} of {len(entries)} checkpoints, freed {freed / MIB:.1f} MiB; "
        f"{total / MIB:.1f} MiB of {args.max_mb:g} MiB budget in use"
    )
    return 1 if failed else 0


def cmd_rm(args: argparse.Namespace) -> int:
    status = 0
    for raw in args.files:
        p = Path(raw)
        if not (p.name.endswith(KV_SUFFIX) or TMP_NAME_RE.match(p.name)):
            err(f"error: {p}: not a .kv checkpoint file; refusing to remove it")
            status = 1
            continue
        if p.is_dir():
            err(f"error: {p}: is a directory")
            status = 1
            continue
        try:
            p.unlink()
        except OSError as exc:
            err(f"error: cannot remove {p}: {exc.strerror or exc}")
            status = 1
            continue
        out(f"removed {p}")
    return status


def cmd_text(args: argparse.Namespace) -> int:
    prefix = read_prefix(args.file, with_text=True)
    sys.stdout.flush()
    sys.stdout.buffer.write(prefix.text or b"")
    sys.stdout.buffer.flush()
    return 0


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect and manage ds4 KVC checkpoint files (<sha1>.kv)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list the checkpoints of a directory")
    p.add_argument("dir")
    p.add_argument(
        "--sort", choices=sorted(SORT_KEYS), default="created", help="sort field (default: created)"
    )
    p.add_argument("--reverse", action="store_true", help="reverse the order")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show every field of one checkpoint")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print one JSON object (fields in docs/kvc.md)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check files fully; exit 0 only if all are valid")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files, or directories of .kv files")
    p.add_argument("-v", "--verbose", action="store_true", help="also list valid files")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", help="evict checkpoints as ds4 does until the directory fits a budget")
    p.add_argument("dir")
    p.add_argument("--max-mb", type=float, required=True, help="budget in MiB (ds4's --kv-disk-space-mb)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("rm", help="remove checkpoint files")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("text", help="write the stored key text bytes to stdout")
    p.add_argument("file")
    p.set_defaults(func=cmd_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KvcFormatError as exc:
        err(f"error: {escape_text(str(exc))}")
        return 1
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            # e.g. `ds4-kv text F | head`: the reader left; exit quietly
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except OSError:
                pass
            return 141
        where = f"{exc.filename}: " if exc.filename else ""
        err(f"error: {where}{exc.strerror or exc}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
