"""Bulk copies between a node's local directory and a remote tier, many requests at a time.

:func:`warm` fills a local directory from the remote (at node boot), :func:`push` uploads
what the remote lacks (at the end of a CI job). Each moves entries in batches of the
remote's ``transfer_concurrency`` through its request runner (one deadline per batch,
outcomes recorded on its breaker); a bad or unreadable entry is counted and skipped,
the rest still land.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Callable

from .codeobject import check_code_object
from .envelope import InvalidEnvelope
from .errors import EntryRejected, one_line
from .localdir import LocalDir
from .remote import RemoteProgramCache
from .store import check_entry_name

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
    remote: RemoteProgramCache,
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
    # Verify-and-write (hashing and fsync release the GIL) runs on threads, one batch behind
    # the fetches, so the disk and the network work at the same time.
    with concurrent.futures.ThreadPoolExecutor(LOCAL_WRITERS, thread_name_prefix="tiered-progcache-warm") as pool:
        landing: list[tuple[str, concurrent.futures.Future[int]]] = []
        for batch in [*_chunks(todo, remote.transfer_concurrency), []]:
            fetched = remote.read_envelopes(batch) if batch else {}
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
            landing = [(name, pool.submit(_land, remote, local, name, fetched[name])) for name in batch]
    if failures:
        logger.warning(
            "warm from %s: %d of %d entries failed (first: %s)", remote.location, failures, len(todo), first_problem
        )
    return TransferReport(moved, nbytes, time.perf_counter() - started, failures, len(wanted) - len(todo))


def push(
    local: LocalDir,
    remote: RemoteProgramCache,
    names: Iterable[str] | None = None,
    *,
    progress: Progress | None = None,
) -> TransferReport:
    """Upload local entries the remote lacks, as envelopes, many requests at a time.

    >>> report = push(LocalDir("/ci/cache"), remote, progress=bar.update_to)

    ``names`` limits it to those local entries (default: all). A local file that is not
    a whole code object (truncated, foreign) is counted in ``failures`` and never sealed.
    ``PermissionError`` on a read-only remote.
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
    for batch in _chunks(todo, remote.transfer_concurrency):
        blobs: dict[str, bytes] = {}
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
            problem = check_code_object(payload)
            if problem is not None:  # a truncated or foreign file: signing it would vouch for it
                failures += 1
                first_problem = first_problem or f"{name[:12]}: {problem}"
                continue
            blobs[name] = remote.seal_envelope(name, payload)
            sizes[name] = len(payload)
        for name, error in remote.write_envelopes(blobs).items():
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


def _land(remote: RemoteProgramCache, local: LocalDir, name: str, fetched: bytes | BaseException) -> int:
    """Verify one fetched envelope and write its payload into the local directory; its size."""
    if isinstance(fetched, BaseException):
        raise fetched
    payload = remote.open_envelope(name, fetched)
    local.write_entry(name, payload)
    return len(payload)


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
