"""Writes to a local or NFS path that no reader can see half-done: stage, fsync, rename or link.

One place for the primitives the package uses on POSIX paths: replace a file
atomically (stage in a private directory on the same filesystem, then ``os.replace``),
create a file only if absent (stage, then ``link(2)``, atomic on NFS too), make
directories with explicit modes that never follow a planted symbolic link, and open a
file for reading only if it is a regular file within a byte cap (:func:`open_regular`).

Modes: staging directories are ``0o700`` (no one else can read or swap a file being
written); every other directory is created ``0o775`` less the umask, so never
world-writable even under ``umask 000``, while a group that shares a cache (cuda-core's
design) keeps group write under ``umask 002``. Existing directories are left as they are.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from typing import Callable

import cachetools

from ..errors import EntryRejected

__all__ = ["DIR_MODE", "LOCAL_FS_TYPES", "MOUNT_TABLE", "STAGING_DIR_MODE", "MountTable", "create_exclusive",
           "make_dirs", "on_local_disk", "open_regular", "write_atomic"]

#: Mode of the directories we create (before the umask; never world-writable).
DIR_MODE = 0o775
#: Mode of staging directories (``tmp/``).
STAGING_DIR_MODE = 0o700
#: Linux filesystem types that live on this host (a disk, memory, a container's layers): every change made on
#: this host raises a local inotify event there. Any other type (nfs, cifs, fuse.*, 9p, lustre...) is remote.
LOCAL_FS_TYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs"})
#: The mount table :func:`on_local_disk` reads (a test points it at a table of its own).
MOUNT_TABLE = "/proc/self/mountinfo"
_MAX_MEMO_PATHS = 200_000  # filesystem types remembered by path, the least recently used forgotten first

# Read-only, the last component never followed, non-blocking (a FIFO cannot hang the open;
# no effect on a regular file's reads), closed across exec.
_READ_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)
#: Linux's "this read is not a use": the access time is left as it was (0 where the platform has none).
_NOATIME = getattr(os, "O_NOATIME", 0)


def open_regular(
    path: str | os.PathLike[str],
    max_bytes: int | None = None,
    *,
    refuse: Callable[[str], BaseException] = EntryRejected,
    keep_atime: bool = False,
) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its ``fstat``, if it is a regular file of at most ``max_bytes``.

    The one safe open of a file that something else may have planted: a symbolic link
    (to ``/dev/zero``, or outside the tree) is not followed, a FIFO or device is refused
    without blocking, and a file stated over ``max_bytes`` is refused unread. Each
    refusal raises ``refuse(reason)`` (default :class:`~tiered_progcache.errors.EntryRejected`);
    a missing file raises ``FileNotFoundError`` as ``os.open`` does. The caller closes the
    descriptor; what it reads past the ``fstat`` is still its to bound (a file may grow).
    ``keep_atime``: reading it leaves its access time alone (``O_NOATIME``, where the platform has it
    and the file is this user's), so a read that is not a use does not count as one for eviction.
    """
    flags = _READ_FLAGS | (_NOATIME if keep_atime else 0)
    try:
        try:
            fd = os.open(path, flags)
        except PermissionError:
            if not flags & _NOATIME:
                raise
            fd = os.open(path, _READ_FLAGS)  # another user's file: O_NOATIME is its owner's to ask
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refuse("a symbolic link, not an entry (not followed)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse("not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise refuse(f"{st.st_size} bytes, over the {max_bytes}-byte limit")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def make_dirs(path: str | os.PathLike[str], mode: int = DIR_MODE, *, below: str | os.PathLike[str] | None = None) -> None:
    """Create ``path`` and its missing parents, each with ``mode`` (never world-writable, whatever the umask).

    With ``below``, every component of ``path`` under ``below`` that exists must be a real
    directory: a symbolic link there (a planted ``entries/ab -> /elsewhere``) raises
    ``PermissionError`` instead of being written through.
    """
    mode &= ~stat.S_IWOTH
    path = os.path.abspath(os.fspath(path))
    parts: list[str] = []
    head = path
    while True:
        parts.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    guard = os.path.abspath(os.fspath(below)) if below is not None else None
    for component in reversed(parts):
        checked = guard is not None and component != guard and component.startswith(guard.rstrip(os.sep) + os.sep)
        try:
            st = os.lstat(component)
        except FileNotFoundError:
            try:
                os.mkdir(component, mode)
            except FileExistsError:  # a racing creator
                st = os.lstat(component)
            else:
                continue
        if stat.S_ISLNK(st.st_mode) and checked:
            raise PermissionError(f"refusing to write through the symbolic link {component}")


def _stage(directory: str | os.PathLike[str], data: bytes, *, fsync: bool, mode: int | None = None) -> str:
    make_dirs(directory, STAGING_DIR_MODE)
    fd, staged = tempfile.mkstemp(prefix="stage-", dir=directory)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
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
    target: str | os.PathLike[str],
    data: bytes,
    *,
    staging_dir: str | os.PathLike[str],
    fsync: bool = True,
    mode: int | None = None,
) -> None:
    """Make ``target`` hold ``data``: readers see the old file or the whole new one, never part.

    ``staging_dir`` must be on the same filesystem as ``target`` (a rename cannot cross one).
    ``mode``: the file's permission bits (default ``0o600``, ``mkstemp``'s).
    """
    make_dirs(os.path.dirname(os.fspath(target)))
    staged = _stage(staging_dir, data, fsync=fsync, mode=mode)
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
    make_dirs(directory)
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


class MountTable:
    """Filesystem types by mount point, from a ``/proc/self/mountinfo`` text (the last mount on a point wins)."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        for line in text.splitlines():  # "36 35 98:0 / /mnt rw,relatime shared:1 - ext4 /dev/vda rw"
            fields = line.split(" ")
            try:
                separator = fields.index("-", 5)
                point, fs_type = _unescape(fields[4]), fields[separator + 1]
            except (ValueError, IndexError):
                continue
            self.types[point] = fs_type
        self._memo: cachetools.LRUCache[str, str] = cachetools.LRUCache(_MAX_MEMO_PATHS)

    def fs_type(self, real_path: str) -> str:
        """The type of the filesystem ``real_path`` (no symlinks in it) lives on; "" if unknown."""
        found = self._memo.get(real_path)
        if found is None:
            found = self.types.get(real_path)
            if found is None:
                parent = os.path.dirname(real_path)
                found = "" if parent == real_path else self.fs_type(parent)
            self._memo[real_path] = found
        return found


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as ``\\ooo`` octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def on_local_disk(path: str | os.PathLike[str], mountinfo: str | None = None) -> bool:
    """True if ``path`` (or its nearest existing parent) is on a filesystem of :data:`LOCAL_FS_TYPES`.

    From the mount table (Linux; :class:`MountTable`). False where it cannot be read (another OS)
    or the type is any other (NFS, FUSE, Lustre, ...).
    """
    try:
        with open(mountinfo or MOUNT_TABLE, "rb") as fh:
            table = MountTable(os.fsdecode(fh.read()))  # paths as os.path.realpath decodes them
    except OSError:
        return False
    return table.fs_type(os.path.realpath(path)) in LOCAL_FS_TYPES
