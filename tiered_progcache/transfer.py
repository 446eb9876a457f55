"""Bulk copies between a node's local directory and a shared tier, many requests at a time.

:func:`warm` fills a local directory from a shared store (at node boot), :func:`push`
uploads what the shared store lacks (at the end of a CI job). The shared side is any
:class:`~tiered_progcache.store.EntryStore` (the fsspec remote, Redis): entries move in
batches of its ``transfer_batch`` through its ``read_many``/``write_many`` (one request
batch each, through its request runner, where the store batches); a bad or unreadable
entry is counted and skipped, the rest still land.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Callable

from .envelope import InvalidEnvelope
from .errors import EntryRejected, one_line
from .localdir import LocalDir
from .store import EntryStore, check_entry_name

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


def warm(
    remote: EntryStore,
    local: LocalDir,
    names: Iterable[str] | None = None,
    *,
    progress: Progress | None = None,
) -> TransferReport:
    """Copy remote entries the local directory lacks into it, verified, many requests at a time.

    >>> report = warm(remote, LocalDir("/var/cache/kernels"), progress=lambda done, total: ...)

    ``names`` limits it to those entries (default: everything listed). A bad or
    unreadable entry is counted in ``failures`` and skipped; the rest still land.
    """
    started = time.perf_counter()
    wanted = _unique_names(names) if names is not None else [entry.name for entry in remote.iter_entries()]
    have = {entry.name for entry in local.iter_entries()}
    todo = [name for name in wanted if name not in have]
    done = moved = nbytes = failures = 0
    first_problem = ""
    _tell(progress, 0, len(todo))
    # Writes (fsync releases the GIL) run on threads, one batch behind the fetches, so the
    # disk and the network work at the same time.
    with concurrent.futures.ThreadPoolExecutor(LOCAL_WRITERS, thread_name_prefix="tiered-progcache-warm") as pool:
        landing: list[tuple[str, concurrent.futures.Future[int]]] = []
        for batch in [*_chunks(todo, remote.transfer_batch), []]:
            fetched = remote.read_many(batch) if batch else {}
            for name, future in landing:
                try:
                    nbytes += future.result()
                    moved += 1
                except Exception as exc:
                    failures += 1
                    first_problem = first_problem or f"{name[:12]}: {_describe(exc)}"
            if landing:
                done += len(landing)
                _tell(progress, done, len(todo))
            landing = [(name, pool.submit(_land, local, name, fetched[name])) for name in batch]
    if failures:
        logger.warning(
            "warm from %s: %d of %d entries failed (first: %s)", remote.location, failures, len(todo), first_problem
        )
    return TransferReport(moved, nbytes, time.perf_counter() - started, failures, len(wanted) - len(todo))


def push(
    local: LocalDir,
    remote: EntryStore,
    names: Iterable[str] | None = None,
    *,
    progress: Progress | None = None,
) -> TransferReport:
    """Upload local entries the remote lacks, as envelopes, many requests at a time.

    >>> report = push(LocalDir("/ci/cache"), remote, progress=bar.update_to)

    ``names`` limits it to those local entries (default: all). ``PermissionError``
    on a read-only remote.
    """
    if remote.read_only:
        raise PermissionError(f"remote cache {remote.location} is read-only; refusing to push")
    started = time.perf_counter()
    wanted = _unique_names(names) if names is not None else sorted(entry.name for entry in local.iter_entries())
    there = {entry.name for entry in remote.iter_entries()}
    todo = [name for name in wanted if name not in there]
    done = moved = nbytes = failures = 0
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
            payloads[name] = payload
            sizes[name] = len(payload)
        for name, error in remote.write_many(payloads).items():
            if error is None:
                moved += 1
                nbytes += sizes[name]
            else:
                failures += 1
                first_problem = first_problem or f"{name[:12]}: {_describe(error)}"
        done += len(batch)
        _tell(progress, done, len(todo))
    if failures:
        logger.warning(
            "push to %s: %d of %d entries failed (first: %s)", remote.location, failures, len(todo), first_problem
        )
    return TransferReport(moved, nbytes, time.perf_counter() - started, failures, len(wanted) - len(todo))


def _land(local: LocalDir, name: str, fetched: bytes | BaseException) -> int:
    """Write one fetched (already verified) payload into the local directory; its size."""
    if isinstance(fetched, BaseException):
        raise fetched
    local.write_entry(name, fetched)
    return len(fetched)


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
