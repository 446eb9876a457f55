"""ConfigValues: every setting's value for one cache, checked, with where each came from; it builds nothing.

Precedence: a keyword argument (``from_env(remote=...)``, a CLI flag) beats the
environment, which beats the config file (:mod:`tiered_progcache.configfile`), which beats the default. An empty variable counts as unset. A value that
does not parse is a ``ValueError`` that names the variable, raised before anything is
built, so a typo in a job's environment fails the job instead of silently running
without a cache. What the settings are is :data:`tiered_progcache.settings.SETTINGS`.

The chain (:class:`~tiered_progcache.chain.tiered.TieredProgramCache`) resolves its keyword
settings into one of these and keeps it as ``cache.settings``; :class:`~tiered_progcache.config.CacheConfig`
adds ``build()``. The two are apart so that the chain reads settings without importing
the module that builds chains.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from . import settings
from .configfile import read_config_file
from .redact import MASK, masked

__all__ = ["ConfigValues", "read_key_file"]

logger = logging.getLogger(__name__)

_Self = TypeVar("_Self", bound="ConfigValues")

#: Settings kept only so old configurations parse that a value was given for: warned about once per process.
_warned_unused: set[str] = set()
_warned_lock = threading.Lock()


def _warn_unused(setting: settings.Setting, source: str) -> None:
    """One WARNING per process that ``setting`` (given by ``source``) does nothing, and why."""
    with _warned_lock:
        if setting.name in _warned_unused:
            return
        _warned_unused.add(setting.name)
    logger.warning("%s does nothing (kept so old configurations parse): %s; remove it", _where(setting.name, source),
                   setting.unused)


class ConfigValues:
    """Every setting's value, checked, and where each came from. Immutable, so safe to share across threads.

    >>> values = ConfigValues.from_env({"TIERED_PROGCACHE_MAX_LOCAL_BYTES": "10G"}, remote="s3://ci-kernels/cuda13")
    >>> values.max_local_bytes, values.sources()["remote"], values.sources()["local_dir"]
    (10000000000, 'argument', 'default')

    Each setting is an attribute (``values.max_local_bytes``). ``ConfigValues(**values)``
    checks keyword values like the cache's constructor (unknown name: ``TypeError``; bad
    value: ``TypeError``/``ValueError`` naming it). ``local_dir=None`` means cuda-core's
    default directory; ``remote_timeout=None`` the remote tier's default;
    ``max_*_bytes=None`` no limit.
    """

    def __init__(self, **values: Any) -> None:
        checked = settings.check(values)
        self._init(checked, dict.fromkeys(checked, "argument"))

    @classmethod
    def from_env(cls: type[_Self], environ: Mapping[str, str] | None = None, **overrides: Any) -> _Self:
        """Read ``TIERED_PROGCACHE_*`` from ``environ`` (default ``os.environ``); ``overrides`` win."""
        if environ is None:
            environ = os.environ
        values = settings.check(overrides)
        sources = dict.fromkeys(values, "argument")
        for setting in settings.SETTINGS:
            variable = setting.variable
            if setting.name in values or variable is None or not environ.get(variable, "").strip():
                continue
            try:
                values[setting.name] = setting.parse_text(environ[variable])
            except ValueError as exc:
                raise ValueError(f"{variable}: {exc}") from None
            sources[setting.name] = f"env {variable}"
        path, from_file = read_config_file(environ)  # below the environment, above the defaults
        for name, (_, value) in from_file.items():
            if name not in values:
                values[name] = value
                sources[name] = f"file {path}"
        config = cls.__new__(cls)
        config._init(values, sources)
        return config

    def _init(self, given: dict[str, Any], sources: dict[str, str]) -> None:
        both = [name for name in ("signing_key", "signing_key_file") if given.get(name) is not None]
        if len(both) == 2:
            where = " and ".join(_where(name, sources.get(name, "default")) for name in both)
            raise ValueError(f"{where}: give the signing key or its file, not both")
        values = {setting.name: given.get(setting.name, setting.default) for setting in settings.SETTINGS}
        for setting in settings.SETTINGS:
            if setting.unused and values[setting.name] != setting.default:
                _warn_unused(setting, sources[setting.name])  # (a value not the default was given: it has one)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_sources", sources)
        # Plain attributes, so that a read on a hot path (compile()'s defaults) costs what any attribute
        # read costs; __getattr__ is then only asked for a name that is no setting.
        self.__dict__.update(values)

    # -- reading ------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            try:
                return self._values[name]
            except KeyError:
                pass
        raise AttributeError(f"{type(self).__name__!r} has no setting {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; make a new one with CacheConfig(**values)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._values})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConfigValues):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # type: ignore[assignment]  # holds a dict (remote_options)

    def __repr__(self) -> str:
        """Every storage option's value masked (a repr ends up in logs nobody reviews), secrets and URL passwords too."""
        shown = self.masked()
        if self.remote_options is not None:
            shown["remote_options"] = dict.fromkeys(self.remote_options, MASK)
        return "{}({})".format(type(self).__name__, ", ".join(f"{name}={value!r}" for name, value in shown.items()))

    def as_dict(self) -> dict[str, Any]:
        """Setting name -> value, in the table's order (secrets included: do not log this)."""
        return dict(self._values)

    def chain_wide(self) -> dict[str, Any]:
        """The settings that do not shape the default chain (they apply with ``tiers=[...]`` too), name -> value."""
        table = settings.by_name()
        return {name: value for name, value in self._values.items() if not table[name].builds_tiers}

    def masked(self) -> dict[str, Any]:
        """Setting name -> value safe to print: secret settings, secret options (nested) and URL passwords masked."""
        table = settings.by_name()
        return {
            name: MASK if table[name].secret and value is not None else masked(value)
            for name, value in self._values.items()
        }

    def sources(self) -> dict[str, str]:
        """Setting name -> ``"default"``, ``"env TIERED_PROGCACHE_X"``, ``"file PATH"`` (the config file) or ``"argument"``."""
        return {name: self._sources.get(name, "default") for name in self._values}

    def read_signing_key(self, *, warn: bool = True) -> bytes | str | None:
        """``signing_key``, or ``signing_key_file`` read by :func:`read_key_file`; None if neither.

        A problem with the file (missing, a directory, empty, unreadable) is a ``ValueError``
        naming where its path came from and the fix; a file that group or others can read is
        warned about (``warn``: the command checks the file up front without the warning).
        """
        if self.signing_key is not None:
            return self.signing_key
        path = self.signing_key_file
        if path is None:
            return None
        where = _where("signing_key_file", self.sources()["signing_key_file"])
        fix = f"write the key into it (openssl rand -hex 32 > {path}) or point {where} at the key file"
        try:
            if path.is_dir():
                raise ValueError(f"the signing key file {path} is a directory; {fix}")
            key = read_key_file(path)
            mode = path.stat().st_mode
        except OSError as exc:
            raise ValueError(f"{where}: cannot read the signing key file: {exc}; {fix}") from None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}" + ("" if "is a directory" in str(exc) else f"; {fix}")) from None
        if warn and mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                "signing key file %s is readable by others (mode %o); anyone who reads it can sign entries",
                path, stat.S_IMODE(mode),
            )  # fmt: skip
        return key


def _where(name: str, source: str) -> str:
    """How an error names a setting: by its variable if the value came from one, else by its name."""
    return source.removeprefix("env ") if source.startswith("env ") else name


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The signing key in the file at ``path``: its bytes less one trailing ``\\n`` or ``\\r\\n``.

    The one reader of key files: ``signing_key_file=``, ``TIERED_PROGCACHE_SIGNING_KEY_FILE``,
    ``--signing-key-file`` and ``signing_key=read_key_file(path)`` all go through it, so a
    CI job and a node reading one file sign alike. One line ending is dropped because
    ``openssl rand -hex 32 > f`` adds one; nothing else is stripped, because a binary key
    (``openssl rand 32 > f``) may begin or end with whitespace bytes. ``OSError`` if
    the file cannot be read, ``ValueError`` if it holds no key.
    """
    raw = Path(path).read_bytes()
    for ending in (b"\r\n", b"\n"):
        if raw.endswith(ending):
            raw = raw[: -len(ending)]
            break
    if not raw:
        raise ValueError(f"the signing key file {os.fspath(path)} is empty")
    return raw
