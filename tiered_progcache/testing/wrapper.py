"""A store that wraps any :class:`~tiered_progcache.stores.store.EntryStore` to inject faults and latency, and count calls.

Tests of what the chain promises when a store misbehaves need a store that misbehaves
on cue: fails the next two reads, holds one upload until the test lets it go, answers
slowly. Subclassing a real store for each case repeats the same few lines and reaches
into the subclass's internals; :class:`WrapperEntryStore` composes instead (zarr's
``WrapperStore``): it delegates every declared member to the store it wraps, and runs
each operation through the rules a test sets::

    store = WrapperEntryStore(RemoteProgramCache.from_url("memory://bucket/kernels"))
    store.fail("read_entry", ConnectionError("down"), times=2)  # the next two reads raise
    gate = store.hold("write_entry")                            # writes wait for gate.open()
    store.delay("iter_entries", 2.0)                            # through the injected sleep
    chain = TieredProgramCache(tiers=[InMemoryProgramCache(), store])
    ...
    assert store.calls["read_entry"] == 3

It is a tier wherever the wrapped store is one: the chain's keyed reads and writes
(``read_key``, ``write_key``, ...) are the interface's defaults over its own
``read_entry``/``write_entry``/``delete_entry``, so rules apply to them; with ``shared``
True it gets a shared tier's default policy.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from ..stores.store import STALE_STAGED_AGE_S, BatchRead, BatchWrite, EntryStore, LeaseStore, StoredEntry

__all__ = ["OPERATIONS", "Call", "Gate", "WrapperEntryStore"]

#: The operations a rule can name: the ``EntryStore`` methods that do I/O.
OPERATIONS = (
    "read_entry",
    "write_entry",
    "create_entry",
    "delete_entry",
    "iter_entries",
    "delete_listed",
    "delete_entries",
    "verify_entry",
    "read_many",
    "write_many",
    "sweep_staged",
    "leases",
)
#: How long a held call waits for its gate before it fails (so a test that forgets to open it cannot hang).
GATE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Call:
    """One call the wrapper saw: the operation and the entry names it was about (empty for a listing). Immutable."""

    operation: str
    names: tuple[str, ...]


class Gate:
    """Holds calls until opened: "the upload is still under way" as a state a test controls.

    ``arrived`` is set once a call reached the gate (so the test knows it is held there);
    ``held`` counts the calls that reached it. Safe across threads.
    """

    def __init__(self, timeout: float = GATE_TIMEOUT_S) -> None:
        self.arrived = threading.Event()
        self._open = threading.Event()
        self._timeout = timeout
        self._lock = threading.Lock()
        self.held = 0

    def open(self) -> None:
        """Let every held call go on, and every later one pass."""
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def wait_arrived(self, timeout: float = GATE_TIMEOUT_S) -> bool:
        """True once a call is held at (or went through) this gate, within ``timeout`` seconds."""
        return self.arrived.wait(timeout)

    def _pass(self, operation: str) -> None:
        with self._lock:
            self.held += 1
        self.arrived.set()
        if not self._open.wait(self._timeout):
            raise TimeoutError(f"{operation} was held {self._timeout:g} s and its gate never opened")


@dataclasses.dataclass
class _Rule:
    operations: frozenset[str]
    name: str | None
    times: int | None  # calls left to apply to; None: every call
    action: Callable[[str], None]
    raises: bool = False  # a fault: the call ends here, and later rules are not used up by it

    def applies(self, operation: str, names: tuple[str, ...]) -> bool:
        if operation not in self.operations or (self.times is not None and self.times <= 0):
            return False
        return self.name is None or self.name in names


def _operations(operations: str | Iterable[str]) -> frozenset[str]:
    chosen = frozenset([operations] if isinstance(operations, str) else operations)
    unknown = chosen - set(OPERATIONS)
    if not chosen or unknown:
        raise ValueError(f"operations must be some of {', '.join(OPERATIONS)}, got {sorted(chosen) or operations!r}")
    return chosen


class WrapperEntryStore(EntryStore):
    """``store`` with injected faults (:meth:`fail`), held calls (:meth:`hold`), latency (:meth:`delay`) and counts.

    >>> wrapped = WrapperEntryStore(LocalDir(tmp_path), sleep=clock.advance)
    >>> wrapped.fail("write_entry", OSError("disk full"), times=1)

    Every declared member of ``EntryStore`` is forwarded (``location``, ``read_only``,
    ``shared``, ``atomic_create``, ``available``, ``leases()``, ...); ``round_trip_s``
    too unless given. A call is counted in :attr:`calls` and logged in :attr:`log`
    before any rule runs, so a failed call counts. The rules that apply to a call run
    in the order they were set, up to the first fault, which raises (later rules are
    not used up by that call); otherwise the wrapped store answers. A rule with
    ``name`` applies only to calls about that entry; with ``times`` only to the next
    that many calls it applies to.

    Safe across threads as far as the wrapped store is; the rules and counts are
    locked. One process only (rules live in memory).
    """

    def __init__(
        self,
        store: EntryStore,
        *,
        sleep: Callable[[float], object] = time.sleep,
        round_trip_s: float | None = None,
    ) -> None:
        if not isinstance(store, EntryStore):
            raise TypeError(f"WrapperEntryStore wraps an EntryStore, got {type(store).__name__}")
        self.store = store
        self._sleep = sleep
        self._round_trip_s = round_trip_s
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        #: Calls per operation (see :data:`OPERATIONS`).
        self.calls: collections.Counter[str] = collections.Counter()
        #: Every call in order.
        self.log: list[Call] = []

    def __repr__(self) -> str:
        return f"WrapperEntryStore({self.store!r})"

    # -- rules ---------------------------------------------------------------------------

    def fail(
        self,
        operations: str | Iterable[str],
        exception: BaseException | type[BaseException],
        *,
        times: int | None = None,
        name: str | None = None,
    ) -> None:
        """Make ``operations`` raise ``exception`` (an instance, or a class built with a message) instead of running."""
        if not (isinstance(exception, BaseException)
                or isinstance(exception, type) and issubclass(exception, BaseException)):
            raise TypeError(f"exception must be an exception or its class, got {exception!r}")

        def raise_it(operation: str) -> None:
            if isinstance(exception, type):
                raise exception(f"injected fault in {operation}")
            raise exception

        self._add(operations, name, times, raise_it, raises=True)

    def hold(self, operations: str | Iterable[str], *, name: str | None = None, times: int | None = None,
             timeout: float = GATE_TIMEOUT_S) -> Gate:
        """Hold ``operations`` at a new :class:`Gate` until the test opens it; the gate."""
        gate = Gate(timeout)
        self._add(operations, name, times, gate._pass)
        return gate

    def delay(self, operations: str | Iterable[str], seconds: float, *, name: str | None = None,
              times: int | None = None) -> None:
        """Take ``seconds`` (through the ``sleep`` given at construction) before each of ``operations``."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
        self._add(operations, name, times, lambda operation: self._sleep(seconds))

    def clear_rules(self) -> None:
        """Drop every rule: the wrapper is a plain pass-through again (counts are kept)."""
        with self._lock:
            self._rules.clear()

    def reset_counts(self) -> None:
        """Forget the calls seen so far (:attr:`calls` and :attr:`log`); the rules stay."""
        with self._lock:
            self.calls.clear()
            self.log.clear()

    def names(self, *operations: str) -> list[str]:
        """The entry names the calls of ``operations`` were about, in call order."""
        chosen = _operations(operations)
        with self._lock:
            return [name for call in self.log if call.operation in chosen for name in call.names]

    def _add(self, operations: str | Iterable[str], name: str | None, times: int | None,
             action: Callable[[str], None], *, raises: bool = False) -> None:
        if times is not None and (isinstance(times, bool) or not isinstance(times, int) or times < 1):
            raise ValueError(f"times must be a positive int or None, got {times!r}")
        rule = _Rule(_operations(operations), name, times, action, raises)
        with self._lock:
            self._rules.append(rule)

    def _enter(self, operation: str, names: tuple[str, ...] = ()) -> None:
        """Count the call, then run the rules that apply to it (holds, delays, faults) in order."""
        with self._lock:
            self.calls[operation] += 1
            self.log.append(Call(operation, names))
            due = []
            for rule in self._rules:
                if rule.applies(operation, names):
                    if rule.times is not None:
                        rule.times -= 1
                    due.append(rule.action)
                    if rule.raises:
                        break
        for action in due:
            action(operation)

    # -- what the store is: forwarded ------------------------------------------------------

    @property
    def location(self) -> str:
        return self.store.location

    @property
    def read_only(self) -> bool:
        return self.store.read_only

    @property
    def shared(self) -> bool:
        return self.store.shared

    @property
    def atomic_create(self) -> bool:
        return self.store.atomic_create

    @property
    def namespace(self) -> str:
        return self.store.namespace

    @property
    def available(self) -> bool:
        return self.store.available

    @property
    def round_trip_s(self) -> float | None:
        """The round trip given at construction, else the wrapped store's."""
        return self._round_trip_s if self._round_trip_s is not None else self.store.round_trip_s

    def seed_round_trip(self, seconds: float) -> None:
        self.store.seed_round_trip(seconds)

    @property
    def request_timeout_s(self) -> float | None:
        return self.store.request_timeout_s

    @property
    def max_entry_bytes(self) -> int:
        return self.store.max_entry_bytes

    @property
    def transfer_batch(self) -> int:
        return self.store.transfer_batch

    # -- by entry name ---------------------------------------------------------------------

    def read_entry(self, name: str) -> bytes:
        self._enter("read_entry", (name,))
        return self.store.read_entry(name)

    def write_entry(self, name: str, payload: bytes) -> None:
        self._enter("write_entry", (name,))
        self.store.write_entry(name, payload)

    def create_entry(self, name: str, payload: bytes) -> bool:
        self._enter("create_entry", (name,))
        return self.store.create_entry(name, payload)

    def delete_entry(self, name: str) -> None:
        self._enter("delete_entry", (name,))
        self.store.delete_entry(name)

    def iter_entries(self) -> Iterator[StoredEntry]:
        self._enter("iter_entries")
        return self.store.iter_entries()

    def delete_listed(self, entry: StoredEntry) -> bool:
        self._enter("delete_listed", (entry.name,))
        return self.store.delete_listed(entry)

    def delete_entries(self, entries: Iterable[StoredEntry]) -> int:
        listed = list(entries)
        self._enter("delete_entries", tuple(entry.name for entry in listed))
        return self.store.delete_entries(listed)

    def verify_entry(self, name: str) -> str | None:
        self._enter("verify_entry", (name,))
        return self.store.verify_entry(name)

    def read_many(self, names: list[str]) -> BatchRead:
        self._enter("read_many", tuple(names))
        return self.store.read_many(names)

    def write_many(self, items: Mapping[str, bytes]) -> BatchWrite:
        self._enter("write_many", tuple(items))
        return self.store.write_many(items)

    def sweep_staged(self, older_than: float = STALE_STAGED_AGE_S, *, now: float | None = None) -> int:
        self._enter("sweep_staged")
        return self.store.sweep_staged(older_than, now=now)

    def leases(self) -> LeaseStore | None:
        self._enter("leases")
        return self.store.leases()

    def seal_record(self, name: str, payload: bytes) -> bytes:
        return self.store.seal_record(name, payload)

    def open_record(self, name: str, blob: bytes) -> bytes:
        return self.store.open_record(name, blob)

    def close(self) -> None:
        self.store.close()
