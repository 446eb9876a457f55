"""The one table of settings: each one's kind, default, variable, flag and help, and the checks they share.

The keyword constructor of :class:`~tiered_progcache.chain.tiered.TieredProgramCache`,
:meth:`CacheConfig.from_env <tiered_progcache.config.CacheConfig.from_env>`, the
command's options, ``compile()``'s defaults and the settings table of
docs/configuration.md (:mod:`tiered_progcache.settingsdoc`) are all built from
:data:`SETTINGS`, so a new setting is one row here plus the code that uses its value
(a chain-wide one reads it as ``cache.settings.<name>``).

Each default is written once, in its row; the few that other modules need by name are
the ``DEFAULT_*`` constants below, which the rows use. This module imports no backend:
a URL's shape is checked by :mod:`tiered_progcache.urls`.

A value comes from one of two places. Text (an environment variable, a command-line
flag) is read by its kind's ``from_text`` (``"10G"``, ``"true"``, ``'{"anon": true}'``);
a Python value (a keyword argument) is checked as it is, so ``strict="false"`` is an
error rather than a true string. Both end in the kind's ``check``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Callable

from .units import parse_size
from .redact import mask_url
from .urls import check_redis_url, check_url, is_redis_url

__all__ = [
    "DEFAULT_BOOT_FETCH_BYTES",
    "DEFAULT_COMPILE_TIME_PRIOR_S",
    "DEFAULT_EXIT_TIMEOUT_S",
    "DEFAULT_LEASE_MIN_COMPILE_RTTS",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_MAX_MEMORY_BYTES",
    "DEFAULT_MAX_PENDING_UPLOADS",
    "DEFAULT_MAX_PENDING_UPLOAD_BYTES",
    "DEFAULT_REMOTE_TIMEOUT_S",
    "DEFAULT_TRANSFER_CONCURRENCY",
    "DEFAULT_WAIT_PATIENCE",
    "DEFAULT_WAIT_TIMEOUT_S",
    "ENV_PREFIX",
    "MAX_SECONDS",
    "SETTINGS",
    "STATS_FILE_ENV",
    "Kind",
    "Setting",
    "add_arguments",
    "by_name",
    "check",
    "overrides_from_args",
    "remote_urls",
]

#: Every variable is this plus a setting's suffix: ``TIERED_PROGCACHE_REMOTE``.
ENV_PREFIX = "TIERED_PROGCACHE_"

#: Not a setting: the file ``tiered-progcache stats --run`` has every cache of the command append its
#: counters to at exit (:mod:`tiered_progcache.chain.exitreport`). Read by every chain however it was built.
STATS_FILE_ENV = ENV_PREFIX + "STATS_FILE"

#: The memory tier's default byte cap: a few thousand typical cubins.
DEFAULT_MAX_MEMORY_BYTES = 256 << 20

#: Leases only for compiles of at least this many round trips: the holder's three before its compile (look, create,
#: look) and the waiter's one after it (docs/cluster.md, "When nodes wait").
DEFAULT_LEASE_MIN_COMPILE_RTTS = 4.0
#: None: a waiter waits while the holder's lease is renewed; a factor opts into giving up after that many
#: of the holder's estimated compile times (plus the landing's round trips).
DEFAULT_WAIT_PATIENCE: float | None = None
#: Accepted and unused, so a configuration that sets it still loads: no flight decision uses a prior (a compile
#: of unknown time takes the lease).
DEFAULT_COMPILE_TIME_PRIOR_S = 1.0

#: Seconds everything a process does at interpreter exit may take in all (README: "exit flushes within 10 s").
DEFAULT_EXIT_TIMEOUT_S = 10.0

#: The byte cap on a tier's background write queue: as much as the memory tier holds.
DEFAULT_MAX_PENDING_UPLOAD_BYTES = 256 << 20
#: Background writes queued per tier before new ones are dropped.
DEFAULT_MAX_PENDING_UPLOADS = 1024

#: Remote requests in flight at once during warm and push (and entries per bulk request).
DEFAULT_TRANSFER_CONCURRENCY = 64

#: Bytes a fresh node's first shared lookup fetches in one batch, newest first (docs/cluster.md, "A fresh node on a
#: warm store"): as much as the memory tier holds, a few thousand typical cubins.
DEFAULT_BOOT_FETCH_BYTES = 256 << 20

#: The longest any waiter waits for another thread, process or node before compiling itself.
DEFAULT_WAIT_TIMEOUT_S = 300.0
#: How long a remote lease lives without renewal (the holder renews it every third of this).
DEFAULT_LEASE_TTL_S = 60.0

#: The most seconds any seconds setting takes (365 days). Every wait, timer and deadline the library
#: schedules from one (``Event.wait``, a lease's renewal, a socket timeout, Redis's ``PX``) takes this
#: on every platform: ``threading.TIMEOUT_MAX`` is about 292 years, and ``inf`` or ``1e10`` overflow
#: (``OverflowError: timestamp out of range``), so a larger value is refused as it is read.
MAX_SECONDS = 365 * 86400.0

#: Seconds one request to a shared tier (fsspec remote or Redis) may take before it counts as a failure.
DEFAULT_REMOTE_TIMEOUT_S = 5.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_UNLIMITED = {"none", "unlimited"}


@dataclasses.dataclass(frozen=True)
class Kind:
    """How one kind of value is read, checked and written back as text.

    ``check`` takes a Python value and returns the setting's value (``TypeError`` for a
    wrong type, ``ValueError`` for a bad value); ``from_text`` turns a variable's or a
    flag's text into the Python form ``check`` takes (``ValueError``); ``to_text`` is the
    text ``from_text`` reads back (so a child process can inherit a flag). A ``switch``
    kind's flag takes no value (``--strict``).
    """

    name: str
    check: Callable[[Any], Any]
    from_text: Callable[[str], Any]
    to_text: Callable[[Any], str]
    metavar: str | None = None
    switch: bool = False


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the table.

    ``env`` is the variable's suffix after :data:`ENV_PREFIX` (None: no variable);
    ``flag`` the command-line option (None: none; a switch whose default is on also
    gets ``--no-...``). ``builds_tiers`` marks settings that only shape the default
    chain, so they make no sense with ``tiers=[...]``; the others are chain-wide. ``secret``
    marks values never to be shown (``repr``, ``tiered-progcache config``). ``doc`` is
    the meaning docs/configuration.md gives (default: ``help``); ``doc_default`` how it
    shows the default where the value alone does not say it (``None`` that means
    "cuda-core's directory"). ``unused``: why a setting kept only so old configurations
    parse does nothing (a value other than its default is warned about once).
    """

    name: str
    kind: Kind
    default: Any
    help: str
    env: str | None = None
    flag: str | None = None
    builds_tiers: bool = False
    secret: bool = False
    doc: str = ""
    doc_default: str = ""
    unused: str = ""

    @property
    def variable(self) -> str | None:
        """The environment variable that sets this, or None."""
        return None if self.env is None else ENV_PREFIX + self.env

    def parse(self, value: Any) -> Any:
        """This setting's value from a Python value; ``TypeError``/``ValueError`` saying what is wrong."""
        return self.kind.check(value)

    def parse_text(self, text: str) -> Any:
        """This setting's value from a variable's or a flag's text; ``ValueError`` saying what is wrong."""
        return self.kind.check(self.kind.from_text(text))

    def text(self, value: Any) -> str:
        """The text that :meth:`parse_text` reads back as ``value`` (``""`` means the default)."""
        return self.kind.to_text(value)


# -- the kinds of value -------------------------------------------------------------------------


def _plain_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _check_size(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"must be an int (bytes) or None (no limit), got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"must be positive (a number of bytes, or none for no limit), got {value}")
    return value


def _size_from_text(text: str) -> int | None:
    if text.strip().lower() in _UNLIMITED:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ValueError(f"{exc}, or none for no limit") from None


def _none_as_word(value: int | None) -> str:
    return "none" if value is None else str(value)


def _check_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")
    return value


def _count_from_text(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"not a positive integer: {text!r}")
    return int(text)


def _check_switch(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"must be True or False, got {type(value).__name__}")
    return value


def _switch_from_text(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (use 1/0, true/false, yes/no, on/off)")


def _check_seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"must be a number of seconds or None, got {type(value).__name__}")
    if not 0 < value < math.inf:
        raise ValueError(f"must be a positive, finite number of seconds, got {value!r}")
    return _at_most_max(value)


def _at_most_max(value: int | float) -> float:
    """``value`` as seconds, refused above :data:`MAX_SECONDS` (what every wait, timer and deadline can take)."""
    if value > MAX_SECONDS:
        raise ValueError(f"must be at most {MAX_SECONDS:.0f} seconds (a year, the longest wait the library "
                         f"schedules), got {value!r}; give {MAX_SECONDS:.0f} for no practical limit")
    return float(value)


def _check_positive_seconds(value: Any) -> float:
    if value is None:
        raise TypeError("must be a number of seconds, got None")
    return _check_seconds(value)  # type: ignore[return-value]  # None is refused above


def _check_wait_seconds(value: Any) -> float:
    """Zero or more seconds, at most :data:`MAX_SECONDS` (0: do not wait)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"must be a number of seconds, got {type(value).__name__}")
    if not value >= 0:  # NaN too
        raise ValueError(f"must be zero or more seconds, got {value!r}")
    return _at_most_max(value)


def _seconds_from_text(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r}") from None


def _check_factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"must be a number, got {type(value).__name__}")
    if not 0 <= value < math.inf:
        raise ValueError(f"must be a non-negative, finite number, got {value!r}")
    return float(value)


def _factor_from_text(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


def _check_factor_or_none(value: Any) -> float | None:
    return None if value is None else _check_factor(value)


def _factor_or_none_from_text(text: str) -> float | None:
    if text.strip().lower() in _UNLIMITED:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r} (or none for no limit)") from None


def _check_path(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"must be a path (str or os.PathLike), got {type(value).__name__}")
    text = os.fspath(value)
    if not text:
        # Path("") is the working directory: a cache there is never what an empty value meant.
        raise ValueError("must not be empty (give '.' for the working directory, or None for the default)")
    return Path(os.path.expanduser(text))


def _check_url(value: Any) -> str | tuple[str, ...] | None:
    """One URL (a str), or several shared tiers in order (a list or tuple: a tuple of str; one URL stays a str)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        urls = tuple(value)
        if not urls:
            raise ValueError("must name at least one URL (or be None for no shared tier)")
        for n, url in enumerate(urls):
            if url in urls[:n]:  # shown once and masked: a list echoed whole would show every password
                raise ValueError(f"names one URL twice ({mask_url(url)!r}, as URLs {urls.index(url) + 1} and {n + 1}); "
                                 "give each shared tier once")
        for url in urls:
            _check_one_url(url)
        return urls[0] if len(urls) == 1 else urls
    _check_one_url(value)
    return value


def _check_one_url(value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"must be a URL (str) or a list of URLs, got {type(value).__name__}")
    if is_redis_url(value):
        check_redis_url(value)
        return
    check_url(value)


def _urls_from_text(text: str) -> str | list[str]:
    """A JSON list of URLs, or URLs separated by commas (one URL: the str itself)."""
    if text.strip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not a valid JSON list of URLs ({exc})") from None
        if not isinstance(value, list):
            raise ValueError(f"must be a JSON list of URLs, got {type(value).__name__}")
        return value
    urls = [part.strip() for part in _URL_SEPARATOR.split(text)]
    if any(not url for url in urls):
        # Never the text itself: it holds every URL's password.
        raise ValueError(f"an empty URL in the comma-separated list of {len(urls)} (a comma with no URL after it, "
                         "or two commas in a row): remove the extra comma")
    return urls[0] if len(urls) == 1 else urls


#: Where a comma-separated list of URLs is cut: before a comma that a scheme follows (``,s3://``, or a
#: mistyped ``,redis:/``, which is then refused as such), or another comma, or the end; so a comma inside
#: a password or a query (``redis://:ab,cd@h/0``, ``?password=ab,cd``) stays in its URL.
_URL_SEPARATOR = re.compile(r",(?=\s*(?:[A-Za-z][A-Za-z0-9+.\-]*(?:::|:/)|,|$))")


def _urls_to_text(value: str | tuple[str, ...] | None) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(list(value))


def remote_urls(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The ``remote`` setting as the ordered URLs of the shared tiers (empty for none)."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _check_options(value: Any) -> dict[str, Any] | None:
    """A mapping, or its JSON text (as a variable or flag gives it)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _options_from_text(value)
    if not isinstance(value, Mapping):
        raise TypeError(f"must be a mapping (fsspec storage options) or its JSON text, got {type(value).__name__}")
    return dict(value)


def _options_from_text(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc}); expected an object like '{{\"anon\": true}}'") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to read; storage options are a few levels at most") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a JSON object (fsspec storage options), got {type(value).__name__}")
    return dict(value)


def _options_to_text(value: Mapping[str, Any] | None) -> str:
    return "" if value is None else json.dumps(dict(value))


def _check_compression(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"must be 'zstd', 'none' or None, got {type(value).__name__}")
    codec = value.strip().lower()
    if codec not in ("zstd", "none"):
        raise ValueError(f"must be zstd or none, got {value!r}")
    return None if codec == "none" else "zstd"


def _check_key(value: Any) -> bytes | str | None:
    if value is None:
        return None
    if not isinstance(value, (bytes, str)):
        raise TypeError(f"must be bytes or str, got {type(value).__name__}")
    if not value:
        raise ValueError("must not be empty")
    return value


def _no_text(value: Any) -> Any:
    raise ValueError("has no text form (give it as a Python value)")


def _check_budget(value: Any) -> int:
    """A byte budget: an int of zero (off) or more; a float (``inf``, ``1e300``) is refused, not rounded."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"must be an int (bytes; 0 turns it off), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"must be zero (off) or a number of bytes, got {value}")
    return value


def _budget_from_text(text: str) -> int:
    if text.strip().lower() in _FALSE:
        return 0
    try:
        return parse_size(text)
    except OverflowError:  # more digits than a float holds
        raise ValueError(f"not a size: {text.strip()[:24]!r}... has more digits than any byte count") from None
    except ValueError as exc:
        raise ValueError(f"{exc}, or 0 (off)") from None


SIZE = Kind("size", _check_size, _size_from_text, _none_as_word, metavar="SIZE")
BUDGET = Kind("size", _check_budget, _budget_from_text, _plain_text, metavar="SIZE")
COUNT = Kind("count", _check_count, _count_from_text, _plain_text, metavar="N")
SWITCH = Kind("switch", _check_switch, _switch_from_text, lambda value: "1" if value else "0", switch=True)
SECONDS = Kind("seconds", _check_seconds, _seconds_from_text, _plain_text, metavar="SECONDS")
POSITIVE_SECONDS = Kind("seconds", _check_positive_seconds, _seconds_from_text, _plain_text, metavar="SECONDS")
WAIT_SECONDS = Kind("seconds", _check_wait_seconds, _seconds_from_text, _plain_text, metavar="SECONDS")
FACTOR = Kind("factor", _check_factor, _factor_from_text, _plain_text, metavar="X")
FACTOR_OR_NONE = Kind("factor", _check_factor_or_none, _factor_or_none_from_text, _none_as_word, metavar="X")
PATH = Kind("path", _check_path, str, _plain_text, metavar="PATH")
URL = Kind("url", _check_url, _urls_from_text, _urls_to_text, metavar="URL")
OPTIONS = Kind("json", _check_options, _options_from_text, _options_to_text, metavar="JSON")
CODEC = Kind("codec", _check_compression, str, _none_as_word, metavar="CODEC")
KEY = Kind("key", _check_key, _no_text, _no_text)


#: Every setting, in the order ``tiered-progcache config`` and docs/configuration.md show them.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "local_dir", PATH, None, "local cache directory",
        env="DIR", flag="--dir", builds_tiers=True,
        doc="the local tier's directory; `~` is expanded",
        doc_default="cuda-core's directory: `<user cache dir>/cuda-python/program-cache` (`~/.cache/...` on Linux; "
        "`XDG_CACHE_HOME` moves it)",
    ),
    Setting(
        "max_memory_bytes", SIZE, DEFAULT_MAX_MEMORY_BYTES, "cap on the memory tier, e.g. 512M",
        env="MAX_MEMORY_BYTES", builds_tiers=True,
        doc="the memory tier's LRU cap; `none` = no limit",
    ),
    Setting(
        "max_local_bytes", SIZE, None, "cap on the local directory, e.g. 20G",
        env="MAX_LOCAL_BYTES", flag="--max-local-bytes", builds_tiers=True,
        doc="the local directory's cap; over it, cuda-core evicts least-recently-read entries",
    ),
    Setting(
        "remote", URL, None,
        "the shared tiers, nearest first: one URL or several, comma-separated (redis://host:6379/0,s3://bucket/prefix)",
        env="REMOTE", flag="--remote", builds_tiers=True,
        doc="the shared tiers, nearest first: one URL, or several as a list (`remote=[\"redis://cache:6379/0\", "
        "\"s3://ci-kernels/cuda13\"]`; in the variable comma-separated or a JSON list). `redis://`, `rediss://` and "
        "`unix://` URLs are Redis tiers ([cluster.md](cluster.md#redis-in-front-of-the-bucket)); any other is an "
        "fsspec URL (`s3://bucket/prefix`, `gs://...`, `file:///nfs/...`, `memory://...`) whose scheme fsspec must "
        "know. A hit in a slower one is promoted into the nearer ones; a write goes to each in the background",
        doc_default="none (local only)",
    ),
    Setting(
        "remote_options", OPTIONS, None, "fsspec storage options as a JSON object, e.g. '{\"anon\": true}'",
        env="REMOTE_OPTIONS", flag="--remote-options", builds_tiers=True,
        doc="fsspec storage options, a JSON object (`{\"endpoint_url\": \"http://minio:9000\", \"anon\": false}`)",
    ),
    Setting(
        "remote_read_only", SWITCH, False, "never write the remote",
        env="READ_ONLY", flag="--read-only", builds_tiers=True,
        doc="never write, promote into or delete from the remote (a fleet reading what CI wrote)",
    ),
    Setting(
        "signing_key", KEY, None, "key that signs remote entries and checks their signatures (bytes)",
        builds_tiers=True, secret=True,
        doc="HMAC key as `bytes` or `str`: writers sign entries, readers reject unsigned or wrongly signed ones. "
        "Masked wherever settings are shown; give it or `signing_key_file`, not both",
        doc_default="none (unsigned)",
    ),
    Setting(
        "signing_key_file", PATH, None, "key that signs remote entries and checks their signatures",
        env="SIGNING_KEY_FILE", flag="--signing-key-file", builds_tiers=True,
        doc="a file holding `signing_key`. The file is read once at build by "
        "`tiered_progcache.config.read_key_file` (the one reader: variable, flag and keyword alike; "
        "`signing_key=read_key_file(path)` in code): one trailing `\\n` or `\\r\\n` is dropped and nothing else "
        "(a binary key keeps its whitespace bytes); an empty file is an error; a warning if group or others can read it",
        doc_default="none (unsigned)",
    ),
    Setting(
        "compression", CODEC, None, "compress remote entries (zstd)",
        env="COMPRESSION", flag="--compression", builds_tiers=True,
        doc="`zstd` (needs the `zstd` extra) or `none`: how this process *writes* remote entries; readers read both",
    ),
    Setting(
        "remote_timeout", SECONDS, DEFAULT_REMOTE_TIMEOUT_S, "give up on one remote operation after this long",
        env="REMOTE_TIMEOUT", flag="--remote-timeout", builds_tiers=True,
        doc="deadline of one remote request (listings get at least 120 s; a batch of `warm`/`push` scales with its size)",
        doc_default="5 s",
    ),
    Setting(
        "create_remote_root", SWITCH, False,
        "create a file:// remote's directory if it does not exist (default: a missing one is an error, "
        "so an unmounted NFS share never fills the local disk)",
        env="CREATE_REMOTE_ROOT", flag="--create-remote-root", builds_tiers=True,
        doc="create a `file://` remote's directory if it does not exist. Off, a missing one counts as a missing "
        "bucket (an NFS share that is not mounted must not fill the local disk): a warning and a local-only start, "
        "or with `strict` an error; a write never recreates it. Commands that only read (`ls`, `stats`, `explain`, "
        "`verify`, `warm`'s reads, `export`, `config`) never create anything, whatever it says. Other filesystems "
        "(`memory://`) create their root",
    ),
    Setting(
        "strict", SWITCH, False, "fail at once if the remote is unreachable (default: warn, run local-only)",
        env="STRICT", flag="--strict", builds_tiers=True,
        doc="an unreachable remote, missing bucket or bad credentials at construction raise instead of a warning "
        "and a local-only start",
    ),
    Setting(
        "redis_expire_s", SECONDS, None, "expire each entry written to a Redis tier after this long (none: keep)",
        env="REDIS_EXPIRE_S", builds_tiers=True,
        doc="seconds after which Redis drops an entry written to a Redis tier (`SET ... PX`, renewed by every write "
        "or promotion); fsspec remotes ignore it",
        doc_default="none (keep)",
    ),
    Setting(
        "transfer_concurrency", COUNT, DEFAULT_TRANSFER_CONCURRENCY,
        "remote requests in flight at once during warm and push",
        env="TRANSFER_CONCURRENCY", flag="--transfer-concurrency", builds_tiers=True,
        doc="remote requests in flight at once during `warm`/`push` (obstore's S3 client runs that many threads; "
            "where s3fs serves S3, raise its connection pool to match)",
    ),
    Setting(
        "boot_fetch_bytes", BUDGET, DEFAULT_BOOT_FETCH_BYTES,
        "a fresh node's first shared lookup also fetches the store's newest entries up to this many bytes, e.g. 1G "
        "(0: off)",
        env="BOOT_FETCH_BYTES",
        doc="when a lookup first reaches the shared tier and the local directory holds no entry, one listing and one "
        "batch of reads bring the newest entries whose stored sizes add up to at most this (and to `max_local_bytes`; "
        "at most 10000 entries) into the local directory, in the background; `0` turns it off "
        "([cluster.md](cluster.md#a-fresh-node-on-a-warm-store))",
    ),
    Setting(
        "min_upload_compile_s", SECONDS, None,
        "keep entries that compiled in less than this many seconds on the node: not uploaded (none: upload all)",
        env="MIN_UPLOAD_COMPILE_S", flag="--min-upload-compile-s",
        doc="admission by compile time: an entry `compile()` built in less than this many seconds is kept in memory "
        "and the local directory but not uploaded to the shared tiers "
        "([cluster.md](cluster.md#admission-by-compile-time))",
        doc_default="none (off)",
    ),
    Setting(
        "explain_misses", SWITCH, False,
        "log why each compile() miss missed (one INFO line on tiered_progcache.compiling.compile; lists every tier per miss)",
        env="EXPLAIN",
        doc="`compile()` logs one INFO line per miss on `tiered_progcache.compiling.compile` (on stderr where the application "
        "set up no logging) saying why it missed: the nearest stored entry and what differs "
        "([cluster.md](cluster.md#why-did-this-miss)); costs a listing of every tier per miss, nothing when off",
    ),
    Setting(
        "lease_min_compile_rtts", FACTOR, DEFAULT_LEASE_MIN_COMPILE_RTTS,
        "take a cluster lease (other nodes wait for this compile) only when the compile is estimated at "
        "this many remote round trips or more (0: always)",
        env="LEASE_MIN_COMPILE_RTTS", flag="--lease-min-compile-rtts",
        doc="a compile this node predicts under this many remote round trips races the remote lookup (both start "
        "together, no lease, the first answer wins; where every CPU is busy, the lookup first); one predicted "
        "longer, or never timed on this node, takes the cluster lease (other nodes wait for it); `0`: always the "
        "lease ([cluster.md](cluster.md#when-nodes-wait))",
    ),
    Setting(
        "wait_patience", FACTOR_OR_NONE, DEFAULT_WAIT_PATIENCE,
        "unused (kept so old configurations parse): a waiter waits while the holder's lease is renewed, "
        "up to compile()'s wait_timeout",
        env="WAIT_PATIENCE", flag="--wait-patience",
        doc="unused, kept so old configurations still parse: a node waiting for another node's compile waits while "
        "the holder's lease is renewed, up to `wait_timeout` ([cluster.md](cluster.md#when-nodes-wait))",
        unused="a waiter waits while the holder's lease is renewed, up to wait_timeout",
    ),
    Setting(
        "compile_time_prior_s", SECONDS, DEFAULT_COMPILE_TIME_PRIOR_S,
        "unused (kept so old configurations parse): a compile never timed on this node takes the lease",
        env="COMPILE_TIME_PRIOR_S", flag="--compile-time-prior-s",
        doc="unused, kept so old configurations still parse: a compile never timed on this node takes the lease, "
        "whatever a prior would say",
        unused="a compile never timed on this node takes the lease, whatever a prior would say",
    ),
    Setting(
        "max_pending_uploads", COUNT, DEFAULT_MAX_PENDING_UPLOADS,
        "background writes queued per tier before new ones are dropped",
        env="MAX_PENDING_UPLOADS",
        doc="background write queue length per tier; a write to a full queue is dropped and counted (`dropped`)",
    ),
    Setting(
        "max_pending_upload_bytes", SIZE, DEFAULT_MAX_PENDING_UPLOAD_BYTES,
        "bytes of background writes queued or under way per tier before new ones are dropped, e.g. 1G",
        env="MAX_PENDING_UPLOAD_BYTES",
        doc="bytes of background writes queued or under way per tier (`none`: no limit); a write that would pass "
        "it is dropped and counted (`dropped`), so a slow remote costs at most this much memory per tier",
    ),
    Setting(
        "exit_timeout", SECONDS, DEFAULT_EXIT_TIMEOUT_S,
        "seconds interpreter exit may spend in all on background uploads and lease releases (process-wide: "
        "the smallest of its caches')",
        env="EXIT_TIMEOUT", flag="--exit-timeout",
        doc="what interpreter exit may spend in all on this process's exit work: the flush of background uploads "
        "and the release of a lease whose upload is in share it, counted from the flush's start; the work stops "
        "0.5 s (at most half the budget) early to leave the interpreter's teardown that much. Process-wide: the "
        "smallest value of any cache the process built",
    ),
    # compile()'s knobs: compile(cache=c) takes each from c.settings unless the call gives it.
    Setting(
        "single_flight", SWITCH, True,
        "compile() on a miss: one thread per process, one process per local directory and one node per remote "
        "compiles each key, the others wait for its entry",
        env="SINGLE_FLIGHT", flag="--single-flight",
        doc="`compile()` on a miss: one thread per process, one process per local directory and one node per "
        "remote compiles each key while the others wait for its entry (up to `wait_timeout`); off, every caller "
        "compiles ([cluster.md](cluster.md#when-nodes-wait)). `compile(single_flight=...)` wins",
    ),
    Setting(
        "wait_timeout", WAIT_SECONDS, DEFAULT_WAIT_TIMEOUT_S,
        "the longest compile() waits for another thread, process or node's compile before compiling itself",
        env="WAIT_TIMEOUT", flag="--wait-timeout",
        doc="the longest `compile()` waits for another thread, process or node compiling the same key before it "
        "compiles itself (`0`: never wait), so a stuck holder costs time, never a hang. "
        "`compile(wait_timeout=...)` wins",
    ),
    Setting(
        "lease_ttl", POSITIVE_SECONDS, DEFAULT_LEASE_TTL_S,
        "seconds a cluster lease lives without renewal (the holder renews it every third of this)",
        env="LEASE_TTL", flag="--lease-ttl",
        doc="seconds a cluster lease lives without renewal: the holder renews it every third of this, and a crashed "
        "holder delays the other nodes by at most about this long ([cluster.md](cluster.md#when-nodes-wait)). "
        "`compile(lease_ttl=...)` wins",
    ),
    Setting(
        "header_recheck_s", WAIT_SECONDS, 0.0,
        "seconds a process trusts a header scan before it looks at the headers again (0: every compile() call)",
        env="HEADER_RECHECK_S", flag="--header-recheck-s",
        doc="seconds a process trusts a header scan before it looks at the headers again (`0`: every `compile()` "
        "call, which with inotify costs one `poll(2)`; a header edited within the window is not seen by this "
        "process until it passes). `compile(header_recheck_s=...)` wins",
    ),
    Setting(
        "portable_keys", SWITCH, True,
        "key include directories by role and header content, not by path, so hosts with the headers elsewhere "
        "share entries",
        env="PORTABLE_KEYS", flag="--portable-keys",
        doc="`compile()` and `explain()` key include directories and other paths by role (`I0`, `I1`, the "
        "source's directory) and header content, not location, so hosts with the same headers under other roots "
        "share entries; off, keys by path ([cluster.md](cluster.md#portable-keys)). "
        "`compile(portable_keys=...)` wins",
    ),
)  # fmt: skip


def by_name() -> dict[str, Setting]:
    """The table keyed by setting name (read at each call, so a patched table is seen)."""
    return {setting.name: setting for setting in SETTINGS}


def check(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each given Python value checked by its row; errors name the setting.

    An unknown name is a ``TypeError`` (as for any unexpected keyword argument).
    """
    table = by_name()
    unknown = sorted(set(values) - set(table))
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(table)}")
    checked = {}
    for name, value in values.items():
        try:
            checked[name] = table[name].parse(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
    return checked


# -- the command's options ------------------------------------------------------------------------


def add_arguments(parser: Any, *, exclude: Collection[str] = (), hidden: bool = False) -> None:
    """Add an option for every setting with a flag (to a parser or an argument group).

    Options default to "not given" (``SUPPRESS``), so an unset flag leaves the setting
    to its variable. Values are checked as the command line is parsed: a bad one is an
    argparse usage error naming the flag. ``exclude`` names settings whose flag the
    caller adds itself (the command's ``--remote`` also picks the tier it acts on).
    ``hidden``: accepted but left out of ``--help`` (the command lists them once).
    """
    for setting in SETTINGS:
        if setting.flag is None or setting.name in exclude:
            continue
        help_text = setting.help if setting.variable is None else f"{setting.help} [{setting.variable}]"
        if hidden:
            help_text = argparse.SUPPRESS
        if setting.kind.switch:
            # A switch that is on by default can only be turned off: --x / --no-x.
            action = argparse.BooleanOptionalAction if setting.default else "store_true"
            parser.add_argument(setting.flag, dest=setting.name, action=action, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(
                setting.flag,
                dest=setting.name,
                metavar=setting.kind.metavar,
                type=_argument_type(setting),
                default=argparse.SUPPRESS,
                help=help_text,
            )


def overrides_from_args(args: argparse.Namespace, *, exclude: Collection[str] = ()) -> dict[str, Any]:
    """The settings given on the command line (by :func:`add_arguments`'s options), name -> value."""
    given = vars(args)
    return {
        setting.name: given[setting.name]
        for setting in SETTINGS
        if setting.flag is not None and setting.name not in exclude and setting.name in given
    }


def _argument_type(setting: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return setting.parse_text(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.name
    return parse
