"""A cuda-core ``FileStreamProgramCache`` directory seen as an :class:`~tiered_progcache.stores.store.EntryStore`.

cuda-core's file tier is addressed by key; bulk work (warm a node from the remote,
push, list, prune, verify) sees entry *names* (``sha256(key)``) instead, since that
is all a directory listing gives. This module reads and writes the same layout
(``<root>/entries/<2 hex>/<62 hex>``, staged in ``<root>/tmp`` and renamed into
place) so both views stay one cache.

It also holds the chain's hot read of a local hit (:meth:`LocalDir.read_key`): the
same file and the same LRU bookkeeping as cuda-core's ``FileStreamProgramCache[key]``,
in five system calls on one descriptor instead of about ten through ``pathlib``
(a disk hit through the chain also pays a memory miss and a promotion, which only
fit in 1.1x of cuda-core's own read if the read itself is cheaper).
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from cuda.core.utils import FileStreamProgramCache

from .. import _cudacore
from . import fsutil
from .codeobject import check_code_object
from .envelope import MAX_ENTRY_BYTES
from ..errors import EntryRejected
from .store import STALE_STAGED_AGE_S, NodeDirStore, StoredEntry, check_entry_name, entry_name, is_entry_name

# ``entry_name`` is re-exported for modules not yet moved to ``store.entry_name``.
__all__ = ["KEYED_READS", "LocalDir", "default_local_dir", "entry_name"]

_ENTRIES = "entries"
_TMP = "tmp"
_LOCKS = "locks"
_HEADER_SCANS = "header-scans"

#: Whether :meth:`LocalDir.read_key` can mark an entry used through its descriptor
#: (``utime`` on a file descriptor: Linux, macOS). Elsewhere the chain reads through cuda-core.
KEYED_READS = os.utime in os.supports_fd


def _read_rest(fd: int, head: bytes, cap: int) -> bytes:
    """``head`` plus the rest of the file up to end of file; ``EntryRejected`` past ``cap`` bytes."""
    chunks = [head]
    total = len(head)
    while total <= cap:
        chunk = os.read(fd, cap + 1 - total)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
    raise EntryRejected(f"over the {cap}-byte entry limit")


def _remove_if_unchanged(path: str, opened: os.stat_result) -> bool:
    """Unlink ``path`` if it is still the file ``opened`` describes (an entry a writer replaced since is kept)."""
    try:
        if _cudacore.stat_identity(os.stat(path, follow_symlinks=False)) != _cudacore.stat_identity(opened):
            return False
        os.unlink(path)
    except OSError:  # gone already, or a read-only directory: the next write replaces it
        return False
    return True


def default_local_dir() -> Path:
    """cuda-core's default program-cache directory, so an existing cuda-core cache keeps working."""
    return _cudacore.default_cache_dir()


class LocalDir(NodeDirStore):
    """A cache directory seen by entry name. Safe across threads and processes like cuda-core's tier.

    >>> local = LocalDir.of(FileStreamProgramCache("/var/cache/kernels"))
    >>> [entry.name for entry in local.iter_entries()]

    Entries hold raw payloads (no envelope); writes stage in ``tmp/`` and rename, so a
    reader sees a whole file or none. Deletes after a listing use cuda-core's own guard
    (inode, size, mtime_ns), so an entry a writer replaced since is never removed.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        cache: FileStreamProgramCache | None = None,
    ) -> None:
        """``cache``: cuda-core's tier on ``root`` (:meth:`of`), which then does the keyed writes, deletes,
        counts and clears, so its size cap evicts as it does for cuda-core; keyed reads stay :meth:`read_key`'s
        unless ``cache`` is a subclass that reads differently (or the platform lacks :data:`KEYED_READS`)."""
        super().__init__(root, max_entry_bytes=max_entry_bytes)
        self.cache = cache
        if cache is not None and not (KEYED_READS and type(cache).__getitem__ is FileStreamProgramCache.__getitem__):
            self.read_key = cache.__getitem__  # type: ignore[method-assign]
        elif not KEYED_READS:
            self.read_key = self._read_key_by_name  # type: ignore[method-assign]
        self._entries_prefix = os.path.join(os.fspath(root), _ENTRIES) + os.sep
        #: Where the node-level single-flight lock files live (``<root>/locks``).
        self.locks_dir = self.root / _LOCKS
        #: Where ``compile()`` persists header scans for the next process (see ``scanmemo``).
        self.header_scans_dir = os.path.join(os.fspath(root), _HEADER_SCANS)

    @classmethod
    def of(cls, cache: FileStreamProgramCache) -> LocalDir:
        """The directory a cuda-core ``FileStreamProgramCache`` was opened on, its keyed writes through ``cache``."""
        return cls(_cudacore.file_cache_root(cache), cache=cache)

    # -- what the store is ------------------------------------------------------------

    @property
    def atomic_create(self) -> bool:
        return True  # stage, then link(2): atomic on local disks and NFS

    def path_for(self, name: str) -> Path:
        """The file entry ``name`` lives in (``ValueError`` unless ``name`` is an entry name)."""
        check_entry_name(name)
        return self.root / _ENTRIES / name[:2] / name[2:]

    # -- entries ----------------------------------------------------------------------

    def ensure_layout(self) -> None:
        """Create the root and ``entries/`` (never world-writable) and ``tmp/`` (``0o700``), whatever the umask.

        Call before cuda-core's ``FileStreamProgramCache`` creates them with default modes.
        ``PermissionError`` if ``entries/`` or ``tmp/`` is a symbolic link.
        """
        fsutil.make_dirs(self.root)
        fsutil.make_dirs(self.root / _ENTRIES, below=self.root)
        fsutil.make_dirs(self.root / _TMP, fsutil.STAGING_DIR_MODE, below=self.root)

    def read_entry(self, name: str) -> bytes:
        """The file's bytes; ``EntryRejected`` for a symbolic link (file or shard), a non-file, or one over the cap.

        Not a lookup (those are :meth:`read_key`'s): what ``stats``, ``ls``, ``verify``, ``push`` and
        ``export`` read leaves the file's access time alone, so looking at a directory never keeps its
        entries from ``prune`` or the size cap's eviction."""
        path = self.path_for(name)
        for directory in (path.parent.parent, path.parent):
            try:
                if stat.S_ISLNK(os.lstat(directory).st_mode):
                    raise EntryRejected(f"{directory} is a symbolic link; not read through")
            except FileNotFoundError:
                raise KeyError(name) from None
        try:
            fd, _ = fsutil.open_regular(path, self._max_entry_bytes, keep_atime=True)
        except FileNotFoundError:
            raise KeyError(name) from None
        with open(fd, "rb") as fh:
            data = fh.read(self._max_entry_bytes + 1)  # a file growing since the fstat stops at the cap
        if len(data) > self._max_entry_bytes:
            raise EntryRejected(f"over the {self._max_entry_bytes}-byte entry limit")
        return data

    def read_key(self, key: bytes) -> bytes:
        """The entry cuda-core keeps under cache key ``key`` (bytes), read as a lookup: ``KeyError`` on a miss.

        What ``FileStreamProgramCache[key]`` returns, and the same LRU effect: the file's
        atime is set to now and its mtime kept, on the inode that was read (cuda-core
        re-opens the path and compares ``(ino, size, mtime_ns)`` first; one descriptor
        gives that guarantee by construction). A symbolic link, a non-file or a file
        over ``max_entry_bytes`` is ``EntryRejected`` (cuda-core would follow the link).
        A read-only directory still reads; its atime is then left alone, as cuda-core does.
        A code object that fails :func:`~tiered_progcache.stores.codeobject.check_code_object`
        (a truncated cubin or fatbin, cut-short PTX or JSON) is ``EntryRejected`` and its
        file removed, unless a writer replaced it since it was opened (cuda-core's stat
        guard); bytes of no format known there pass. Only on platforms with :data:`KEYED_READS`.
        """
        digest = hashlib.sha256(key, usedforsecurity=False).hexdigest()
        path = self._entries_prefix + digest[:2] + os.sep + digest[2:]
        try:
            fd, st = fsutil.open_regular(path, self._max_entry_bytes)
        except (FileNotFoundError, NotADirectoryError):
            raise KeyError(key) from None
        try:
            size = st.st_size
            data = os.read(fd, size + 1)
            if len(data) != size:  # a short read (signal, odd filesystem) or a file growing since the fstat
                data = _read_rest(fd, data, self._max_entry_bytes)
            problem = check_code_object(data, unknown_ok=True)
            if problem is not None:
                removed = _remove_if_unchanged(path, st)
                raise EntryRejected(f"{problem}{'; removed' if removed else ''}")
            try:
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
            except OSError:
                pass  # read-only mount or someone else's file: eviction degrades toward FIFO, as in cuda-core
            return data
        finally:
            os.close(fd)

    def _read_key_by_name(self, key: bytes) -> bytes:
        return self.read_entry(entry_name(key))

    def write_key(self, key: bytes, payload: bytes) -> None:
        if self.cache is None:
            self.write_entry(entry_name(key), payload)
        else:
            self.cache[key] = payload

    def delete_key(self, key: bytes) -> None:
        if self.cache is None:
            self.delete_entry(entry_name(key))
        else:
            del self.cache[key]

    def count(self) -> int:
        return super().count() if self.cache is None else len(self.cache)

    def clear(self) -> None:
        if self.cache is None:
            super().clear()
        else:
            self.cache.clear()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def touch_key(self, key: bytes) -> None:
        """Set the atime of cache key ``key``'s file to now, its mtime kept: read-recency for a hit served in memory.

        Nothing where the file is gone or cannot be touched (a read-only mount). Only on
        platforms with :data:`KEYED_READS`.
        """
        digest = hashlib.sha256(key, usedforsecurity=False).hexdigest()
        path = self._entries_prefix + digest[:2] + os.sep + digest[2:]
        try:
            st = os.stat(path, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                os.utime(path, ns=(time.time_ns(), st.st_mtime_ns), follow_symlinks=False)
        except OSError:
            pass

    def write_entry(self, name: str, payload: bytes) -> None:
        """Atomically place ``payload`` under ``name``: stage in tmp/, fsync, rename (as cuda-core does).

        ``PermissionError`` if a directory on the way (``entries/``, the shard, ``tmp/``) is a symbolic link.
        """
        path = self._writable_path(name)
        fsutil.write_atomic(path, payload, staging_dir=self.root / _TMP)

    def create_entry(self, name: str, payload: bytes) -> bool:
        path = self._writable_path(name)
        return fsutil.create_exclusive(path, payload, staging_dir=self.root / _TMP)

    def _writable_path(self, name: str) -> Path:
        path = self.path_for(name)
        fsutil.make_dirs(path.parent, below=self.root)
        fsutil.make_dirs(self.root / _TMP, fsutil.STAGING_DIR_MODE, below=self.root)
        return path

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
        # A hand-made entry without a version is never deleted here: only what a listing saw.
        return entry.version is not None and self._unlink_if_listed_as(self.path_for(entry.name), entry.version)

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
