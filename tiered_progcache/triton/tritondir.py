"""Triton's cache directory (``TRITON_CACHE_DIR``) seen as an :class:`~tiered_progcache.stores.store.EntryStore`.

So that every bulk operation (``ls``, ``stats``, ``warm``, ``push``, ``verify``,
``prune``, ``export``, ``import``) works on Triton's files with the code it uses for
the program cache. The directory is Triton's own layout, ``<dir>/<key>/<file>`` with
``__grp__<file>`` group indexes; each file is one entry, named and framed as in the
shared stores' ``triton`` namespace (:mod:`tiered_progcache.triton.tritonnames`), so a
listing here and one of ``<url>/triton/`` show the same names.

A group index reads as a group record (its members' digests, from the files here) and
a group record written here becomes Triton's index with this directory's paths, but
only once every member is here with the bytes the record lists: a ``warm`` that lands
the record before its members keeps it aside (``<key>/.tiered-progcache-pending/``) and
writes the index when the last member lands. Triton never sees a partial group.

Threads and processes: files are staged in ``<key>/tmp.tpc_<uuid>`` and renamed into
place, as Triton's ``FileCacheManager`` does, so readers see whole files or none.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import EntryRejected
from ..stores.store import STALE_STAGED_AGE_S, IndexedDirStore
from .tritonnames import TritonFile, frame, group_record, name_of, read_group_record, unframe

__all__ = ["TritonDir", "default_triton_dir"]

_PENDING = ".tiered-progcache-pending"
#: Tries to stage a file whose directory another writer may remove meanwhile (an emptied pending directory).
_STAGE_ATTEMPTS = 3
_STAGED_PREFIXES = ("tmp.pid_", "tmp.tpc_")


def default_triton_dir() -> Path:
    """Where Triton keeps its cache: ``TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache`` (``~`` by default)."""
    given = os.environ.get("TRITON_CACHE_DIR")
    if given:
        return Path(given)
    return Path(os.environ.get("TRITON_HOME") or os.path.expanduser("~")) / ".triton" / "cache"


class TritonDir(IndexedDirStore):
    """Triton's cache directory by entry name (see the module docstring).

    >>> transfer.warm(remote_triton_namespace, TritonDir(default_triton_dir()))

    Safe from many threads and processes (stage and rename); a file's place is its
    :class:`TritonFile` (key and file).
    """

    _FORMAT = "Triton"

    @property
    def namespace(self) -> str:
        return "triton"

    # -- listing ----------------------------------------------------------------------

    def _files(self) -> Iterator[tuple[TritonFile, os.DirEntry[str]]]:
        """Every Triton file here (group indexes included; staging and pending files not)."""
        for key_dir in self._sorted_dir(self.root):
            if not key_dir.is_dir(follow_symlinks=False):
                continue
            for item in self._sorted_dir(key_dir.path):
                which = _which(key_dir.name, item.name)
                if which is not None:
                    yield which, item

    def _entry_name(self, place: TritonFile) -> str:
        return name_of(place.key, place.file)

    def _path(self, place: TritonFile) -> Path:
        return self.root / place.key / place.file

    def _unframe(self, payload: bytes) -> tuple[TritonFile, bytes] | None:
        return unframe(payload)

    def file_of(self, name: str) -> tuple[str, str] | None:
        """(Triton key, file) of ``name`` as the last listing found it, else None."""
        which = self._index.get(name)
        return None if which is None else (which.key, which.file)

    # -- reads ------------------------------------------------------------------------

    def read_entry(self, name: str) -> bytes:
        """The framed payload of the file named ``name`` (a group index: its group record)."""
        which, data = self._read_file(name)
        if which.is_group:
            data = group_record(which.key, which.file, self._members_of(which, data))
        return frame(which.key, which.file, data)

    def _members_of(self, group: TritonFile, index: bytes) -> dict[str, bytes]:
        """Member file -> bytes of Triton's group index ``index``; ``EntryRejected`` if one is not here."""
        try:
            children = json.loads(index)["child_paths"]
        except (ValueError, KeyError, TypeError):
            raise EntryRejected(f"{group.file} of {group.key} is not a Triton group index") from None
        members = {}
        for child in children if isinstance(children, (dict, list)) else ():
            path = self.root / group.key / child
            try:
                members[child] = self._read_capped(path)
            except OSError:
                raise EntryRejected(f"group {group.file} of {group.key}: member {child} is not here") from None
        if not members:
            raise EntryRejected(f"group {group.file} of {group.key} lists no members")
        return members

    # -- writes -----------------------------------------------------------------------

    def write_entry(self, name: str, payload: bytes) -> None:
        """Land a framed payload as Triton's file (a group record: as Triton's index, once its members are here)."""
        which, data = self._landing(name, payload)
        if which.is_group:
            read_group_record(data, which.key, which.file)
            self._stage(self.root / which.key / _PENDING / which.file, data)
        else:
            self._stage(self.root / which.key / which.file, data)
        self._index[name] = which
        self._complete_groups(which.key)

    def sweep_staged(self, older_than: float = STALE_STAGED_AGE_S, *, now: float | None = None) -> int:
        """Remove staging directories (Triton's ``tmp.pid_*``, ours) left over ``older_than`` seconds ago; the count."""
        cutoff = (time.time() if now is None else now) - older_than
        removed = 0
        for staged in self.root.glob("*/tmp.*"):
            if staged.name.startswith(_STAGED_PREFIXES) and staged.lstat().st_mtime < cutoff:
                shutil.rmtree(staged, ignore_errors=True) if staged.is_dir() else staged.unlink(missing_ok=True)
                removed += 1
        return removed

    # -- internals ----------------------------------------------------------------------

    def _stage(self, path: Path, data: bytes) -> None:
        """Write ``path`` whole (staged beside it, renamed over it).

        Another writer that completes a group removes the pending directory once it is empty,
        possibly between our mkdir and our write (warm lands files from several threads, and
        processes may share the directory): a directory gone under us is made again.
        """
        for attempt in range(_STAGE_ATTEMPTS):
            path.parent.mkdir(parents=True, exist_ok=True)
            staged = path.parent / f"tmp.tpc_{uuid.uuid4().hex}"
            try:
                staged.write_bytes(data)
                os.replace(staged, path)
            except FileNotFoundError:
                with contextlib.suppress(OSError):
                    staged.unlink()
                if attempt == _STAGE_ATTEMPTS - 1:
                    raise
                continue
            except BaseException:
                with contextlib.suppress(OSError):
                    staged.unlink()
                raise
            return

    def _complete_groups(self, key: str) -> None:
        """Write Triton's index for each pending group record of ``key`` whose members are all here and match."""
        pending = self.root / key / _PENDING
        try:
            records = list(pending.iterdir())
        except FileNotFoundError:
            return
        for record_path in records:
            try:
                digests = read_group_record(record_path.read_bytes(), key, record_path.name)
            except (OSError, EntryRejected):
                continue
            paths = {}
            for member, digest in digests.items():
                path = self.root / key / member
                try:
                    whole = hashlib.sha256(path.read_bytes()).hexdigest() == digest
                except OSError:
                    whole = False
                if not whole:
                    break
                paths[member] = str(path)
            else:
                self._stage(self.root / key / record_path.name, json.dumps({"child_paths": paths}).encode())
                with contextlib.suppress(OSError):
                    record_path.unlink()
        with contextlib.suppress(OSError):
            pending.rmdir()  # once empty: Triton's directory as Triton leaves it


def _which(key: str, file: str) -> TritonFile | None:
    """The Triton file at ``<key>/<file>``, or None for Triton's lock, a staged file, a dot file or a bad name."""
    if file == "lock" or file.startswith(".") or file.startswith(_STAGED_PREFIXES) or key.startswith("."):
        return None
    try:
        return TritonFile(key, file)
    except (TypeError, ValueError):
        return None

