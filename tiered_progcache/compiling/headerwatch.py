"""Header watches: inotify vouches that nothing a memoized header scan depends on has changed.

Validating a memoized scan by stat re-stats every path it probed (1,846 of them for a
``cub::BlockReduce`` kernel): milliseconds per ``compile()`` hit. Here the kernel tells us
instead. A scan's :class:`Subscription` stays valid until an event arrives on
something it depends on; a warm call then costs one ``poll(2)`` with a zero timeout on
the inotify descriptor (and on ``/proc/self/mountinfo``), no stat.

What is watched, for every path the scan probed (and every directory whose ``realpath``
it recorded):

* every directory the kernel looks a name up in to resolve the path, from ``/`` down,
  through symbolic links (their targets too): an event there matters only when its NAME
  is the component looked up (a header replaced, deleted or created, a directory
  renamed, a symlink retargeted); an event on the directory itself (chmod, deleted,
  moved, unmounted, watch gone) matters to everything resolved through it;
* the directory itself, every name in it, for directories the scan walked whole (its
  whole-directory fallback), since any new file there changes the digest;
* the inode of every regular file the scan read, so a write through another hard link
  (which raises no event in our directory) is seen too.

Mask: ``IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_CREATE | IN_DELETE | IN_MOVED_FROM |
IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF``. ``IN_Q_OVERFLOW`` (events lost) invalidates
every subscription; ``IN_IGNORED`` / ``IN_UNMOUNT`` invalidate everything that watch covered.
A change of the mount table (``/proc/self/mountinfo`` polls ``POLLPRI``) invalidates
everything too: a mount over an include directory raises no inotify event.

Order: the watches are added FIRST, then the scan is validated by ``lstat``/``stat``
once (and the resolution re-walked: a symlink retargeted in between shows). From then
on "no relevant event since" means unchanged. That relies on the kernel queueing an
inotify event synchronously, inside the system call that changes the file, before that
call returns (``fsnotify()`` runs in ``vfs_write``, ``vfs_rename``, ``notify_change``...):
a write in any process that returned before our non-blocking read is in the queue we
read. ``tests/compiling/test_headerwatch.py`` checks it with a real second process.

Trusted only where local events are complete: the filesystem type of every watched
path is read from ``/proc/self/mountinfo``; :data:`TRUSTED_FS_TYPES` (ext2/3/4, xfs,
btrfs, tmpfs, overlay, zfs, f2fs) are watched, anything else (nfs, cifs/smb, fuse.*,
9p, virtiofs, lustre, gpfs, ceph, unknown) is re-statted on every call: an
edit made on another host to an NFS header never raises an inotify event here.

Never fails a compile: no ``inotify_simple`` (it is a Linux-only dependency), not
Linux, ``inotify_init`` refused (``EMFILE``), the watch limit reached (``ENOSPC``,
``fs.inotify.max_user_watches``) or this watcher's own budget (``max_watches``) spent:
what cannot be watched is re-statted on every call instead, and the reason is logged once.

Fork: a child must not read the parent's inotify descriptor (it shares the queue, and
would steal the parent's events). A reset in :mod:`.forks` drops the watcher in the child;
its subscriptions turn invalid, so the child's memo falls back to stat validation and is
watched again by a watcher of its own.

Limits (what inotify does not see, and what the stat path did or did not see):

* Writes through a shared ``mmap`` raise no ``IN_MODIFY``; ``IN_CLOSE_WRITE`` comes only
  when the last descriptor or mapping of the file opened for writing is closed. So an
  edit through a mapping that stays open is not seen until it is unmapped. The kernel
  does move mtime/ctime at the first write fault on a clean page, so the stat path saw
  such an edit; a further write to a page already dirty moves neither, so neither path
  sees that one before the unmap (``test_mmap_writes_raise_no_event_until_the_mapping_closes...``).
* Edits made on another host (network filesystems), and writes to an overlay's lower
  layer from outside it, raise no local event: hence the filesystem check above
  (``overlay`` is trusted for edits made through the overlay, which is what containers do).

Threads: the descriptor is read under a lock, and an event invalidates every
subscription that depends on its watch, whichever thread reads it.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import select
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .. import forks
from ..stores.fsutil import LOCAL_FS_TYPES, MountTable
from ..stores.ratelimit import log_once

try:
    import inotify_simple
except ImportError:  # optional, Linux-only: the stat path serves without it
    inotify_simple = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_MAX_WATCHES",
    "TRUSTED_FS_TYPES",
    "WATCH_MASK",
    "HeaderWatcher",
    "Subscription",
    "WatcherCounts",
    "replace_watcher",
    "watcher",
]

logger = logging.getLogger(__name__)

#: Filesystems whose local inotify events are complete (every change made on this host raises one).
TRUSTED_FS_TYPES = LOCAL_FS_TYPES
#: Kernel watches one watcher may hold (each costs up to ~1 KiB of kernel memory and one of the
#: user's ``fs.inotify.max_user_watches``); a ``cub::BlockReduce`` scan takes about 1,850.
DEFAULT_MAX_WATCHES = 8192

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000

#: What a watch asks the kernel for: every change to content, metadata or names; never reads.
WATCH_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_CREATE | IN_DELETE | IN_MOVED_FROM
              | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF)

_MAX_SYMLINKS = 40  # as the kernel's ELOOP limit
_READ_CHUNK = 1 << 16

Pair = tuple[str, str]  # (real directory, name looked up in it)


class Subscription:
    """One validated scan, as inotify vouches for it: ``valid`` until a relevant event arrives.

    ``stat_checks`` / ``stat_real_checks`` are the parts no watch covers (an untrusted
    filesystem, a watch refused): the caller re-stats those on every call.
    """

    __slots__ = ("valid", "rescan", "stat_checks", "stat_real_checks", "_watcher", "_registrations")

    def __init__(self, watcher: HeaderWatcher) -> None:
        self.valid = True
        #: an event named a file in a directory the scan walked whole: scan again, do not re-stat
        #: (``cp -p`` / ``rsync -t`` put the directory's mtime back, and a stat may not tell)
        self.rescan = False
        self.stat_checks: tuple[tuple[str, Any], ...] = ()
        self.stat_real_checks: tuple[tuple[str, str], ...] = ()
        self._watcher = watcher
        self._registrations: set[tuple[int, str | None]] = set()  # (wd, name; None: every event there)

    def current(self) -> bool:
        """True while no event has touched what this scan depends on (one ``poll(2)``, no stat)."""
        return self._watcher.current(self)

    def release(self) -> None:
        """Stop tracking: the scan was dropped or replaced."""
        self._watcher.release(self)


@dataclasses.dataclass(frozen=True)
class WatcherCounts:
    """What one watcher has done (tests and benchmarks read it to prove a path was taken)."""

    watches: int  # kernel watches held now
    events: int  # inotify events read
    invalidations: int  # subscriptions an event (or overflow, or a mount change) ended
    overflows: int  # IN_Q_OVERFLOW seen (or handle_overflow() called)
    refused: int  # watches not added: untrusted filesystem, budget, ENOSPC, gone


class _Watch:
    """One kernel watch descriptor and the subscriptions that depend on it."""

    __slots__ = ("everyone", "by_name", "any_name")

    def __init__(self) -> None:
        self.everyone: set[Subscription] = set()
        self.by_name: dict[str, set[Subscription]] = {}
        self.any_name: set[Subscription] = set()


class _Resolver:
    """Resolves paths as the kernel does (symlinks first, then ``..``), recording every lookup.

    ``directory(path)`` returns ``(real path or None if a component is missing or
    unreadable, the (real directory, name) pairs looked up on the way)``.
    """

    def __init__(self) -> None:
        self._memo: dict[str, tuple[str | None, tuple[Pair, ...]]] = {"/": ("/", ())}
        self._resolving: set[str] = set()

    def directory(self, path: str) -> tuple[str | None, tuple[Pair, ...]]:
        found = self._memo.get(path)
        if found is not None:
            return found
        if path in self._resolving or len(self._resolving) > _MAX_SYMLINKS:
            return None, ()  # a symlink loop: ELOOP for the kernel too
        self._resolving.add(path)
        try:
            parent, name = os.path.split(path)
            if not parent:
                result: tuple[str | None, tuple[Pair, ...]] = (None, ())
            elif name in ("", "."):
                result = self.directory(parent)
            else:
                parent_real, parent_pairs = self.directory(parent)
                if parent_real is None:
                    result = (None, parent_pairs)
                elif name == "..":
                    result = (os.path.dirname(parent_real), parent_pairs)
                else:
                    result = self._step(parent_real, name, parent_pairs)
        finally:
            self._resolving.discard(path)
        self._memo[path] = result
        return result

    def same_in(self, other: _Resolver) -> bool:
        """Does ``other`` (a later walk) resolve every path this one resolved the same way?"""
        return all(other.directory(path) == found for path, found in list(self._memo.items()))

    def _step(self, parent_real: str, name: str, pairs: tuple[Pair, ...]) -> tuple[str | None, tuple[Pair, ...]]:
        here = os.path.join(parent_real, name)
        pairs = (*pairs, (parent_real, name))
        try:
            st = os.lstat(here)
        except OSError:
            return None, pairs
        if not stat.S_ISLNK(st.st_mode):
            return here, pairs
        try:
            target = os.readlink(here)
        except OSError:
            return None, pairs
        target_real, target_pairs = self.directory(os.path.join(parent_real, target))
        return target_real, (*pairs, *target_pairs)


class HeaderWatcher:
    """One inotify descriptor (and one mountinfo descriptor) for this process's header scans.

    >>> sub = watcher().subscribe(checks, real_checks, signature=sig_of_path, signature_of_stat=sig_of_stat)
    >>> watcher().current(sub)      # True while nothing the scan depends on has changed

    ``max_watches`` bounds the kernel watches held (unused ones are removed first when it
    is reached; past it, what is left unwatched is re-statted by the caller).
    ``mountinfo_path`` is the mount table read for filesystem types (tests point it at a
    table of their own), ``trusted_fs_types`` the types whose events are trusted.

    Thread-safe: every method may be called from any thread. Not inherited by a forked
    child (see the module docstring). ``OSError`` from the constructor if inotify or the
    mount table cannot be opened.
    """

    def __init__(
        self,
        *,
        max_watches: int = DEFAULT_MAX_WATCHES,
        mountinfo_path: str = "/proc/self/mountinfo",
        trusted_fs_types: frozenset[str] = TRUSTED_FS_TYPES,
    ) -> None:
        if isinstance(max_watches, bool) or not isinstance(max_watches, int):
            raise TypeError(f"max_watches must be an int, got {type(max_watches).__name__}")
        if max_watches < 1:
            raise ValueError(f"max_watches must be at least 1, got {max_watches}")
        if inotify_simple is None:
            raise OSError(errno.ENOSYS, "inotify_simple is not installed")
        self._max_watches = max_watches
        self._trusted = frozenset(trusted_fs_types)
        self._lock = threading.Lock()
        self._inotify = inotify_simple.INotify(nonblocking=True)
        try:
            self._mount_fd = os.open(mountinfo_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._inotify.close()
            raise
        self._fd = self._inotify.fileno()
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self._poller.register(self._mount_fd, select.POLLPRI)
        self._mounts = self._read_mounts()
        self._wds: dict[int, _Watch] = {}
        self._subs: set[Subscription] = set()
        self._abandoned = False
        self._events = self._invalidations = self._overflows = self._refused = 0

    # -- the hot path ---------------------------------------------------------------

    def current(self, sub: Subscription) -> bool:
        """True while no event has touched what ``sub`` depends on (one ``poll(2)``, no stat)."""
        with self._lock:
            if self._abandoned:
                return False
            ready = self._poller.poll(0)
            if ready:
                self._drain(ready)
            return sub.valid

    # -- subscribing --------------------------------------------------------------------

    def subscribe(
        self,
        checks: Sequence[tuple[str, Any]],
        real_checks: Sequence[tuple[str, str]],
        *,
        signature: Callable[[str], Any],
        signature_of_stat: Callable[[os.stat_result], Any],
    ) -> Subscription:
        """Watch what ``checks`` (path, expected signature) and ``real_checks`` (directory, its
        realpath) depend on, THEN validate them once; the subscription is valid if all match.

        A signature is ``signature(path)`` (the caller's ``stat`` reading), or, for a path
        that is not a symbolic link, ``signature_of_stat(os.lstat(path))``; a signature
        whose first item is ``"f"`` is a regular file (its inode is watched), ``"d"`` a
        directory read whole (every name in it matters).
        """
        sub = Subscription(self)
        before = _Resolver()
        plans = [_plan(before, path, sig) for path, sig in checks]
        real_plans = [before.directory(directory) for directory, _ in real_checks]
        uncovered: list[tuple[str, Any]] = []
        uncovered_real: list[tuple[str, str]] = []
        with self._lock:
            if self._abandoned:
                sub.valid = False
                return sub
            ready = self._poller.poll(0)
            if ready:
                self._drain(ready)  # what happened before this subscription is not its concern
            self._subs.add(sub)
            added: dict[str, int | None] = {}
            chains: dict[str, bool] = {}  # directory -> every lookup resolving it watched
            register = self._register
            for check, (chain, last, whole_dir, inode) in zip(checks, plans):
                covered = chains.get(chain)
                if covered is None:
                    covered = chains[chain] = self._register_all(sub, before.directory(chain)[1], None, None, added)
                if last is not None:  # the common case, kept tight: the name in its directory, the file's inode
                    directory, name = last
                    wd = added[directory] if directory in added else added.setdefault(directory, self._watch(directory, True))
                    if wd is None:
                        covered = False
                    else:
                        register(sub, wd, name)
                if inode is not None:
                    wd = self._watch(inode, False)
                    if wd is None:
                        covered = False
                    else:
                        register(sub, wd, "")
                if whole_dir is not None and not self._register_all(sub, (), whole_dir, None, added):
                    covered = False
                if not covered:
                    uncovered.append(check)
            for check, (_, pairs) in zip(real_checks, real_plans):
                if not self._register_all(sub, pairs, None, None, added):
                    uncovered_real.append(check)
        sub.stat_checks, sub.stat_real_checks = tuple(uncovered), tuple(uncovered_real)
        valid = self._validate(sub, checks, real_checks, before, added, signature, signature_of_stat)
        with self._lock:
            if not (valid and sub.valid):
                sub.valid = False
                self._unregister(sub)
        return sub

    def _validate(
        self,
        sub: Subscription,
        checks: Sequence[tuple[str, Any]],
        real_checks: Sequence[tuple[str, str]],
        before: _Resolver,
        added: dict[str, int | None],
        signature: Callable[[str], Any],
        signature_of_stat: Callable[[os.stat_result], Any],
    ) -> bool:
        """After the watches: everything still resolved and as the scan saw it?"""
        after = _Resolver()
        if not before.same_in(after):
            return False  # a symlink or directory on the way changed between planning and watching
        realpath = os.path.realpath
        if any(realpath(directory) != real for directory, real in real_checks):
            return False
        lstat = os.lstat
        for path, expected in checks:
            try:
                st = lstat(path)
            except OSError:
                current = signature(path)
            else:
                if stat.S_ISLNK(st.st_mode):
                    # A symlinked header: the directories of its target count too, watched before the stat.
                    _, link_pairs = after.directory(os.path.abspath(path))
                    with self._lock:
                        covered = sub.valid and self._register_all(sub, link_pairs, None, None, added)
                    if not covered:
                        sub.stat_checks = (*sub.stat_checks, (path, expected))
                    current = signature(path)
                else:
                    current = signature_of_stat(st)
            if current != expected:
                return False
        return True

    def _register_all(
        self,
        sub: Subscription,
        pairs: tuple[Pair, ...],
        whole_dir: str | None,
        inode: str | None,
        added: dict[str, int | None],
    ) -> bool:
        """Watch every pair (and the whole directory, and the file's inode); False if any is refused. Lock held.

        ``added`` remembers the paths watched during one subscription (one ``add_watch`` each).
        """
        covered = True
        for directory, name in pairs:
            wd = added[directory] if directory in added else added.setdefault(directory, self._watch(directory, True))
            if wd is None:
                covered = False
            else:
                self._register(sub, wd, name)
        for path, name, is_dir in ((whole_dir, None, True), (inode, "", False)):
            if path is None:
                continue
            wd = added[path] if path in added else added.setdefault(path, self._watch(path, is_dir))
            if wd is None:
                covered = False
            else:
                self._register(sub, wd, name)
        return covered

    def _register(self, sub: Subscription, wd: int, name: str | None) -> None:
        if (wd, name) in sub._registrations:
            return
        watch = self._wds[wd]
        watch.everyone.add(sub)
        if name is None:
            watch.any_name.add(sub)
        elif name:
            watch.by_name.setdefault(name, set()).add(sub)
        sub._registrations.add((wd, name))

    def _watch(self, real_path: str, directory: bool) -> int | None:
        """The watch descriptor on ``real_path`` (added if needed); None if it cannot be trusted or added. Lock held."""
        fs_type = self._mounts.fs_type(real_path)
        if fs_type not in self._trusted:
            self._refused += 1
            log_once(logger, f"untrusted-fs:{fs_type}", logging.INFO,
                     "headers on %s (%s) are re-statted on every call: inotify does not see every change there",
                     fs_type or "an unknown filesystem", real_path)
            return None
        mask = WATCH_MASK | (IN_ONLYDIR if directory else 0)
        for attempt in range(2):
            try:
                wd = self._inotify.add_watch(real_path, mask)
            except OSError as exc:
                if exc.errno == errno.ENOSPC and attempt == 0 and self._collect_unused():
                    continue
                self._refused += 1
                if exc.errno == errno.ENOSPC:
                    log_once(logger, "inotify-enospc", logging.WARNING,
                             "inotify watch limit reached (fs.inotify.max_user_watches): "
                             "headers not watched are re-statted on every call")
                return None
            if wd in self._wds:
                return wd
            if len(self._wds) < self._max_watches or (attempt == 0 and self._collect_unused()):
                self._wds[wd] = _Watch()
                return wd
            self._rm_watch(wd)
            self._refused += 1
            log_once(logger, "watch-budget", logging.INFO,
                     "header watch budget (%d watches) spent: headers not watched are re-statted on every call",
                     self._max_watches)
            return None
        return None

    def _collect_unused(self) -> bool:
        """Remove kernel watches no subscription depends on; True if any was removed. Lock held."""
        unused = [wd for wd, watch in self._wds.items() if not watch.everyone]
        for wd in unused:
            del self._wds[wd]
            self._rm_watch(wd)
        return bool(unused)

    def _rm_watch(self, wd: int) -> None:
        try:
            self._inotify.rm_watch(wd)
        except OSError:
            pass  # already gone (IN_IGNORED queued): nothing to undo

    # -- events -------------------------------------------------------------------------

    def _drain(self, ready: list[tuple[int, int]]) -> None:
        """Apply everything ``poll`` found queued: inotify events, a changed mount table. Lock held."""
        for fd, _ in ready:
            if fd == self._mount_fd:
                self._mounts = self._read_mounts()
                self._invalidate_all()
            elif fd == self._fd:
                self._read_events()

    def _read_events(self) -> None:
        while True:
            try:
                data = os.read(self._fd, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError as exc:
                logger.warning("reading inotify events failed (%s): every header scan is re-validated", exc)
                self._invalidate_all()
                return
            if not data:
                return
            for wd, mask, _cookie, name in inotify_simple.parse_events(data):
                self._events += 1
                self._apply(wd, mask, name)

    def _apply(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._overflow()
            return
        watch = self._wds.get(wd)
        if watch is None:
            return  # a watch we removed
        if mask & IN_IGNORED:
            del self._wds[wd]  # the kernel dropped it (deleted, unmounted): watch again next time
            targets = set(watch.everyone)
        elif name:
            for sub in watch.any_name:
                sub.rescan = True
            targets = watch.any_name | watch.by_name.get(name, set())
        else:
            targets = set(watch.everyone)  # the watched directory or file itself
        for sub in targets:
            self._invalidate(sub)

    def handle_overflow(self) -> None:
        """What ``IN_Q_OVERFLOW`` does: events were lost, so no subscription can be trusted."""
        with self._lock:
            self._overflow()

    def _overflow(self) -> None:
        self._overflows += 1
        log_once(logger, "inotify-overflow", logging.INFO,
                 "inotify queue overflowed: header scans are re-validated by stat")
        self._invalidate_all()

    def _invalidate_all(self) -> None:
        for sub in list(self._subs):
            self._invalidate(sub)

    def _invalidate(self, sub: Subscription) -> None:
        if sub.valid:
            self._invalidations += 1
        sub.valid = False
        self._unregister(sub)

    def _unregister(self, sub: Subscription) -> None:
        for wd, name in sub._registrations:
            watch = self._wds.get(wd)
            if watch is None:
                continue
            watch.everyone.discard(sub)
            if name is None:
                watch.any_name.discard(sub)
            elif name:
                named = watch.by_name.get(name)
                if named is not None:
                    named.discard(sub)
                    if not named:
                        del watch.by_name[name]
        sub._registrations.clear()
        self._subs.discard(sub)

    def release(self, sub: Subscription) -> None:
        """Stop tracking ``sub`` (its scan was dropped); it is invalid from now on."""
        with self._lock:
            sub.valid = False
            self._unregister(sub)

    # -- the mount table -------------------------------------------------------------------

    def _read_mounts(self) -> MountTable:
        os.lseek(self._mount_fd, 0, os.SEEK_SET)
        chunks = []
        while True:
            chunk = os.read(self._mount_fd, _READ_CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
        return MountTable(b"".join(chunks).decode("utf-8", "surrogateescape"))

    def fs_type(self, path: str) -> str:
        """The filesystem type this watcher sees ``path`` on ("" if unknown)."""
        with self._lock:
            return self._mounts.fs_type(os.path.realpath(path))

    # -- housekeeping -----------------------------------------------------------------------

    def counts(self) -> WatcherCounts:
        with self._lock:
            return WatcherCounts(len(self._wds), self._events, self._invalidations, self._overflows, self._refused)

    def close(self) -> None:
        """Invalidate every subscription and close the descriptors. Idempotent."""
        with self._lock:
            self._invalidate_all()
            self._abandoned = True
            self._close_fds()

    def _close_fds(self) -> None:
        for close in (self._inotify.close, lambda: os.close(self._mount_fd)):
            try:
                close()
            except OSError:
                pass
        self._wds.clear()

    def _abandon_after_fork(self) -> None:
        """In a forked child: never read the parent's queue; every subscription is invalid. No lock
        is taken (another thread of the parent may have held it at the fork)."""
        self._lock = threading.Lock()
        self._abandoned = True
        for sub in self._subs:
            sub.valid = False
        self._subs = set()
        self._close_fds()


class _Plan(NamedTuple):
    """What one probed path depends on: the lookups resolving ``chain`` (a directory), one more
    ``(real directory, name)`` lookup, a directory to watch whole, a file to watch by inode."""

    chain: str
    last: Pair | None
    whole_dir: str | None
    inode: str | None


def _plan(resolver: _Resolver, path: str, sig: Any) -> _Plan:
    parent, _, name = path.rpartition("/")
    kind = sig[0] if isinstance(sig, tuple) and sig else None
    if kind == "d" or not parent or name in ("", ".", ".."):
        if not os.path.isabs(path):
            path = os.path.abspath(path)
        real = resolver.directory(path)[0]
        return _Plan(path, None, real if kind == "d" else None, None)
    parent_real = resolver.directory(parent)[0]
    if parent_real is None:
        return _Plan(path, None, None, None)
    real = parent_real + "/" + name if parent_real != "/" else "/" + name
    return _Plan(parent, (parent_real, name), None, real if kind == "f" else None)


# -- the process's watcher ------------------------------------------------------------------

_UNSET: Any = object()
_instance: HeaderWatcher | None = _UNSET
_instance_lock = threading.Lock()


def watcher() -> HeaderWatcher | None:
    """This process's watcher, made on first use; None where inotify cannot be used (logged once)."""
    instance = _instance
    if instance is not _UNSET:
        return instance
    return _make_watcher()


def _make_watcher() -> HeaderWatcher | None:
    global _instance
    with _instance_lock:
        if _instance is not _UNSET:
            return _instance
        made: HeaderWatcher | None = None
        if not sys.platform.startswith("linux"):
            log_once(logger, "no-inotify", logging.DEBUG, "no inotify on %s: header scans are re-statted", sys.platform)
        elif inotify_simple is None:
            log_once(logger, "no-inotify", logging.INFO,
                     "inotify_simple is not installed: header scans are re-statted on every call")
        else:
            try:
                made = HeaderWatcher()
            except OSError as exc:
                log_once(logger, "no-inotify", logging.WARNING,
                         "inotify unavailable (%s): header scans are re-statted on every call", exc)
        _instance = made
        return made


def replace_watcher(new: HeaderWatcher | None) -> HeaderWatcher | None:
    """Make ``new`` this process's watcher (None: stat validation only); returns the previous one.

    For tests and embedders; the caller closes the previous one if it made it.
    """
    global _instance
    with _instance_lock:
        previous = None if _instance is _UNSET else _instance
        _instance = new
        return previous


def _forget_after_fork() -> None:
    global _instance, _instance_lock
    _instance_lock = threading.Lock()
    previous = _instance
    _instance = _UNSET  # the child makes its own on first use
    if isinstance(previous, HeaderWatcher):
        previous._abandon_after_fork()


forks.register(_forget_after_fork)
