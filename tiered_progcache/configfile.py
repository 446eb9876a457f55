"""The config file: settings kept for every process of a user, as ``ccache.conf`` keeps ccache's.

``tiered-progcache config --set max_local_bytes=10G`` writes it; ``from_env`` (and so the
command and the process-wide default cache) reads it below the environment: argument or
flag > variable > file > default. Its path is ``TIERED_PROGCACHE_CONFIG`` if set, else
``$XDG_CONFIG_HOME/tiered-progcache/config`` (``~/.config/...``). One ``name = value`` a line
(``#`` comments, blank lines), values in the text a variable takes (``10G``, ``true``,
``s3://bucket/prefix``), each checked by its row of the settings table. The path comes
from the environment passed to ``from_env`` only, so ``from_env({})`` reads no file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from . import settings

__all__ = ["CONFIG_ENV", "config_path", "read_config_file", "write_config_file"]

#: The variable naming the config file (not a setting: it says where settings are).
CONFIG_ENV = settings.ENV_PREFIX + "CONFIG"

_HEADER = "# tiered-progcache settings (tiered-progcache config --set NAME=VALUE / --unset NAME); see docs/configuration.md\n"


def config_path(environ: Mapping[str, str]) -> tuple[Path | None, bool]:
    """``(path, explicit)``: the config file ``environ`` names (explicit: by :data:`CONFIG_ENV`), or None."""
    given = environ.get(CONFIG_ENV, "").strip()
    if given:
        return Path(os.path.expanduser(given)), True
    base = environ.get("XDG_CONFIG_HOME", "").strip()
    if not base:
        home = environ.get("HOME", "").strip()
        if not home:
            return None, False
        base = os.path.join(home, ".config")
    return Path(base) / "tiered-progcache" / "config", False


def settable(name: str) -> settings.Setting:
    """The row of a setting the file may hold; ``ValueError`` naming the known ones otherwise."""
    table = settings.by_name()
    row = table.get(name)
    if row is None:
        raise ValueError(f"unknown setting {name!r}; known: {', '.join(n for n in table if table[n].kind.name != 'key')}")
    if row.kind.name == "key":
        raise ValueError("has no text form: put the key in a file and set signing_key_file instead")
    return row


def parse_lines(text: str, where: str, *, fixing: Collection[str] = ()) -> dict[str, tuple[str, Any]]:
    """Setting name -> (its text, its checked value) from a file's text; ``ValueError`` naming ``where:line``.

    A bad line of a setting in ``fixing`` (being set or unset) is left out instead, so the
    command can repair the file it names.
    """
    out: dict[str, tuple[str, Any]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, eq, value = stripped.partition("=")
        name, value = name.strip(), value.strip()
        try:
            if not eq:
                raise ValueError(f"not NAME = VALUE: {stripped[:40]!r}")
            row = settable(name)
            out[name] = (value, row.parse_text(value))
        except (TypeError, ValueError) as exc:
            if name in fixing:
                continue
            prefix = f"{name}: " if eq and name in settings.by_name() else ""
            raise ValueError(f"{where}:{number}: {prefix}{exc} (fix it with tiered-progcache config --set or --unset)") from None
    return out


def read_config_file(environ: Mapping[str, str]) -> tuple[Path | None, dict[str, tuple[str, Any]]]:
    """The config file's path and settings (name -> (text, value)); no file is no settings.

    A file named by :data:`CONFIG_ENV` that does not exist is an error (a typo in the
    path must not go unnoticed); the default path may be absent.
    """
    path, explicit = config_path(environ)
    if path is None:
        return None, {}
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise ValueError(f"{CONFIG_ENV}: no file {path} (create it with tiered-progcache config --set "
                             "NAME=VALUE, or unset the variable)") from None  # fmt: skip
        return path, {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the config file {path}: {exc}") from None
    return path, parse_lines(text, str(path))


def write_config_file(path: Path, values: Mapping[str, str]) -> None:
    """Write ``values`` (name -> text) to ``path`` whole (staged beside it, renamed), mode 0600: it may hold a URL password."""
    body = _HEADER + "".join(f"{name} = {text}\n" for name, text in values.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
        raise
