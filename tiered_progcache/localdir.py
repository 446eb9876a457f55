"""A cuda-core ``FileStreamProgramCache`` directory seen as an :class:`~tiered_progcache.store.EntryStore`.

cuda-core's file tier is addressed by key; bulk work (warm a node from the remote,
push, list, prune, verify) sees entry *names* (``sha256(key)``) instead, since that
is all a directory listing gives. This module reads and writes the same layout
(``<root>/entries/<2 hex>/<62 hex>``, staged in ``<root>/tmp`` and renamed into
place) so both views stay one cache.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from cuda.core.utils import FileStreamProgramCache

from . import _cudacore, fsutil
from .codeobject import check_code_object
from .envelope import MAX_ENTRY_BYTES
from .errors import EntryRejected
from .store import STALE_STAGED_AGE_S, EntryStore, StoredEntry, check_entry_name, entry_name, is_entry_name

# ``entry_name`` is re-exported for modules not yet moved to ``store.entry_name``.
__all__ = ["LocalDir", "default_local_dir", "entry_name"]

_ENTRIES = "entries"
_TMP = "tmp"
_LOCKS = "locks"


def default_local_dir() -> Path:
    """cuda-core's default program-cache directory, so an existing cuda-core cache keeps working."""
    return _cudacore.default_cache_dir()


class LocalDir(EntryStore):
    """A cache directory seen by entry name. Safe across threads and processes like cuda-core's tier.

    >>> local = LocalDir.of(FileStreamProgramCache("/var/cache/kernels"))
    >>> [entry.name for entry in local.iter_entries()]

    Entries hold raw payloads (no envelope); writes stage in ``tmp/`` and rename, so a
    reader sees a whole file or none. Deletes after a listing use cuda-core's own guard
    (inode, size, mtime_ns), so an entry a writer replaced since is never removed.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_entry_bytes: int = MAX_ENTRY_BYTES) -> None:
        self.root = Path(root)
        #: Where the node-level single-flight lock files live (``<root>/locks``).
        self.locks_dir = self.root / _LOCKS
        self._max_entry_bytes = max_entry_bytes

    @classmethod
    def of(cls, cache: FileStreamProgramCache) -> LocalDir:
        """The directory a cuda-core ``FileStreamProgramCache`` was opened on."""
        return cls(_cudacore.file_cache_root(cache))

    def __repr__(self) -> str:
        return f"LocalDir({str(self.root)!r})"

    # -- what the store is ------------------------------------------------------------

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def read_only(self) -> bool:
        return False

    @property
    def shared(self) -> bool:
        return False

    @property
    def atomic_create(self) -> bool:
        return True  # stage, then link(2): atomic on local disks and NFS

    @property
    def max_entry_bytes(self) -> int:
        return self._max_entry_bytes

    def path_for(self, name: str) -> Path:
        """The file entry ``name`` lives in (``ValueError`` unless ``name`` is an entry name)."""
        check_entry_name(name)
        return self.root / _ENTRIES / name[:2] / name[2:]

    # -- entries ----------------------------------------------------------------------

    def read_entry(self, name: str) -> bytes:
        path = self.path_for(name)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size > self._max_entry_bytes:
                    raise EntryRejected(f"{size} bytes, over the {self._max_entry_bytes}-byte entry limit")
                return fh.read()
        except FileNotFoundError:
            raise KeyError(name) from None

    def write_entry(self, name: str, payload: bytes) -> None:
        """Atomically place ``payload`` under ``name``: stage in tmp/, fsync, rename (as cuda-core does)."""
        fsutil.write_atomic(self.path_for(name), payload, staging_dir=self.root / _TMP)

    def create_entry(self, name: str, payload: bytes) -> bool:
        return fsutil.create_exclusive(self.path_for(name), payload, staging_dir=self.root / _TMP)

    def delete_entry(self, name: str) -> None:
        try:
            os.unlink(self.path_for(name))
        except FileNotFoundError:
            raise KeyError(name) from None

    def iter_entries(self) -> Iterator[StoredEntry]:
        entries = self.root / _ENTRIES
        try:
            subdirs = sorted(os.scandir(entries), key=lambda d: d.name)
        except FileNotFoundError:
            return
        for sub in subdirs:
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            try:
                files = list(os.scandir(sub.path))
            except FileNotFoundError:
                continue
            for item in files:
                name = sub.name + item.name
                if not is_entry_name(name) or not item.is_file(follow_symlinks=False):
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield StoredEntry(name, st.st_size, st.st_mtime, st.st_atime, _cudacore.stat_identity(st))

    def delete_listed(self, entry: StoredEntry) -> bool:
        """Unlink ``entry`` unless a writer replaced it since it was listed (cuda-core's stat guard)."""
        path = self.path_for(entry.name)
        try:
            if _cudacore.stat_identity(os.stat(path, follow_symlinks=False)) != entry.version:
                return False
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def sweep_staged(self, older_than: float = STALE_STAGED_AGE_S, *, now: float | None = None) -> int:
        """Remove files in ``tmp/`` that writers (ours or cuda-core's) staged over ``older_than`` seconds ago.

        A writer killed between staging and rename leaves its file there. Runs only when
        called (``prune`` and ``clear`` do); a younger file may be a live write.
        """
        cutoff = (time.time() if now is None else now) - older_than
        removed = 0
        try:
            staged = list(os.scandir(self.root / _TMP))
        except FileNotFoundError:
            return 0
        for item in staged:
            try:
                st = item.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) or st.st_mtime >= cutoff:
                    continue
                os.unlink(item.path)
            except FileNotFoundError:
                continue
            removed += 1
        return removed

    def verify_entry(self, name: str) -> str | None:
        """None if the file is a whole code object, else why not (local entries carry no digest)."""
        try:
            return check_code_object(self.read_entry(name))
        except EntryRejected as exc:
            return str(exc.args[0]) if exc.args else "rejected"
        except KeyError:
            return "missing"
        except OSError as exc:
            return f"unreadable: {exc.strerror or exc}"
