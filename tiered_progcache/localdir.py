"""Name-addressed access to a cuda-core ``FileStreamProgramCache`` directory.

cuda-core's file tier is addressed by key; bulk work (warm a node from the remote,
push, list, prune, verify) sees entry *names* (``sha256(key)``) instead, since that
is all a directory listing or a bucket listing gives. This module reads and writes
the same layout (``<root>/entries/<2 hex>/<62 hex>``, staged in ``<root>/tmp`` and
renamed into place) so both views stay one cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cuda.core.utils import FileStreamProgramCache

__all__ = ["LocalDir", "LocalEntry", "default_local_dir", "entry_name"]

_ENTRIES = "entries"
_TMP = "tmp"


def entry_name(key: bytes | str) -> str:
    """The 64-hex name cuda-core's file tier (and our remote tier) stores ``key`` under."""
    if isinstance(key, str):
        key = key.encode("utf-8")
    return hashlib.sha256(key, usedforsecurity=False).hexdigest()


def default_local_dir() -> Path:
    """cuda-core's default program-cache directory, so an existing cuda-core cache keeps working.

    Uses cuda-core's own rule when it is importable (it is private API); otherwise the
    same place by platformdirs (``<user cache>/cuda-python/program-cache``).
    """
    try:
        from cuda.core.utils._program_cache._file_stream import _default_cache_dir

        return Path(_default_cache_dir())
    except ImportError:  # pragma: no cover - a future cuda-core that moved it
        import platformdirs

        return platformdirs.user_cache_path("cuda-python", appauthor=False) / "program-cache"


def _is_entry_name(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


@dataclasses.dataclass(frozen=True)
class LocalEntry:
    name: str
    path: Path
    size: int
    mtime: float
    atime: float


class LocalDir:
    """A cache directory seen by entry name. Safe across threads and processes like cuda-core's tier."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @classmethod
    def of(cls, cache: FileStreamProgramCache) -> LocalDir:
        return cls(cache._root)  # cuda-core keeps the root only privately

    def path_for(self, name: str) -> Path:
        if not _is_entry_name(name):
            raise ValueError(f"not an entry name (64 lowercase hex digits): {name!r}")
        return self.root / _ENTRIES / name[:2] / name[2:]

    def iter_entries(self) -> Iterator[LocalEntry]:
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
                if not _is_entry_name(name) or not item.is_file(follow_symlinks=False):
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield LocalEntry(name, Path(item.path), st.st_size, st.st_mtime, st.st_atime)

    def names(self) -> set[str]:
        return {entry.name for entry in self.iter_entries()}

    def read(self, name: str) -> bytes | None:
        try:
            return self.path_for(name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        """Atomically place ``data`` under ``name``: stage in tmp/, fsync, rename (as cuda-core does)."""
        target = self.path_for(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = self.root / _TMP
        tmp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp_name = tempfile.mkstemp(prefix="entry-", dir=tmp_dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp_name, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise

    def delete(self, entry: LocalEntry) -> bool:
        """Unlink ``entry`` unless a writer replaced it since it was listed (cuda-core's stat guard)."""
        try:
            st = entry.path.stat()
        except FileNotFoundError:
            return False
        if st.st_size != entry.size or st.st_mtime != entry.mtime:
            return False
        try:
            entry.path.unlink()
        except FileNotFoundError:
            return False
        return True
