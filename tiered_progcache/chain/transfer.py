"""Bulk copies between a node's local directory and a shared tier, many requests at a time.

:func:`warm` fills a local directory from a shared store (at node boot), :func:`push`
uploads what the shared store lacks (at the end of a CI job). The shared side is any
:class:`~tiered_progcache.stores.store.EntryStore` (the fsspec remote, Redis): entries move in
batches of its ``transfer_batch`` through its ``read_many``/``write_many`` (one request
batch each, through its request runner, where the store batches); a bad or unreadable
entry is counted and skipped, the rest still land.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Callable

from ..stores.codeobject import check_code_object
from ..stores.kinds import KERNEL, kind_of
from ..stores.envelope import InvalidEnvelope
from ..errors import EntryRejected, one_line
from ..stores.localdir import LocalDir
from ..stores.store import BatchRead, EntryStore, StoredEntry, check_entry_name, manifest_name

__all__ = ["LOCAL_WRITERS", "Progress", "TransferReport", "push", "warm"]

logger = logging.getLogger(__name__)

#: Threads that verify and write fetched entries into the local directory during warm().
LOCAL_WRITERS = 8

#: Called as ``progress(done, total)``: at the start (0), after each batch, and at the end.
Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class TransferReport:
    """What one ``warm`` or ``push`` did: entries and payload bytes moved, failures, names already there. Immutable."""

    entries: int
    bytes: int
    seconds: float
    failures: int
    skipped: int
    #: How many of ``entries`` are manifests or symbol maps, not kernels (:mod:`~tiered_progcache.stores.kinds`).
    metadata: int = 0


def warm(
    remote: EntryStore,
    local: LocalDir,
    names: Iterable[str] | None = None,
    *,
    max_bytes: int | None = None,
    progress: Progress | None = None,
    landed: Callable[[bytes, str], object] | None = None,
    stop: threading.Event | None = None,
) -> TransferReport:
    """Copy remote entries the local directory lacks into it, verified, many requests at a time.

    >>> report = warm(remote, LocalDir("/var/cache/kernels"), max_bytes=20 << 30)   # at node boot

    What the node needs: ``names`` (e.g. the names an earlier run of the job left in
    its local directory, ``tiered-progcache ls``), read without listing the remote; else
    everything one listing shows, newest first, and with ``max_bytes`` only the newest
    entries whose stored sizes add up to at most that (entries already here count, so a
    node's working set fits its local cap). From a listing, the manifests of listed
    binaries are left behind (a hit never reads them; ``explain`` reads them remotely),
    so a boot fetches one object per kernel, plus the direct manifests (listed like entries:
    :mod:`~tiered_progcache.compiling.direct`), so a header-heavy kernel's first hit asks nothing. Then one concurrent batch of reads per
    ``transfer_batch`` entries (one batch for a node's few hundred kernels). A bad or
    unreadable entry is counted in ``failures`` and skipped; the rest still land. ``landed(payload,
    kind)`` is called with each entry written, on a writer thread. Once ``stop`` is set, what was
    read lands and nothing more is read.
    """
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"max_bytes must be an int (bytes) or None, got {type(max_bytes).__name__}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if names is not None:
            raise ValueError("give names or max_bytes, not both: a byte budget picks from the remote's listing")
    started = time.perf_counter()
    wanted = _unique_names(names) if names is not None else _newest_first(_without_manifests(remote), max_bytes)
    have = {entry.name for entry in local.iter_entries()}
    todo = [name for name in wanted if name not in have]
    done = moved = nbytes = failures = metadata = 0
    first_problem = ""
    _tell(progress, 0, len(todo))
    # Writes (fsync releases the GIL) run on threads, one batch behind the fetches, so the
    # disk and the network work at the same time.
    with concurrent.futures.ThreadPoolExecutor(LOCAL_WRITERS, thread_name_prefix="tiered-progcache-warm") as pool:
        landing: list[tuple[str, concurrent.futures.Future[int]]] = []
        for batch in [*_chunks(todo, remote.transfer_batch), []]:
            if stop is not None and stop.is_set():
                batch = []
            fetched = remote.read_many(batch) if batch else BatchRead()
            for name, future in landing:
                try:
                    size, kind = future.result()
                    nbytes += size
                    moved += 1
                    metadata += kind != KERNEL
                except Exception as exc:
                    failures += 1
                    first_problem = first_problem or f"{name[:12]}: {_describe(exc)}"
            if landing:
                done += len(landing)
                _tell(progress, done, len(todo))
            landing = [
                (name, pool.submit(_land, local, name, fetched.hits.get(name), fetched.errors.get(name), landed))
                for name in batch
            ]
            if not batch:
                break
    if failures:
        logger.warning(
            "warm from %s: %d of %d entries failed (first: %s)", remote.location, failures, len(todo), first_problem
        )
    return TransferReport(moved, nbytes, time.perf_counter() - started, failures, len(wanted) - len(todo), metadata)


def push(
    local: LocalDir,
    remote: EntryStore,
    names: Iterable[str] | None = None,
    *,
    progress: Progress | None = None,
) -> TransferReport:
    """Upload local entries the remote lacks, as envelopes, many requests at a time.

    >>> report = push(LocalDir("/ci/cache"), remote, progress=bar.update_to)

    ``names`` limits it to those local entries (default: all). A local file that is a
    cubin or fatbin cut short, or empty, is counted in ``failures`` and never sealed.
    ``PermissionError`` on a read-only remote.
    """
    if remote.read_only:
        raise PermissionError(f"remote cache {remote.location} is read-only; refusing to push")
    started = time.perf_counter()
    wanted = _unique_names(names) if names is not None else sorted(entry.name for entry in local.iter_entries())
    there = {entry.name for entry in remote.iter_entries()}
    todo = [name for name in wanted if name not in there]
    done = moved = nbytes = failures = metadata = 0
    first_problem = ""
    _tell(progress, 0, len(todo))
    for batch in _chunks(todo, remote.transfer_batch):
        payloads: dict[str, bytes] = {}
        sizes: dict[str, int] = {}
        for name in batch:
            try:
                payload = local.read_entry(name)
            except EntryRejected as exc:
                failures += 1
                first_problem = first_problem or f"{name[:12]}: {exc.args[0] if exc.args else exc}"
                continue
            except KeyError:  # pruned since it was listed
                failures += 1
                first_problem = first_problem or f"{name[:12]}: gone from the local directory"
                continue
            problem = check_code_object(payload, unknown_ok=True)
            if problem is not None:  # a cut-short cubin, fatbin or nothing: signing it would vouch for it
                failures += 1
                first_problem = first_problem or f"{name[:12]}: {problem}"
                continue
            payloads[name] = payload
            sizes[name] = len(payload)
        wrote = remote.write_many(payloads)
        for name in payloads:
            if name in wrote.written:
                moved += 1
                nbytes += sizes[name]
                metadata += kind_of(payloads[name]) != KERNEL
            elif name in wrote.errors:
                failures += 1
                first_problem = first_problem or f"{name[:12]}: {_describe(wrote.errors[name])}"
        done += len(batch)
        _tell(progress, done, len(todo))
    if failures:
        logger.warning(
            "push to %s: %d of %d entries failed (first: %s)", remote.location, failures, len(todo), first_problem
        )
    return TransferReport(moved, nbytes, time.perf_counter() - started, failures, len(wanted) - len(todo), metadata)


def _without_manifests(remote: EntryStore) -> list[StoredEntry]:
    """One listing, less the entries that are the manifest of another listed entry (named after it)."""
    entries = list(remote.iter_entries())
    manifests = {manifest_name(entry.name) for entry in entries}
    return [entry for entry in entries if entry.name not in manifests]


def _newest_first(entries: Iterable[StoredEntry], max_bytes: int | None) -> list[str]:
    """Entry names, most recently written first (unknown times last); with a budget, the newest that fit in it."""
    ordered = sorted(entries, key=lambda e: (e.mtime is None, -(e.mtime or 0.0), e.name))
    if max_bytes is None:
        return [entry.name for entry in ordered]
    picked, total = [], 0
    for entry in ordered:
        if total + entry.size > max_bytes:
            break
        picked.append(entry.name)
        total += entry.size
    return picked


def _land(local: LocalDir, name: str, fetched: bytes | None, failure: Exception | None,
          landed: Callable[[bytes, str], object] | None) -> tuple[int, str]:
    """Write one fetched (already verified) payload into the local directory, tell ``landed``; its size and kind.
    Raises ``failure``, why it was not fetched, where it was not."""
    if fetched is None:
        raise failure if failure is not None else KeyError(name)
    local.write_entry(name, fetched)
    kind = kind_of(fetched)
    if landed is not None:
        landed(fetched, kind)
    return len(fetched), kind


def _unique_names(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(check_entry_name(n) for n in names))


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _tell(progress: Progress | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, InvalidEnvelope) else one_line(exc)
