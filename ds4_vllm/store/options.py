"""The disk-cache settings: ds4's flag names and defaults, parsed and validated once at start-up.

Every setting has two spellings: the ds4 flag (`--kv-cache-min-tokens`) and the key of vLLM's
`kv_connector_extra_config` (`kv_cache_min_tokens`). Errors name both, so a user can fix
whichever one they typed. Bad input stops start-up (`StoreConfigError`); nothing here is
retried or guessed. `SETTINGS` is the only table of them: the `vllm serve` flag rewrite
(`ds4_vllm.cli.vllm_args`) derives its flags, kinds and bounds from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .eviction import DEFAULT_BUDGET_MB, MIB

#: ds4's budget default (DS4_KVSTORE_DEFAULT_MB): 4 GiB holds a few long conversations.
DEFAULT_DISK_SPACE_MB = DEFAULT_BUDGET_MB
#: KV_CACHE_DEFAULT_MIN_TOKENS: below this, recomputing is cheaper than a file load.
DEFAULT_MIN_TOKENS = 512
#: KV_CACHE_DEFAULT_COLD_MAX_TOKENS: longer first prompts are one-offs (documents), not
#: conversation prefixes worth a cold file; 0 disables cold saves.
DEFAULT_COLD_MAX_TOKENS = 30000
#: KV_CACHE_DEFAULT_CONTINUED_INTERVAL_TOKENS: how much growth is worth a new file (the
#: effective step is rounded up to the alignment: 10240); 0 disables continued saves.
DEFAULT_CONTINUED_INTERVAL_TOKENS = 10000
#: KV_CACHE_DEFAULT_BOUNDARY_TRIM_TOKENS: the tail of a prompt (chat template suffix, last
#: user words) rarely recurs, so a cold file stops a little before the end.
DEFAULT_BOUNDARY_TRIM_TOKENS = 32
#: KV_CACHE_DEFAULT_BOUNDARY_ALIGN_TOKENS: the prefill chunk (2048), so saved lengths fall on
#: chunk boundaries and compressed rows are complete; 0 disables alignment.
DEFAULT_BOUNDARY_ALIGN_TOKENS = 2048
#: ds4-vllm's own: the least a divergence save (`agent-system`, where a prompt's set-up parts from
#: a known prompt's) must add past what the prompt reused; 0 disables every `agent-system` save,
#: the set-up ladder included (ds4's policy).
DEFAULT_DIVERGENCE_TOKENS = 512
#: Checkpoints copied out of the KV cache and waiting for the disk, in MiB of host memory; when
#: the writer falls this far behind, engine steps wait for it (back-pressure) instead of
#: dropping saves. ds4-vllm's own flag (ds4 writes synchronously), spelled like ds4's.
DEFAULT_WRITE_QUEUE_MB = 1024
#: How stale a replica's view of a shared store may be: the index is re-listed at a lookup when
#: this long has passed since the last listing (a local directory is also re-read as soon as its
#: mtime changes). So a file another replica wrote is found by every lookup that starts at least
#: this long after the file landed. 0 re-lists at every lookup (tests; costly on object stores).
DEFAULT_RESCAN_MS = 2000
#: How long a load lease protects a file from every replica's eviction (leases.py). Must exceed
#: the longest time from choosing a file to the end of its load; a lease of a replica that died
#: only delays that file's eviction by this long.
DEFAULT_LEASE_S = 600
#: DS4_TOOL_MEMORY_DEFAULT_MAX_IDS: tool-call ids remembered for exact replay (least recently used
#: go first); trailers with more than 4x this many entries are ignored when read.
DEFAULT_TOOL_MEMORY_MAX_IDS = 100_000


class StoreConfigError(ValueError):
    """A disk-cache setting is invalid; the message names the flag in both spellings."""


def setting_flag(key: str) -> str:
    """The ds4 flag spelling of an extra-config key: `kv_cache_min_tokens` → `--kv-cache-min-tokens`."""
    return f"--{key.replace('_', '-')}"


def flag_names(key: str) -> str:
    """`--kv-cache-min-tokens / kv_cache_min_tokens`: how every message names a setting."""
    return f"{setting_flag(key)} / {key}"


def default_disk_dir(env: Mapping[str, str] | None = None) -> str:
    """Per-user cache folder: $XDG_CACHE_HOME/ds4-vllm/kvcache, else ~/.cache/ds4-vllm/kvcache."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ds4-vllm", "kvcache")


def is_local_dir(url: str) -> bool:
    """True for plain paths and `file://` URLs: those use OS calls directly, not fsspec."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> Path:
    return Path(url[len("file://") :] if url.startswith("file://") else url).expanduser()


@dataclasses.dataclass(frozen=True, slots=True)
class StoreOptions:
    """Validated disk-cache settings. Field names are the extra-config keys without `kv_`/`kv_cache_`.

    Build with `from_extra_config()` (checks everything) or directly in tests, then call
    `validate()`.
    """

    disk_dir: str | None = None  # None: a folder per model under default_disk_dir() (`for_model`)
    disk_space_mb: int = DEFAULT_DISK_SPACE_MB
    min_tokens: int = DEFAULT_MIN_TOKENS
    cold_max_tokens: int = DEFAULT_COLD_MAX_TOKENS
    continued_interval_tokens: int = DEFAULT_CONTINUED_INTERVAL_TOKENS
    boundary_trim_tokens: int = DEFAULT_BOUNDARY_TRIM_TOKENS
    boundary_align_tokens: int = DEFAULT_BOUNDARY_ALIGN_TOKENS
    divergence_tokens: int = DEFAULT_DIVERGENCE_TOKENS
    reject_different_quant: bool = False
    write_queue_mb: int = DEFAULT_WRITE_QUEUE_MB
    shared_models: bool = False
    trace: str | None = None
    tool_memory_max_ids: int = DEFAULT_TOOL_MEMORY_MAX_IDS
    rescan_ms: int = DEFAULT_RESCAN_MS
    lease_s: int = DEFAULT_LEASE_S

    @property
    def budget_bytes(self) -> int:
        return self.disk_space_mb * MIB

    @property
    def write_queue_bytes(self) -> int:
        return self.write_queue_mb * MIB

    @property
    def continued_step(self) -> int:
        """ceil(interval / align) * align (10240 by default); 0 when continued saves are off."""
        interval, align = self.continued_interval_tokens, self.boundary_align_tokens
        if interval <= 0:
            return 0
        return math.ceil(interval / align) * align if align > 0 else interval

    @property
    def directory(self) -> str:
        """Where checkpoints live: `disk_dir`, else the per-user default folder."""
        return self.disk_dir if self.disk_dir is not None else default_disk_dir()

    @property
    def is_local(self) -> bool:
        return is_local_dir(self.directory)

    def for_model(self, label: str) -> StoreOptions:
        """Without `--kv-disk-dir`, each model gets its own folder under the default one."""
        if self.disk_dir is not None:
            return self
        return dataclasses.replace(self, disk_dir=os.path.join(default_disk_dir(), label))

    def validate(self) -> StoreOptions:
        """Check value ranges (no I/O; the directory is checked when the store opens)."""
        for key, setting in SETTINGS.items():
            setting.check(key, getattr(self, setting.field))
        if 0 < self.cold_max_tokens < self.min_tokens:
            raise StoreConfigError(
                f"{flag_names('kv_cache_cold_max_tokens')}: {self.cold_max_tokens} is below "
                f"{flag_names('kv_cache_min_tokens')} ({self.min_tokens}); use 0 to disable cold saves "
                f"or a value >= {self.min_tokens}"
            )
        return self

    @classmethod
    def from_extra_config(cls, config: Mapping[str, Any], *, other_keys: Iterable[str] = ()) -> StoreOptions:
        """Parse `kv_connector_extra_config` (keys may also be written as `--kv-disk-dir`).

        Values are parsed by `Setting.parse` (the ds4 flags go through the same code).
        `other_keys` are keys owned by other parts of the connector, passed over silently.
        Anything else unknown is an error.
        """
        values: dict[str, Any] = {}
        ignored = {normalize_key(k) for k in other_keys}
        for raw_key, raw in config.items():
            key = normalize_key(str(raw_key))
            if key in ignored:
                continue
            setting = setting_for(key, spelled=str(raw_key))
            values[setting.field] = setting.parse(key, raw)
        return cls(**values).validate()

    def describe(self) -> str:
        """The start-up log line's settings, in ds4's order and spelling."""
        return (
            f"budget={self.disk_space_mb} MiB, cross-quant={'reject' if self.reject_different_quant else 'accept'}, "
            f"min={self.min_tokens}, cold_max={self.cold_max_tokens}, continued={self.continued_interval_tokens}, "
            f"trim={self.boundary_trim_tokens}, align={self.boundary_align_tokens}"
        )


def normalize_key(key: str) -> str:
    """`--kv-disk-dir` or `kv-disk-dir` → `kv_disk_dir`."""
    return key.lstrip("-").replace("-", "_")


_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")
_INTEGER = re.compile(r"-?[0-9]+")
_INVALID = object()  # what _convert returns for a value of the wrong kind


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """One disk-cache setting: its StoreOptions field, value type and bounds.

    The one parser for both spellings: `from_extra_config` and the `vllm serve` flag rewrite
    (`ds4_vllm.cli.vllm_args`) both call `parse`, so values, bounds and messages agree.
    `kind` is int, bool or str (a path or URL, which must not be empty).
    """

    field: str
    kind: type
    minimum: int = 0
    optional: bool = False

    @property
    def kind_name(self) -> str:
        return {int: "an integer", bool: "true or false", str: "a path"}[self.kind]

    def parse(self, key: str, raw: Any) -> Any:
        """`raw` as a checked value: ints or decimal strings, bools or true/false/1/0/yes/no/on/off."""
        value = self._convert(raw)
        if value is _INVALID:
            raise StoreConfigError(f"{flag_names(key)}: expected {self.kind_name}, got {raw!r}")
        self.check(key, value)
        return value

    def check(self, key: str, value: Any) -> None:
        """Type and bounds of an already converted value (also of StoreOptions built directly)."""
        if value is None and self.optional:
            return
        if not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool)):
            raise StoreConfigError(f"{flag_names(key)}: expected {self.kind_name}, got {value!r}")
        if self.kind is int and isinstance(value, int) and value < self.minimum:
            raise StoreConfigError(f"{flag_names(key)}: must be >= {self.minimum}, got {value}")
        if self.kind is str and not value:
            raise StoreConfigError(f"{flag_names(key)}: must not be empty")

    def _convert(self, raw: Any) -> Any:
        if raw is None and self.optional:
            return None
        if self.kind is bool:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.strip().lower() in _TRUE_WORDS + _FALSE_WORDS:
                return raw.strip().lower() in _TRUE_WORDS
        elif self.kind is int:
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and _INTEGER.fullmatch(raw.strip()):
                return int(raw)
        elif isinstance(raw, str | os.PathLike):
            return os.fspath(raw)
        return _INVALID


#: THE table of disk-cache settings: extra-config key -> StoreOptions field, type and lower bound
#: (ds4's `parse_options` rules). The ds4 flag is the key with dashes (`setting_flag`); the
#: `vllm serve` rewrite derives its flags from here. A new setting is one row here plus a
#: StoreOptions field with its default (tests/store/test_options.py checks they match).
SETTINGS: dict[str, Setting] = {
    "kv_disk_dir": Setting("disk_dir", str, optional=True),
    "kv_disk_space_mb": Setting("disk_space_mb", int, minimum=1),
    "kv_cache_min_tokens": Setting("min_tokens", int, minimum=1),
    "kv_cache_cold_max_tokens": Setting("cold_max_tokens", int),
    "kv_cache_continued_interval_tokens": Setting("continued_interval_tokens", int),
    "kv_cache_boundary_trim_tokens": Setting("boundary_trim_tokens", int),
    "kv_cache_boundary_align_tokens": Setting("boundary_align_tokens", int),
    "kv_cache_divergence_tokens": Setting("divergence_tokens", int),
    "kv_cache_reject_different_quant": Setting("reject_different_quant", bool),
    "kv_write_queue_mb": Setting("write_queue_mb", int, minimum=1),
    "kv_cache_shared_models": Setting("shared_models", bool),
    "trace": Setting("trace", str, optional=True),
    "tool_memory_max_ids": Setting("tool_memory_max_ids", int, minimum=1),
    "kv_cache_rescan_ms": Setting("rescan_ms", int),
    "kv_cache_lease_s": Setting("lease_s", int, minimum=1),
}

#: Every key `from_extra_config` accepts.
SETTING_KEYS = tuple(SETTINGS)


def setting_for(key: str, *, spelled: str | None = None) -> Setting:
    """The setting of a normalized key; an unknown key raises StoreConfigError (with a close match).

    `spelled` is the key as the user wrote it, for the message.
    """
    setting = SETTINGS.get(key)
    if setting is not None:
        return setting
    close = difflib.get_close_matches(key, list(SETTINGS), n=1)
    hint = f"; did you mean {flag_names(close[0])}?" if close else ""
    raise StoreConfigError(f"unknown disk-cache setting {spelled or key!r}{hint}")
