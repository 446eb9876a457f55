"""A Triton cache manager: Triton's own local directory, with the program cache's shared tiers behind it.

Select it the way Triton selects any cache manager (``knobs.cache.manager_class``,
Triton 3.4 and later; tested with 3.9.0 and 3.6.0)::

    TRITON_CACHE_MANAGER=tiered_progcache.triton:TieredCacheManager

The local directory is Triton's :class:`~triton.runtime.cache.FileCacheManager`
layout under ``TRITON_CACHE_DIR`` (``<dir>/<key>/<file>``, ``__grp__<file>`` group
indexes), unchanged: an existing cache keeps working and Triton's tools still read it.
Behind it stand the shared tiers ``TIERED_PROGCACHE_*`` configure (Redis, S3, GCS,
``file://``; :meth:`~tiered_progcache.config.CacheConfig.build_shared`), so the
envelope, the request door, deadline and breaker, background upload, fail-open and
stats are the program cache's own.

Names. Triton file ``F`` of key ``K`` is the key ``triton/K/F``, stored under entry
name ``sha256(b"triton/K/F")`` in the shared stores' ``triton`` namespace
(``<url>/triton/<2 hex>/<62 hex>``, Redis ``<prefix>:triton:<name>``): beside the
program cache's ``entries/`` in the same bucket, never among them. Its payload is
framed (:func:`frame`) with the key and file it belongs to, so any entry says whether
it is Triton's (:func:`describe`) and a renamed object is refused. A group is stored as its members plus one *group
record* (``triton/K/__grp__F``): JSON listing each member file with the sha256 of its
bytes (Triton's own group file holds absolute local paths, meaningless on another node).

Reads. The local directory first: a hit there asks the network nothing. A local miss
reads the group record (one request), then every member in one batched read
(:meth:`~tiered_progcache.stores.store.EntryStore.read_many`: one deadline, side by side).
A group whose members are not all present, unframed as expected and matching the
record's digests is a miss, never a partial load. A hit is written into the local
directory (members first, the group file last) and served from there.

Writes. ``put`` writes the local directory as Triton does and queues the file's upload;
``put_group`` queues the group record after its members (one worker per tier, in
order), so a reader elsewhere sees a group only once its members are up. A failed or
dropped upload leaves a group another node reads as a miss, and compiles again.

Failures: whatever the shared tiers or the local write of a fetched group raise is a
logged miss; the manager never fails a compile that Triton's own manager would not.

Threads: safe from many threads (Triton's local writes stage and rename; the chain is
thread-safe). Processes: each builds its own chain on first use; nodes share only the
remote, whose objects are whole and verified.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from triton.runtime.cache import FileCacheManager

from ..errors import EntryRejected
from ..chain.stats import CacheStats, CompileTally, TierCounters, TierStats
from ..config import ProcessSharedChain
from ..stores.store import BatchRead
from .tritonnames import (
    FRAME_MAGIC,
    GROUP_PREFIX,
    KEY_PREFIX,
    MAX_GROUP_MEMBERS,
    MAX_GROUP_RECORD_BYTES,
    NAMESPACE,
    TritonFile,
    cache_key,
    describe,
    frame,
    group_record,
    name_of,
    opened,
    read_group_record,
)

__all__ = [
    "FRAME_MAGIC",
    "GROUP_PREFIX",
    "KEY_PREFIX",
    "MAX_GROUP_MEMBERS",
    "MAX_GROUP_RECORD_BYTES",
    "NAMESPACE",
    "TieredCacheManager",
    "TritonFile",
    "cache_key",
    "describe",
    "frame",
    "name_of",
    "shared_cache",
    "stats",
    "use_shared_cache",
]

logger = logging.getLogger(__name__)

# -- the process's shared chain -------------------------------------------------------------

_shared = ProcessSharedChain(NAMESPACE, log=logger, label="Triton cache", alone="the local directory")
_counters_lock = threading.Lock()
_local = TierCounters()
#: Group lookups the shared tiers answered (``hits``: fetched whole) or not, after a local miss.
_remote = TierCounters()
_reported: set[tuple[int, str]] = set()  # (pid, cache directory) whose counters report at exit


def shared_cache() -> Any:
    """The chain of shared tiers Triton's files go to (a ``TieredProgramCache``), or None if no remote is set.

    Built once per process on first use from ``TIERED_PROGCACHE_*`` (a bad setting is
    logged and the manager runs on the local directory alone: a cache never fails a compile).
    """
    return _shared.get()


def use_shared_cache(cache: Any) -> None:
    """Make ``cache`` (a ``TieredProgramCache`` of shared tiers, or None) the one Triton's files go to.

    >>> use_shared_cache(CacheConfig.from_env(remote="s3://kernels/triton").build_shared())

    For applications that build their chain in code, and for tests; the previous one is not closed.
    """
    _shared.use(cache)


def stats() -> CacheStats:
    """Triton's counters: ``triton-local``, then each shared tier's (counting entries: a group is its members and its record).

    ``triton-local``: ``hits``/``misses`` are group lookups the local directory answered
    or not, ``writes``/``bytes_written`` the files Triton put (what its compiles made).
    """
    return _shared.stats("triton-local", _local.snapshot())


class _SharedGroups:
    """Triton's shared tiers as one tier of group lookups: ``triton-remote`` in ``stats --triton`` and ``stats --run``.

    ``hits``/``misses`` are whole groups fetched or not after a local miss (a miss there is a
    compile); the other counters (files uploaded, errors, timeouts, ...) the shared tiers' own, summed.
    """

    def __init__(self, groups: TierCounters) -> None:
        self._groups = groups

    def _tiers(self) -> list[TierCounters]:
        chain = _shared.if_built()
        return [t.counters for t in chain.tiers] if chain is not None else []

    @property
    def hits(self) -> int:
        return self._groups.hits

    @property
    def misses(self) -> int:
        return self._groups.misses

    @property
    def errors(self) -> int:
        return sum(c.errors for c in self._tiers())

    @property
    def timeouts(self) -> int:
        return sum(c.timeouts for c in self._tiers())

    def snapshot(self) -> TierStats:
        groups, tiers = self._groups.snapshot(), self._tiers()
        return TierStats(hits=groups.hits, misses=groups.misses, bytes_read=groups.bytes_read,
                         writes=sum(c.writes for c in tiers), bytes_written=sum(c.bytes_written for c in tiers),
                         errors=self.errors, timeouts=self.timeouts, skipped=sum(c.skipped for c in tiers),
                         dropped=sum(c.dropped for c in tiers), rejected=sum(c.rejected for c in tiers))  # fmt: skip


def _report_from(cache_dir: str, *, shared: bool) -> None:
    """Once per process and Triton cache directory: report the counters at exit to the directory's
    ``stats.jsonl`` (``stats --triton``) and to a ``stats --run`` file."""
    root = os.path.abspath(cache_dir)
    marker = (os.getpid(), root)
    with _counters_lock:
        if marker in _reported:
            return
        _reported.add(marker)
        tiers: list[tuple[str, Any]] = [("triton-local", _local)]
        if shared:
            tiers.append(("triton-remote", _SharedGroups(_remote)))
    from ..chain import exitreport

    exitreport.register_counters(root, tiers, CompileTally())


# -- the cache manager ----------------------------------------------------------------------


class TieredCacheManager(FileCacheManager):
    """Triton's ``FileCacheManager`` with the shared tiers behind it (see the module docstring).

    >>> os.environ["TRITON_CACHE_MANAGER"] = "tiered_progcache.triton:TieredCacheManager"

    Triton builds one per compile (``get_cache_manager(hash)``); they share the process's
    chain. Dump and override managers (``TRITON_KERNEL_DUMP``/``_OVERRIDE``) stay local.
    """

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        super().__init__(key, override=override, dump=dump)
        self._shared = None if (override or dump) else shared_cache()
        if not (override or dump):
            _report_from(os.path.dirname(self.cache_dir), shared=self._shared is not None)

    # -- single files ---------------------------------------------------------------

    def get_file(self, filename: str) -> str | None:
        """The local path of ``filename``: the local directory's, else fetched from the shared tiers; None on a miss."""
        path = super().get_file(filename)
        if path is not None or self._shared is None:
            return path
        try:
            payload = self._shared.get(cache_key(self.key, filename))
            if payload is None:
                return None
            return super().put(opened(payload, self.key, filename), filename, binary=True)
        except Exception as exc:  # a refused entry, a full disk: a miss, never a failed compile
            logger.warning("Triton cache: %s of %s not fetched (a miss): %s", filename, self.key, exc)
            return None

    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        """Write ``data`` locally as Triton does, and queue its upload (a group index is uploaded by ``put_group``)."""
        path = super().put(data, filename, binary=binary)
        if not filename.startswith(GROUP_PREFIX):
            raw = data if isinstance(data, bytes) else str(data).encode("utf-8")
            _local.count_write(len(raw))  # a file Triton made (a compile's output), not one fetched
            if self._shared is not None:
                self._upload(filename, raw)
        return path

    # -- groups ---------------------------------------------------------------------

    def get_group(self, filename: str) -> dict[str, str] | None:
        """Member file -> local path: the local group if whole, else the shared tiers' (all members or a miss)."""
        group = super().get_group(filename)
        if group is not None:
            _local.count_hit(0)
            return group
        _local.count_miss()
        if self._shared is None:
            return None
        try:
            members = self._fetch_group(filename)
            if members is None:
                _remote.count_miss()
                return None
            local = super(TieredCacheManager, self)
            paths = {name: local.put(data, name, binary=True) for name, data in members.items()}
            FileCacheManager.put_group(self, filename, paths)  # members first, the index last: readers see it whole
        except Exception as exc:  # a full disk, a bad name: a miss, never a failed compile
            logger.warning("Triton cache: group %s of %s not fetched (a miss): %s", filename, self.key, exc)
            _remote.count_miss()
            return None
        _remote.count_hit(sum(len(data) for data in members.values()))
        return paths

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        """Write Triton's group index locally, and queue the group record after its members' uploads."""
        path = super().put_group(filename, group)
        if self._shared is not None:
            try:
                members = {name: _read_local(p) for name, p in group.items()}
            except OSError as exc:
                logger.warning("Triton cache: group %s of %s not uploaded: %s", filename, self.key, exc)
                return path
            record_file = GROUP_PREFIX + filename
            self._upload(record_file, group_record(self.key, record_file, members))
        return path

    # -- internals ------------------------------------------------------------------

    def _upload(self, filename: str, raw: bytes) -> None:
        """Queue ``raw`` for every writable shared tier (background; a full queue drops it, counted). Never raises."""
        try:
            self._shared.put(cache_key(self.key, filename), frame(self.key, filename, raw))  # not an NVRTC run
        except Exception as exc:  # a name no entry can have: the file stays local
            logger.warning("Triton cache: %s of %s not uploaded: %s", filename, self.key, exc)

    def _fetch_group(self, filename: str) -> dict[str, bytes] | None:
        """The group's members from the first shared tier that has all of them verified, else None.

        A hit in a slower tier is promoted into the faster ones (Redis in front of S3), as the chain does.
        """
        record_file = GROUP_PREFIX + filename
        record_key = cache_key(self.key, record_file)
        tiers = self._shared.tiers
        for depth, tier in enumerate(tiers):
            payload = tier.lookup(record_key)
            if payload is None:
                continue
            try:
                digests = read_group_record(opened(payload, self.key, record_file), self.key, record_file)
            except EntryRejected as exc:
                tier.counters.add("rejected")
                logger.warning("Triton cache: tier %s: group %s of %s refused: %s", tier.name, filename, self.key, exc)
                continue
            fetched = self._read_members(tier, digests)
            if fetched is None:
                continue
            members, payloads = fetched
            for faster in tiers[:depth]:
                if faster.policy.promote:
                    for file, stored in payloads.items():  # members first, the record last
                        faster.store(cache_key(self.key, file), stored, promotion=True)
                    faster.store(record_key, payload, promotion=True)
            return members
        return None

    def _read_members(self, tier: Any, digests: Mapping[str, str]) -> tuple[dict[str, bytes], dict[str, bytes]] | None:
        """Every member from ``tier`` in one batched read, verified against the record: (file -> bytes,
        file -> stored payload); None unless all are."""
        names = {name_of(self.key, f): f for f in digests}
        got = _read_many(tier, {name: cache_key(self.key, f) for name, f in names.items()})
        members: dict[str, bytes] = {}
        payloads: dict[str, bytes] = {}
        for name, file in names.items():
            result = got.hits.get(name)
            if result is None:
                error = got.errors.get(name)
                if error is None:
                    tier.counters.count_miss()  # absent (or not answered): a plain miss
                else:
                    tier.record_read_failure(error)
                return None
            try:
                stored = bytes(result)
                data = opened(stored, self.key, file)
                if hashlib.sha256(data).hexdigest() != digests[file]:
                    raise EntryRejected(f"member {file} does not match its group record (corrupt or replaced)")
            except EntryRejected as exc:
                tier.record_read_failure(exc)
                return None
            members[file], payloads[file] = data, stored
        if set(members) != set(digests):
            return None
        for data in members.values():
            tier.counters.count_hit(len(data))
        return members, payloads


def _read_many(tier: Any, keys: Mapping[str, bytes]) -> BatchRead:
    """What reading ``keys`` (entry name -> key) got, by entry name: one batch where the tier is an entry
    store (every shared tier is); else one by one (a tier given in code, such as memory, where a read costs
    no round trip)."""
    if tier.entries is not None:
        try:
            return tier.entries.read_many(list(keys))
        except Exception as exc:  # read_many answers per entry; anything else is the tier failing
            return BatchRead.filed({}, dict.fromkeys(keys, exc))
    return BatchRead.reading(keys, lambda name: tier.backend.read_key(keys[name]))


def _read_local(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _reset_for_tests() -> None:
    """Forget the process's chain (it is not closed) and zero the local counters."""
    global _local, _remote
    _shared.forget()
    with _counters_lock:
        _local = TierCounters()
        _remote = TierCounters()
        _reported.clear()
#: Group lookups the shared tiers answered (``hits``: fetched whole) or not, after a local miss.
_remote = TierCounters()
_reported: set[tuple[int, str]] = set()  # (pid, cache directory) whose counters report at exit

