"""Writes to a local or NFS path that no reader can see half-done: stage, fsync, rename or link.

One place for the two primitives the package uses on POSIX paths: replace a file
atomically (stage in a private directory on the same filesystem, then ``os.replace``)
and create a file only if absent (stage, then ``link(2)``, atomic on NFS too).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

__all__ = ["create_exclusive", "write_atomic"]


def _stage(directory: str | os.PathLike[str], data: bytes, *, fsync: bool) -> str:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix="stage-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    return staged


def write_atomic(
    target: str | os.PathLike[str], data: bytes, *, staging_dir: str | os.PathLike[str], fsync: bool = True
) -> None:
    """Make ``target`` hold ``data``: readers see the old file or the whole new one, never part.

    ``staging_dir`` must be on the same filesystem as ``target`` (a rename cannot cross one).
    """
    os.makedirs(os.path.dirname(os.fspath(target)), exist_ok=True)
    staged = _stage(staging_dir, data, fsync=fsync)
    try:
        os.replace(staged, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise


def create_exclusive(
    target: str | os.PathLike[str], data: bytes, *, staging_dir: str | os.PathLike[str] | None = None
) -> bool:
    """Create ``target`` holding ``data`` only if absent; False if it exists. Atomic, NFS included.

    Stages the whole file, then ``link(2)``s it into place, so the file appears complete
    or not at all. Where hard links are unsupported, falls back to ``O_EXCL`` and a
    write (a reader may then briefly see it empty).
    """
    target = os.fspath(target)
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    staged = _stage(staging_dir if staging_dir is not None else directory, data, fsync=False)
    try:
        try:
            os.link(staged, target)
        except FileExistsError:
            return False
        except OSError:
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staged)
