"""CuPy's kernel-cache directory (``CUPY_CACHE_DIR``): its files read and written as CuPy does, and
the directory seen as an :class:`~tiered_progcache.stores.store.EntryStore` for the command.

The layout is CuPy's: one flat directory, one file per entry named as CuPy names it,
each file the SHA-1 hex of the payload and then the payload (``.cu`` sources beside
them when ``CUPY_CACHE_SAVE_CUDA_SOURCE`` is set). Writes go through a temporary file in
the directory and ``os.replace``, as CuPy's own, so readers see whole files or none.
As a store, each file is one entry, named and framed as in the shared stores' ``cupy``
namespace (:mod:`tiered_progcache.cupy.cupynames`), so a listing here and one of
``<url>/cupy/`` show the same names. Safe from many threads and processes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import EntryRejected
from ..stores.store import STALE_STAGED_AGE_S, IndexedDirStore
from .cupynames import check_name, decode_local, encode_local, frame, is_name, name_of, unframe

__all__ = ["CupyDir", "default_cupy_dir", "read_local", "write_local"]

#: Where CuPy keeps its cache when ``CUPY_CACHE_DIR`` is unset (``cupy.cuda._compiler_cache._default_cache_dir``).
DEFAULT_DIR = "~/.cupy/kernel_cache"
#: CuPy stages with ``tempfile.NamedTemporaryFile`` (``tmp*``); we do too, with this prefix.
_STAGED_PREFIX = "tmp"


def default_cupy_dir() -> Path:
    """Where CuPy keeps its kernel cache: ``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser(DEFAULT_DIR))


def read_local(directory: str | os.PathLike[str], name: str) -> bytes | None:
    """The payload of CuPy's file ``name`` in ``directory``, or None if absent, truncated or not matching its SHA-1."""
    try:
        with open(os.path.join(directory, check_name(name)), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    return decode_local(data)


def write_local(directory: str | os.PathLike[str], name: str, payload: bytes, source: str | None = None) -> None:
    """Write ``payload`` as CuPy's file ``name`` (SHA-1 hex, payload; staged then ``os.replace``d).

    ``source``: also written as ``<name>.cu`` (what CuPy does under ``CUPY_CACHE_SAVE_CUDA_SOURCE``).
    """
    path = os.path.join(directory, check_name(name))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=_STAGED_PREFIX, delete=False) as tf:
        staged = tf.name
        try:
            tf.write(encode_local(payload))
        except BaseException:
            tf.close()
            os.unlink(staged)
            raise
    try:
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    if source is not None:
        with open(path + ".cu", "w") as fh:
            fh.write(source)


class CupyDir(IndexedDirStore):
    """CuPy's kernel-cache directory by entry name (see the module docstring); a file's place is its name.

    >>> transfer.warm(remote_cupy_namespace, CupyDir(default_cupy_dir()))
    """

    _FORMAT = "CuPy"

    @property
    def namespace(self) -> str:
        return "cupy"

    def _files(self) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """CuPy's entry files (sources, staged files and anything else CuPy would not name, not)."""
        return ((item.name, item) for item in self._sorted_dir(self.root) if is_name(item.name))

    def _entry_name(self, place: str) -> str:
        return name_of(place)

    def _path(self, place: str) -> Path:
        return self.root / place

    def _unframe(self, payload: bytes) -> tuple[str, bytes] | None:
        return unframe(payload)

    def read_entry(self, name: str) -> bytes:
        """The framed payload of the file named ``name``; ``EntryRejected`` if it fails CuPy's own check."""
        file, data = self._read_file(name)
        payload = decode_local(data)
        if payload is None:
            raise EntryRejected(f"{file} does not match its SHA-1 (truncated or corrupt)")
        return frame(file, payload)

    def write_entry(self, name: str, payload: bytes) -> None:
        """Land a framed payload as CuPy's file."""
        file, data = self._landing(name, payload)
        write_local(self.root, file, data)
        self._index[name] = file

    def sweep_staged(self, older_than: float = STALE_STAGED_AGE_S, *, now: float | None = None) -> int:
        """Remove temporary files (CuPy's and ours, ``tmp*``) left over ``older_than`` seconds ago; the count."""
        cutoff = (time.time() if now is None else now) - older_than
        removed = 0
        for staged in self.root.glob(f"{_STAGED_PREFIX}*"):
            with contextlib.suppress(OSError):
                if staged.is_file() and staged.lstat().st_mtime < cutoff:
                    staged.unlink()
                    removed += 1
        return removed
