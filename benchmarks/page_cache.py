"""Dropping one file's pages from the page cache and checking what is still resident, without
privileges (`posix_fadvise`, `mincore` through ctypes), so a restore is timed from the disk."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path
from typing import Any


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache (`mincore` on a read-only map)."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    libc = _libc()
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def drop_file_cache(path: Path) -> float:
    """fsync `path`, drop its pages with POSIX_FADV_DONTNEED; return the fraction still resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_fraction(path)


def page_cache_control() -> dict[str, Any]:
    """What this machine allows for dropping the page cache (nothing global is dropped)."""
    out: dict[str, Any] = {"method": "posix_fadvise(POSIX_FADV_DONTNEED) per file, after fsync"}
    try:
        fd = os.open("/proc/sys/vm/drop_caches", os.O_WRONLY)
    except OSError as exc:
        out["drop_caches"] = f"not allowed: {exc.strerror} (errno {exc.errno})"
    else:
        os.close(fd)
        out["drop_caches"] = (
            "writable, not used: it drops the whole machine's page cache, which the other "
            "engineers' engines on this shared machine rely on"
        )
    return out
