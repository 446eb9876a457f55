"""Trimming an entry store to an age limit and a size cap, oldest entries first.

Works on any :class:`~tiered_progcache.stores.store.EntryStore` through its listing and
:meth:`~tiered_progcache.stores.store.EntryStore.delete_listed`, so the local directory and a
shared bucket are pruned by the same code. Age is time since
:attr:`~tiered_progcache.stores.store.StoredEntry.last_used`: since the last read or write
where the store records reads (the local directory), since the write otherwise.
An entry a writer replaced after the listing is left alone (``delete_listed``'s guard).

A kernel, its manifest and its symbol map (each known by name from the listing) are planned
as one unit: by the kernel's age and their sizes together, and deleted together, the kernel
first. A manifest or map left behind would be fetched by the next ``warm`` and describe nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from ..compiling.manifest import manifest_name
from ..compiling.symbols import symbols_name
from ..errors import one_line
from ..stores.store import EntryStore, StoredEntry

__all__ = ["PruneCandidate", "PruneReport", "plan_prune", "prune"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PruneCandidate:
    """A listed entry and its age in seconds at planning time (None where the store gives no time)."""

    entry: StoredEntry
    age: float | None

    @property
    def size(self) -> int:
        return self.entry.size


@dataclasses.dataclass(frozen=True)
class PruneReport:
    """What one prune planned and did. Immutable.

    ``doomed`` is oldest first. On a dry run nothing is deleted: ``removed``,
    ``changed``, ``failed`` and ``swept`` stay empty. ``swept`` counts staged files of
    writers that died, removed with the entries (:meth:`EntryStore.sweep_staged`).
    """

    location: str
    listed: int
    listed_bytes: int
    doomed: tuple[PruneCandidate, ...]
    dry_run: bool
    removed: int = 0
    changed: int = 0  # changed or gone since listed, so left alone
    failed: tuple[tuple[str, str], ...] = ()  # (entry name, why the delete failed)
    swept: int = 0  # stale staged files removed

    @property
    def doomed_bytes(self) -> int:
        return sum(c.size for c in self.doomed)


def _oldest_first(candidate: PruneCandidate) -> float:
    # An entry of unknown age sorts as the youngest.
    return -1.0 if candidate.age is None else candidate.age


def plan_prune(
    entries: Iterable[StoredEntry],
    *,
    now: float,
    older_than: float | None = None,
    max_bytes: int | None = None,
) -> list[PruneCandidate]:
    """Which entries go: all older than ``older_than``, then the oldest until ``max_bytes`` fit.

    An entry of unknown age is never "older than" anything and goes last for ``max_bytes``.
    """
    candidates = [PruneCandidate(e, None if e.last_used is None else now - e.last_used) for e in entries]
    doomed = [c for c in candidates if older_than is not None and c.age is not None and c.age > older_than]
    if max_bytes is not None:
        gone = {id(c) for c in doomed}
        rest = sorted((c for c in candidates if id(c) not in gone), key=_oldest_first, reverse=True)
        held = sum(c.size for c in rest)
        for c in rest:
            if held <= max_bytes:
                break
            doomed.append(c)
            held -= c.size
    return sorted(doomed, key=_oldest_first, reverse=True)


def _units(entries: list[StoredEntry]) -> tuple[list[StoredEntry], dict[str, tuple[StoredEntry, ...]]]:
    """The entries to plan with, a kernel and its metadata as one (the kernel's name and age, all the
    sizes), and for each kernel that has metadata listed, (kernel, manifest and/or symbol map)."""
    by_name = {e.name: e for e in entries}
    units: dict[str, tuple[StoredEntry, ...]] = {}
    taken: set[str] = set()
    for e in entries:
        metadata = tuple(m for m in (by_name.get(manifest_name(e.name)), by_name.get(symbols_name(e.name)))
                         if m is not None and m.name not in taken and m.name != e.name)  # fmt: skip
        if metadata and e.name not in taken:
            units[e.name] = (e, *metadata)
            taken.update(m.name for m in metadata)
    planned = [dataclasses.replace(e, size=sum(m.size for m in units[e.name])) if e.name in units else e
               for e in entries if e.name not in taken or e.name in units]  # fmt: skip
    return planned, units


def prune(
    store: EntryStore,
    *,
    older_than: float | None = None,
    max_bytes: int | None = None,
    now: float | None = None,
    dry_run: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> PruneReport:
    """Plan the prune of ``store`` from one listing and, unless ``dry_run``, delete what it names.

    A delete that fails is reported in ``failed`` and the rest still go. A store that is
    read-only here raises ``PermissionError`` before anything is listed (dry runs are allowed).
    A real run also sweeps files staged over an hour before ``now`` by writers that died.
    ``progress(done, total)`` is called after each delete (the command's progress bar).
    """
    if not dry_run and store.read_only:
        raise PermissionError(f"{store.location} is read-only here: cannot prune it")
    if now is None:
        now = time.time()
    entries = list(store.iter_entries())
    planned, units = _units(entries)
    doomed = [PruneCandidate(member, unit.age)
              for unit in plan_prune(planned, now=now, older_than=older_than, max_bytes=max_bytes)
              for member in units.get(unit.entry.name, (unit.entry,))]  # fmt: skip
    report = PruneReport(
        location=store.location,
        listed=len(entries),
        listed_bytes=sum(e.size for e in entries),
        doomed=tuple(doomed),
        dry_run=dry_run,
    )
    if dry_run:
        return report
    removed = changed = 0
    failed: list[tuple[str, str]] = []
    for done, candidate in enumerate(doomed, start=1):
        try:
            if store.delete_listed(candidate.entry):
                removed += 1
            else:
                changed += 1
        except Exception as exc:  # one entry's failure (permissions, a timeout) does not stop the rest
            logger.debug("could not remove %s from %s: %s", candidate.entry.name, store.location, one_line(exc))
            failed.append((candidate.entry.name, str(exc)))
        if progress is not None:
            progress(done, len(doomed))
    try:
        swept = store.sweep_staged(now=now)
    except Exception as exc:  # the entries are pruned; debris waits for the next run
        logger.warning("could not sweep staged files in %s: %s", store.location, one_line(exc))
        swept = 0
    return dataclasses.replace(report, removed=removed, changed=changed, failed=tuple(failed), swept=swept)
