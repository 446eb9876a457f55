"""Settings in one table: ``TIERED_PROGCACHE_*`` variables and defaults -> a ready :class:`TieredProgramCache`.

Precedence: a keyword argument (``from_env(remote=...)``, a CLI flag) beats the
environment, which beats the default. An empty variable counts as unset. A value that
does not parse is a ``ValueError`` that names the variable, raised before anything is
built, so a typo in a job's environment fails the job instead of silently running
without a cache.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from .tiered import DEFAULT_MAX_MEMORY_BYTES, TieredProgramCache

__all__ = ["ENV_PREFIX", "CacheConfig", "parse_size"]

logger = logging.getLogger(__name__)

ENV_PREFIX = "TIERED_PROGCACHE_"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}  # fmt: skip
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_UNLIMITED = {"none", "unlimited"}


def parse_size(text: str) -> int:
    """``"256M"`` -> 256_000_000, ``"10Gi"`` -> 10 * 2**30, ``"4096"`` -> 4096 (ccache's units, as the CLI)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 256M, 10G, 10Gi, 4096, none)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


# -- one parser per kind of value: text from the environment, or a Python value from an argument --


def _size(value: Any) -> int | None:
    if isinstance(value, str):
        if value.strip().lower() in _UNLIMITED:
            return None
        value = parse_size(value)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"not a size: {value!r}")
    if value <= 0:
        raise ValueError(f"must be a positive number of bytes (or none for no limit), got {value}")
    return value


def _count(value: Any) -> int:
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise ValueError(f"not a positive integer: {value!r}")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return value


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ValueError(f"not a boolean: {value!r} (use 1/0, true/false, yes/no, on/off)")


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"not a number of seconds: {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def _path(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"not a path: {value!r}")
    return Path(os.path.expanduser(os.fspath(value)))


def _url(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"not a URL: {value!r}")
    from .remote import check_url

    check_url(value)
    return value


def _options(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc}); expected an object like '{{\"anon\": true}}'") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a JSON object (fsspec storage options), got {type(value).__name__}")
    return dict(value)


def _compression(value: Any) -> str | None:
    if value is None:
        return None
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in ("zstd", "none"):
        raise ValueError(f"must be zstd or none, got {value!r}")
    return None if text == "none" else "zstd"


#: field -> (variable suffix, parser). The one table of settings.
_SETTINGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "local_dir": ("DIR", _path),
    "max_memory_bytes": ("MAX_MEMORY_BYTES", _size),
    "max_local_bytes": ("MAX_LOCAL_BYTES", _size),
    "remote": ("REMOTE", _url),
    "remote_options": ("REMOTE_OPTIONS", _options),
    "remote_read_only": ("READ_ONLY", _flag),
    "signing_key_file": ("SIGNING_KEY_FILE", _path),
    "compression": ("COMPRESSION", _compression),
    "remote_timeout": ("REMOTE_TIMEOUT", _seconds),
    "strict": ("STRICT", _flag),
    "max_pending_uploads": ("MAX_PENDING_UPLOADS", _count),
}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Everything needed to build the cache, and where each value came from.

    >>> config = CacheConfig.from_env(remote="s3://ci-kernels/cuda13")
    >>> config.sources()["remote"], config.sources()["local_dir"]
    ('argument', 'default')
    >>> cache = config.build()

    Immutable, so safe to share between threads; ``build()`` makes a new cache each call.
    ``local_dir=None`` means cuda-core's default directory; ``remote_timeout=None`` the
    remote tier's default; ``max_*_bytes=None`` no limit.
    """

    local_dir: Path | None = None
    max_memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES
    max_local_bytes: int | None = None
    remote: str | None = None
    remote_options: dict[str, Any] | None = None
    remote_read_only: bool = False
    signing_key_file: Path | None = None
    compression: str | None = None
    remote_timeout: float | None = None
    strict: bool = False
    max_pending_uploads: int = 1024
    _sources: dict[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CacheConfig:
        """Read ``TIERED_PROGCACHE_*`` from ``environ`` (default ``os.environ``); ``overrides`` win.

        >>> CacheConfig.from_env({"TIERED_PROGCACHE_MAX_LOCAL_BYTES": "10G"}).max_local_bytes
        10000000000
        """
        if environ is None:
            environ = os.environ
        unknown = sorted(set(overrides) - set(_SETTINGS))
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(_SETTINGS)}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for field, (suffix, parse) in _SETTINGS.items():
            variable = ENV_PREFIX + suffix
            if field in overrides:
                where, raw = "argument", overrides[field]
                if raw is None:  # an explicit None: "no limit" / "no remote" / "the default"
                    values[field] = _default(field) if field in _NONE_MEANS_DEFAULT else None
                    sources[field] = where
                    continue
            elif environ.get(variable, "").strip():
                where, raw = f"env {variable}", environ[variable]
            else:
                continue
            try:
                values[field] = parse(raw)
            except ValueError as exc:
                raise ValueError(f"{variable if where != 'argument' else field}: {exc}") from None
            sources[field] = where
        return cls(**values, _sources=sources)

    def sources(self) -> dict[str, str]:
        """Field -> ``"default"``, ``"env TIERED_PROGCACHE_X"`` or ``"argument"``."""
        return {field: self._sources.get(field, "default") for field in _SETTINGS}

    def build(self) -> TieredProgramCache:
        """A new cache as configured. The signing key file is read now (and only its bytes are kept)."""
        return TieredProgramCache(
            self.local_dir,
            max_memory_bytes=self.max_memory_bytes,
            max_local_bytes=self.max_local_bytes,
            remote=self.remote,
            remote_options=self.remote_options,
            remote_read_only=self.remote_read_only,
            signing_key=self._signing_key(),
            compression=self.compression,
            remote_timeout=self.remote_timeout,
            strict=self.strict,
            max_pending_uploads=self.max_pending_uploads,
        )

    def _signing_key(self) -> bytes | None:
        if self.signing_key_file is None:
            return None
        source = self.sources()["signing_key_file"]
        where = source.removeprefix("env ") if source.startswith("env ") else "signing_key_file"
        try:
            key = _strip_one_line_ending(self.signing_key_file.read_bytes())
            mode = self.signing_key_file.stat().st_mode
        except OSError as exc:
            raise ValueError(f"{where}: cannot read the signing key file: {exc}") from None
        if not key:
            raise ValueError(f"{where}: the signing key file {self.signing_key_file} is empty")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                "signing key file %s is readable by others (mode %o); anyone who reads it can sign entries",
                self.signing_key_file, stat.S_IMODE(mode),
            )
        return key


def _strip_one_line_ending(raw: bytes) -> bytes:
    """The key file's bytes less one trailing newline (``openssl rand -hex 32 > f`` adds one).

    Nothing else is stripped: a binary key (``openssl rand 32 > f``) may begin or end
    with whitespace bytes, and must sign the same as ``signing_key=`` given those bytes.
    """
    for ending in (b"\r\n", b"\n"):
        if raw.endswith(ending):
            return raw[: -len(ending)]
    return raw


#: Fields whose argument ``None`` means "the default", not "none": a bool or count has no "none".
_NONE_MEANS_DEFAULT = {"remote_read_only", "strict", "max_pending_uploads"}


def _default(field: str) -> Any:
    return next(f.default for f in dataclasses.fields(CacheConfig) if f.name == field)
