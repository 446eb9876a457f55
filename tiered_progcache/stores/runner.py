"""The one door for requests to a remote store: a deadline on each, one circuit breaker over all.

Single reads and writes, listings, bulk transfers and lease operations of one remote
all go through its :class:`RequestRunner`, so they share one failure policy: the
breaker refuses requests while the remote is known to be down, and every request's
outcome (a bulk batch's included, a half-open probe's always) is recorded on it.

Deadlines are enforced two ways, picked per filesystem:

- async filesystems (s3fs, gcsfs, adlfs): the coroutine runs on the filesystem's own
  event loop under ``asyncio.wait_for`` (``fsspec.asyn.sync(..., timeout=)``), so a
  request that runs out of time is *cancelled*, not abandoned;
- blocking filesystems (local/NFS paths, memory://, sftp): the call runs on a small pool
  of daemon threads and the caller waits on its future with a timeout. A call made with
  ``stoppable=True`` gets a stop flag (a ``threading.Event``) as its first argument, set
  when its caller stops waiting, so a long read checks it between chunks and ends at
  its deadline. A call that never returns keeps its thread (Python cannot cancel a
  blocked thread) but not its caller; the pool is bounded, so a remote that hangs every call fills it, the next
  calls time out waiting for a thread, and the breaker opens. Daemon threads never
  hold up interpreter exit.

A request is written once, as a coroutine function over fsspec's coroutine methods
(``_cat_file``, ``_pipe_file``...): :meth:`RequestRunner.request` runs it on an async
filesystem's loop, and on a blocking one drives it to its end on a pool thread over
:class:`BlockingCalls`, the same names answered by the blocking methods (awaits that
never suspend). So there is no second, blocking twin of any request to keep in step.

The filesystem itself is built through the runner where a factory is given
(:class:`ClientFactory`): on first use, under the request deadline and the breaker (ftp://
and sftp connect in their constructor, gcsfs looks for credentials), so a remote that
cannot even be constructed costs one deadline, not 30 s. The first use is the probe's, on
a thread of its own, so the client library's import (:class:`DeferredFilesystemFactory`,
the Redis tier's own factory) runs there too, beside a fresh process's first compile.

Fork: a forked child cannot use the parent's threads, nor an async filesystem's event
loop and sessions (s3fs is not fork-safe). The fork registry (:mod:`.forks`) marks every runner;
in the child its thread pool starts empty and its filesystem is rebuilt on first use,
a new instance outside fsspec's instance cache (a blocking filesystem handed in by the
caller is kept: it holds no threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import queue
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Hashable, Iterator, Mapping
from typing import Any, Callable, Generic, Protocol, TypeVar

from .. import forks
from .breaker import CircuitBreaker
from ..errors import EntryRejected, InterpreterExiting
from ..settings import MAX_SECONDS
from .latency import LatencyTracker

logger = logging.getLogger(__name__)

__all__ = ["ANSWERS", "DEFERRED_PROTOCOLS", "PROBE_DEADLINES", "BatchOutcome", "BlockingCalls", "ClientFactory",
           "DeferredFilesystemFactory", "FilesystemFactory", "RequestRunner"]

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

#: Exceptions that are the remote's answer (a miss, an object already there, an object refused
#: while read), not its failure.
ANSWERS: tuple[type[BaseException], ...] = (FileNotFoundError, FileExistsError, EntryRejected)
#: Deadlines a store's first probe can take: the filesystem's construction and two requests (a file:// root
#: looked for, then made), each under the request deadline. A request waits for the probe at most this long.
PROBE_DEADLINES = 3
#: Requests of one batch that a connection pool is assumed to run side by side.
BATCH_PARALLELISM = 16
#: Python 3.12.0 to 3.12.2 refuse every new thread once the main thread has ended (3.12.3 starts them until
#: the non-daemon threads have exited, as 3.11 does): the exit flush cannot build a store's client there.
NO_THREADS_AT_EXIT = (3, 12, 0) <= sys.version_info[:3] < (3, 12, 3)


def exiting_refusal(exc: BaseException, what: str) -> InterpreterExiting | None:
    """``exc`` as :class:`~tiered_progcache.errors.InterpreterExiting` where it is the exiting interpreter refusing
    a thread or a pool a request needed (CPython's RuntimeErrors "can't create new thread at interpreter
    shutdown" and "cannot schedule new futures after interpreter shutdown"), else None."""
    if isinstance(exc, InterpreterExiting):
        return exc
    if not isinstance(exc, RuntimeError) or "interpreter shutdown" not in str(exc):
        return None
    advice = (": Python 3.12.0 to 3.12.2 start no thread once the main thread has ended; call flush() or close() "
              "before the process ends, or use Python 3.12.3 or later") if NO_THREADS_AT_EXIT else ""
    error = InterpreterExiting(f"{what} not made, the interpreter is exiting ({exc}){advice}")
    error.__cause__ = exc
    return error


@dataclasses.dataclass(frozen=True)
class BatchOutcome(Generic[K]):
    """What :meth:`RequestRunner.call_many` got, by the key of each call: its result, or what it raised.

    Two fields, so a caller reads which requests failed instead of testing each value's type;
    every key given is in exactly one of them.
    """

    results: dict[K, Any] = dataclasses.field(default_factory=dict)
    errors: dict[K, Exception] = dataclasses.field(default_factory=dict)


class ClientFactory(Protocol):
    """How a store's client is built on its first use, on the probe's thread: :class:`FilesystemFactory` for an
    fsspec filesystem, or a store's own (redis-py's client), whose library is then imported there too."""

    @property
    def is_async(self) -> bool:
        """True if the client's requests are coroutines on its own loop (an fsspec async filesystem)."""

    def build(self, fresh: bool = False) -> Any:
        """A client; ``fresh``: a new one, not one shared with the parent of a forked child."""


@dataclasses.dataclass(frozen=True)
class FilesystemFactory:
    """How to build one fsspec filesystem: its class and keyword arguments. Immutable.

    ``build(fresh=True)`` makes a new instance (``skip_instance_cache``): after a fork
    the parent's cached instance holds a dead event loop and sessions. Otherwise fsspec
    may hand back an equal instance it already holds (warm sessions, as ``url_to_fs``).
    """

    cls: type
    kwargs: Mapping[str, Any]

    @classmethod
    def like(cls, fs: Any) -> FilesystemFactory:
        """A factory that rebuilds ``fs`` from the options it was made with."""
        return cls(type(fs), dict(getattr(fs, "storage_options", {})))

    @property
    def protocols(self) -> frozenset[str]:
        """Every protocol name the class answers to (``s3`` and ``s3a``)."""
        return _protocol_names(self.cls)

    @property
    def storage_options(self) -> Mapping[str, Any]:
        """The options the filesystem is built with (its endpoint among them), as a deferred factory names them."""
        return self.kwargs

    @property
    def is_async(self) -> bool:
        """True for an fsspec async filesystem. Without fsspec imported there is none (the class would have
        imported it), so a client of another library (redis-py) costs no import of fsspec (25 ms)."""
        asyn = sys.modules.get("fsspec.asyn")
        return asyn is not None and issubclass(self.cls, asyn.AsyncFileSystem)

    def build(self, fresh: bool = False) -> Any:
        return self.cls(**{**self.kwargs, "skip_instance_cache": True}) if fresh else self.cls(**self.kwargs)


#: Object stores whose fsspec class (s3fs, gcsfs: their imports take hundreds of ms) is imported only where the
#: probe builds the filesystem, beside a fresh process's first compile (:class:`DeferredFilesystemFactory`):
#: URL scheme -> the class's protocol names. Each is an async filesystem whose paths are ``bucket/key``.
DEFERRED_PROTOCOLS: Mapping[str, frozenset[str]] = {
    "s3": frozenset({"s3", "s3a"}), "s3a": frozenset({"s3", "s3a"}),
    "gs": frozenset({"gs", "gcs"}), "gcs": frozenset({"gs", "gcs"}),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DeferredFilesystemFactory:
    """An object store's filesystem (a scheme of :data:`DEFERRED_PROTOCOLS`) whose class is imported when it is built.

    What the store needs before that is declared: the protocol names, an async filesystem, and
    ``root`` (the URL less its scheme, no trailing ``/``). The build checks each against the
    class; one that disagrees fails the build, so the tier stays down (its breaker open, the
    error logged) rather than read or write another path. Immutable.
    """

    scheme: str
    url: str
    root: str
    storage_options: Mapping[str, Any]

    @classmethod
    def for_url(cls, url: str, storage_options: Mapping[str, Any]) -> DeferredFilesystemFactory | None:
        """The factory for ``url`` if its scheme's class is deferred, else None (build it now, as before)."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in DEFERRED_PROTOCOLS:
            return None
        return cls(scheme, url, rest.rstrip("/"), dict(storage_options))

    @property
    def protocols(self) -> frozenset[str]:
        return DEFERRED_PROTOCOLS[self.scheme]

    @property
    def is_async(self) -> bool:
        return True

    def build(self, fresh: bool = False) -> Any:
        import fsspec
        from fsspec.asyn import AsyncFileSystem

        fs_class = fsspec.get_filesystem_class(self.scheme)
        found = (_protocol_names(fs_class), issubclass(fs_class, AsyncFileSystem),
                 fs_class._strip_protocol(self.url).rstrip("/"))  # fmt: skip
        if found != (self.protocols, True, self.root):
            raise ValueError(f"{fs_class.__module__}.{fs_class.__name__} is not what this tier took it for before "
                             f"importing it: protocols, async, path {found!r}, expected "
                             f"{(self.protocols, True, self.root)!r}; build the tier from an fsspec filesystem instead")
        kwargs = {**fs_class._get_kwargs_from_urls(self.url), **self.storage_options}
        return FilesystemFactory(fs_class, kwargs).build(fresh)


def _protocol_names(fs_class: type) -> frozenset[str]:
    protocol = fs_class.protocol  # type: ignore[attr-defined]
    return frozenset((protocol,) if isinstance(protocol, str) else protocol)


class RequestRunner:
    """Runs every request to one fsspec filesystem under a deadline and the remote's circuit breaker.

    >>> runner = RequestRunner(fs, timeout=5.0, breaker=CircuitBreaker(), name="remote cache s3://b/k")
    >>> blob = runner.call("read", fs.cat_file, fs._cat_file, path)

    Thread-safe. Blocking calls go to at most ``max_threads`` daemon threads, started on
    demand and reused; coroutines go to the filesystem's own loop (see module docstring).
    A timed-out request raises the builtin ``TimeoutError``; an open breaker raises
    :class:`~tiered_progcache.errors.TierUnavailable` without making the request.
    """

    def __init__(
        self,
        fs: Any | None,
        *,
        timeout: float,
        breaker: CircuitBreaker,
        name: str,
        max_threads: int = 8,
        factory: ClientFactory | None = None,
    ) -> None:
        if fs is None and factory is None:
            raise ValueError("RequestRunner needs a filesystem or a factory to build one")
        if factory is None:
            factory = FilesystemFactory.like(fs)
            self._rebuild_after_fork = factory.is_async  # a blocking one handed in is kept
        else:
            self._rebuild_after_fork = True
        self._factory = factory
        self._fs = fs
        self._async = factory.is_async
        self.timeout = timeout
        self.breaker = breaker
        self.name = name
        self._max_threads = max_threads
        self._threads = _DaemonThreads(max_threads, name=f"remote {name}")
        self._connect_lock = threading.Lock()
        self._forked = False
        self._probe: _Probe | None = None
        self._beside = _BesideProbe()
        #: Durations of single requests run under the per-request deadline (see :mod:`.latency`).
        self.latency = LatencyTracker()
        _RUNNERS.add(self)

    @property
    def is_async(self) -> bool:
        """True if requests run as coroutines on the filesystem's loop (cancelled at their deadline)."""
        return self._async

    @property
    def filesystem_protocols(self) -> frozenset[str]:
        """The protocol names of the filesystem's class, known before it is built (or its class imported)."""
        factory = self._factory
        if not isinstance(factory, (FilesystemFactory, DeferredFilesystemFactory)):
            raise TypeError(f"{self.name} is built by {type(factory).__name__}, not as an fsspec filesystem")
        return factory.protocols

    @property
    def built(self) -> Any | None:
        """The client if it is built, else None (never builds it: what closing needs)."""
        return self._fs

    @property
    def fs(self) -> Any:
        """The filesystem, built on first use under the deadline and the breaker.

        Raises ``TimeoutError`` (construction took past ``timeout``), ``TierUnavailable``
        (breaker open) or what the constructor raised (recorded on the breaker).
        """
        fs = self._fs
        if fs is not None:
            return fs
        self.breaker.before_call()
        try:
            fs = self._build()
        except BaseException as exc:
            self.breaker.record_failure(exc)
            raise
        self.breaker.record_success()  # built; a half-open probe's outcome is always recorded
        return fs

    def _build(self) -> Any:
        """The filesystem, built now if it is not yet (under the deadline); the caller keeps the breaker's books."""
        with self._connect_lock:
            if self._fs is None:
                build = functools.partial(self._factory.build, fresh=self._forked)
                self._fs = _in_daemon_thread(build, self.timeout, f"connecting to {self.name}")
            return self._fs

    def start_probe(self, probe: Callable[[], None], time_round_trip: Callable[[], None] | None = None) -> None:
        """Run ``probe`` (the store's first contact) on a thread of its own; other threads' requests wait for it.

        The client's construction and the first round trip then run beside the caller's first
        compile instead of before it. A request waits for the probe at most :data:`PROBE_DEADLINES`
        request deadlines (what the probe itself can take), then is made. The probe's own request opens
        the connection, which is not a round trip: ``R``'s first sample is the first request that
        waited for the probe (on the connection it opened), else ``time_round_trip``, one more
        request on the probe's thread once it has ended (no request waits for it).
        """
        self._probe = _Probe(probe, self.name, time_round_trip)

    @contextlib.contextmanager
    def beside_probe(self) -> Iterator[None]:
        """This thread's requests in the block go out beside the probe, not after it: each waits only for the
        client the probe builds, as any first request does (the boot fetch's listing), and leaves the breaker's
        books to the probe. While the breaker is not closed they wait for the probe as any other."""
        self._beside.active = True
        try:
            yield
        finally:
            self._beside.active = False

    def when_probed(self, then: Callable[[], None]) -> None:
        """Call ``then`` once the probe has ended: now if there is none or it has, else on its thread."""
        probe = self._probe
        if probe is None or not probe.add(then):
            then()

    def wait_probed(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the probe and its round-trip sample to end; True if
        they have (or there is no probe)."""
        probe = self._probe
        return probe is None or probe.timed.wait(None if timeout is None else min(timeout, threading.TIMEOUT_MAX))

    def _await_probe(self, sampled: bool) -> _Probe | None:
        """Wait for the probe (never on its own thread); the probe, if this request (``sampled``: one whose
        time is recorded) is to be ``R``'s first sample, in place of the probe thread's own request."""
        probe = self._probe
        if probe is None or probe.thread is threading.current_thread():
            return None
        claimed = sampled and not probe.done.is_set() and probe.claim_sample()  # once it ended: no lock taken
        probe.done.wait(self.timeout * PROBE_DEADLINES)  # as long as the probe can take, at most
        return probe if claimed else None

    def _after_fork_in_child(self) -> None:
        """In a forked child: no parent threads, and a filesystem rebuilt on first use where it cannot cross a fork."""
        self._threads = _DaemonThreads(self._max_threads, name=f"remote {self.name}")
        self._connect_lock = threading.Lock()
        self._probe = None  # the parent's probe thread is not in the child: its requests need not wait for it
        if self._rebuild_after_fork:
            self._fs = None
            self._forked = True

    def batch_timeout(self, requests: int) -> float:
        """The deadline for ``requests`` run side by side, allowing for a connection pool smaller than the batch.

        At most :data:`~tiered_progcache.settings.MAX_SECONDS`, so a large batch under a long timeout is a wait
        every platform takes.
        """
        return min(MAX_SECONDS, self.timeout * max(2, math.ceil(requests / BATCH_PARALLELISM)))

    def call(
        self,
        what: str,
        sync_fn: Callable[..., T],
        async_fn: Callable[..., Awaitable[T]] | None,
        *args: Any,
        timeout: float | None = None,
        stoppable: bool = False,
    ) -> T:
        """One request: ``async_fn(*args)`` on an async filesystem (when given), else ``sync_fn(*args)``.

        ``timeout`` defaults to the runner's per-request timeout. With ``stoppable``, each
        is called with a stop flag first, ``fn(stop, *args)`` (see the module docstring; on
        the loop it is never set, as the deadline cancels the coroutine). Raises
        what the request raised; a miss (``FileNotFoundError``), ``FileExistsError`` or an
        ``EntryRejected`` counts as an answer.
        """
        # Beside the probe (and only while the breaker is closed) a request neither waits for it nor keeps the
        # breaker's books: the probe alone says whether the store works, and an answer to a request sent before
        # it tripped the breaker must not close it again.
        beside = self._beside.active and self.breaker.state == "closed"
        sample_for = None if beside else self._await_probe(sampled=timeout is None)
        try:
            return self._call(what, sync_fn, async_fn, args, timeout, stoppable, books=not beside)
        finally:
            if sample_for is not None:  # R's first sample is in (or this request failed): wait_ready may return
                sample_for.sampled()

    def _call(self, what: str, sync_fn: Callable[..., T], async_fn: Callable[..., Awaitable[T]] | None,
              args: tuple[Any, ...], timeout: float | None, stoppable: bool, *, books: bool) -> T:
        limit = self.timeout if timeout is None else timeout
        self.breaker.before_call()
        what = f"{what} on {self.name}"
        started = time.monotonic()
        try:
            if self._fs is None:
                self._build()
                started = time.monotonic()
            if self._async and async_fn is not None:
                result = _run_async(self.fs.loop, async_fn, _with_stop(args, stoppable), limit, what)
            else:
                result = self._run_sync(sync_fn, args, limit, what, stoppable)
        except ANSWERS:
            self._answered(started, timeout, books)  # an answer: the remote works
            raise
        except BaseException as exc:  # a half-open probe's outcome is always recorded
            exiting = exiting_refusal(exc, what)
            if exiting is not None:  # the interpreter's refusal, not the store's answer: the breaker counts nothing
                raise exiting from exc
            if books:
                self.breaker.record_failure(exc)
            raise
        self._answered(started, timeout, books)
        return result

    def _answered(self, started: float, timeout: float | None, books: bool) -> None:
        """A request answered (a miss too): the breaker's success and, for one on the runner's deadline, a sample of
        ``R``. Neither for a request beside the probe (``books`` False): its connection may be new."""
        if not books:
            return
        if timeout is None:  # one round trip (listings and bulk calls pass their own deadline)
            self.latency.record(time.monotonic() - started)
        self.breaker.record_success()

    def call_many(
        self,
        what: str,
        sync_fn: Callable[..., Any],
        async_fn: Callable[..., Awaitable[Any]] | None,
        calls: Mapping[K, tuple[Any, ...]],
        *,
        timeout: float | None = None,
        stoppable: bool = False,
    ) -> BatchOutcome[K]:
        """Many requests side by side, one per argument tuple in ``calls`` (by key), under one deadline.

        Each key's result or the ``Exception`` its request raised (a refused or timed-out
        batch gives every key the same one); raises no ``Exception``, and raises what is
        not one (a request cancelled on its own) once the breaker has counted the batch.
        The batch is one pass through the breaker: if any request was answered the remote
        works (success, which closes a half-open breaker); if none was, each failed
        request counts as a failure. ``timeout`` defaults to :meth:`batch_timeout`;
        ``stoppable`` as for :meth:`call` (one stop flag for the batch).
        """
        if not calls:
            return BatchOutcome()
        limit = self.batch_timeout(len(calls)) if timeout is None else timeout
        self._await_probe(sampled=False)
        try:
            self.breaker.before_call()
        except Exception as exc:
            return BatchOutcome(errors=dict.fromkeys(calls, exc))
        what = f"{what} on {self.name}"
        try:
            if self._fs is None:
                self._build()
        except Exception as exc:  # could not even build the filesystem: the batch failed
            exiting = exiting_refusal(exc, what)
            if exiting is not None:
                return BatchOutcome(errors=dict.fromkeys(calls, exiting))
            self.breaker.record_failure(exc)
            return BatchOutcome(errors=dict.fromkeys(calls, exc))
        try:
            if self._async and async_fn is not None:
                on_loop = {key: _with_stop(args, stoppable) for key, args in calls.items()}
                results, errors = self._many_async(async_fn, on_loop, limit, what)
            else:
                results, errors = self._many_sync(sync_fn, calls, limit, what, stoppable)
        except BaseException as exc:  # abandoned (KeyboardInterrupt): a probe's outcome is still recorded
            exiting = exiting_refusal(exc, what)
            if exiting is not None:  # no thread for a request (what was queued before runs, unread)
                return BatchOutcome(errors=dict.fromkeys(calls, exiting))
            self.breaker.record_failure(exc)
            raise
        errors = {key: exiting_refusal(error, what) or error for key, error in errors.items()}
        if results or any(isinstance(error, ANSWERS) for error in errors.values()):
            self.breaker.record_success()
        else:
            for error in errors.values():
                if not isinstance(error, InterpreterExiting):
                    self.breaker.record_failure(error)
        failures: dict[K, Exception] = {}
        for key, error in errors.items():
            if not isinstance(error, Exception):
                raise error  # cancelled on its own (gather hands that back): raised, as call() raises it
            failures[key] = error
        return BatchOutcome(results, failures)

    def request(
        self,
        what: str,
        op: Callable[..., Awaitable[T]],
        *args: Any,
        timeout: float | None = None,
        stoppable: bool = False,
    ) -> T:
        """One request written once, as a coroutine function ``op(*args)``: :meth:`call` with ``op`` as both ways.

        On an async filesystem ``op`` runs on its loop, cancelled at the deadline; on a
        blocking one it is driven to its end on a pool thread, where it must await only
        :class:`BlockingCalls` (``RuntimeError`` if it suspends).
        """
        return self.call(what, functools.partial(_run_to_end, op), op, *args, timeout=timeout, stoppable=stoppable)

    def request_many(
        self,
        what: str,
        op: Callable[..., Awaitable[Any]],
        calls: Mapping[K, tuple[Any, ...]],
        *,
        timeout: float | None = None,
        stoppable: bool = False,
    ) -> BatchOutcome[K]:
        """:meth:`call_many` of one request written once (as :meth:`request`)."""
        return self.call_many(what, functools.partial(_run_to_end, op), op, calls, timeout=timeout, stoppable=stoppable)

    @property
    def calls(self) -> Any:
        """The filesystem's coroutine methods a :meth:`request` awaits: its own on an async filesystem,
        else :class:`BlockingCalls` over it."""
        fs = self.fs
        return fs if self._async else BlockingCalls(fs)

    def close(self) -> None:
        """Let the idle threads go; a later request starts fresh ones. A probe still in flight gets one request
        deadline to end first, so what it found is said (and remembered) before a short process exits."""
        self.wait_probed(self.timeout)
        self._threads.close()

    # -- internals ----------------------------------------------------------------------

    def _run_sync(
        self, fn: Callable[..., T], args: tuple[Any, ...], timeout: float, what: str, stoppable: bool = False
    ) -> T:
        stop = threading.Event()
        future = self._threads.submit(fn, *((stop, *args) if stoppable else args))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            if future.done() and not future.cancelled():
                raise  # fn's own TimeoutError (a socket timeout), not our deadline
            stop.set()  # a stoppable call ends at its next check
            future.cancel()  # still queued: never runs. Running: its thread finishes on its own.
            raise TimeoutError(f"{what} took longer than {timeout:g} s") from None

    def _many_sync(
        self, fn: Callable[..., Any], calls: Mapping[K, tuple[Any, ...]], timeout: float, what: str, stoppable: bool = False
    ) -> tuple[dict[K, Any], dict[K, BaseException]]:
        stop = threading.Event()
        futures = {key: self._threads.submit(fn, *((stop, *args) if stoppable else args)) for key, args in calls.items()}
        deadline = time.monotonic() + timeout
        results: dict[K, Any] = {}
        errors: dict[K, BaseException] = {}
        try:
            for key, future in futures.items():
                try:
                    results[key] = future.result(max(0.0, deadline - time.monotonic()))
                except concurrent.futures.TimeoutError as exc:
                    if future.done() and not future.cancelled():
                        errors[key] = exc  # the request's own TimeoutError
                    else:
                        stop.set()
                        future.cancel()
                        errors[key] = TimeoutError(f"{what} took longer than {timeout:g} s")
                except Exception as exc:
                    errors[key] = exc
        finally:
            if len(results) + len(errors) < len(futures):
                stop.set()
                for key, future in futures.items():
                    if key not in results and key not in errors:
                        future.cancel()
        return results, errors

    def _many_async(
        self, fn: Callable[..., Awaitable[Any]], calls: Mapping[K, tuple[Any, ...]], timeout: float, what: str
    ) -> tuple[dict[K, Any], dict[K, BaseException]]:
        """The batch on the loop; ``gather`` hands each request's exception back in its list, sorted here once."""
        keys = list(calls)

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(fn(*calls[key]) for key in keys), return_exceptions=True)

        try:
            gathered = _run_async(self.fs.loop, run_all, (), timeout, what)
        except Exception as exc:  # the whole batch: timed out, or the loop is gone
            return {}, dict.fromkeys(keys, exc)
        results: dict[K, Any] = {}
        errors: dict[K, BaseException] = {}
        for key, answer in zip(keys, gathered):
            if isinstance(answer, BaseException):
                errors[key] = answer
            else:
                results[key] = answer
        return results, errors


def _with_stop(args: tuple[Any, ...], stoppable: bool) -> tuple[Any, ...]:
    """``args`` with a stop flag first for a stoppable call on the loop (never set: its deadline cancels it)."""
    return (threading.Event(), *args) if stoppable else args


def _run_to_end(op: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``op(*args)`` run to its end on this thread: a request over :class:`BlockingCalls`, whose awaits never suspend."""
    coroutine = op(*args)
    try:
        coroutine.send(None)  # type: ignore[attr-defined]
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()  # type: ignore[attr-defined]
    raise RuntimeError(f"{_name_of(op)} suspended: a request over a blocking filesystem awaits only BlockingCalls")


def run_quietly_to_end(op: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """:func:`_run_to_end` for a request whose outcome nobody reads (a second connection's opening): its failure
    is logged at DEBUG, as the request beside it reports the same store's answer."""
    try:
        _run_to_end(op, *args)
    except Exception as exc:
        logger.debug("%s beside the probe failed: %r", _name_of(op), exc)


def _name_of(op: Callable[..., Any]) -> str:
    return getattr(op, "__qualname__", repr(op))


class BlockingCalls:
    """A blocking fsspec filesystem's methods under the coroutine names of ``AsyncFileSystem``.

    Each awaits nothing: it calls the blocking method and returns, so a request written
    over fsspec's coroutine methods runs unchanged on a blocking filesystem (driven to its
    end on a runner thread). Only the methods the remote tier's requests use.
    """

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self._fs.cat_file(path, start=start, end=end)

    async def _pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self._fs.pipe_file(path, value, **kwargs)

    async def _info(self, path: str) -> dict[str, Any]:
        return self._fs.info(path)

    async def _exists(self, path: str) -> bool:
        return self._fs.exists(path)

    async def _isdir(self, path: str) -> bool:
        return self._fs.isdir(path)

    async def _ls(self, path: str, detail: bool = True) -> list[Any]:
        return self._fs.ls(path, detail=detail)

    async def _find(self, path: str, detail: bool = False) -> Any:
        return self._fs.find(path, detail=detail)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._fs.makedirs(path, exist_ok=exist_ok)

    async def _mv(self, source: str, target: str) -> None:
        self._fs.mv(source, target)

    async def _rm_file(self, path: str) -> None:
        self._fs.rm_file(path)

    async def _rm(self, paths: list[str]) -> None:
        self._fs.rm(paths)

    def invalidate_cache(self, path: str | None = None) -> None:
        self._fs.invalidate_cache(path)


def _run_async(
    loop: Any, coro_fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], timeout: float, what: str
) -> T:
    """``await coro_fn(*args)`` on ``loop`` (a running loop in another thread), cancelled at ``timeout``."""
    from fsspec.asyn import sync
    from fsspec.exceptions import FSTimeoutError

    try:
        return sync(loop, coro_fn, *args, timeout=timeout)
    except FSTimeoutError:  # an asyncio.TimeoutError, not the builtin one before Python 3.11
        raise TimeoutError(f"{what} took longer than {timeout:g} s") from None


def _in_daemon_thread(fn: Callable[[], T], timeout: float, what: str) -> T:
    """``fn()`` on a new daemon thread, waited for at most ``timeout`` s (a hung constructor keeps only its thread)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)

    threading.Thread(target=run, name="tiered-progcache-connect", daemon=True).start()
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise
        raise TimeoutError(f"{what} took longer than {timeout:g} s") from None


class _BesideProbe(threading.local):
    """Per thread: whether its requests skip the wait for the probe (:meth:`RequestRunner.beside_probe`)."""

    active = False


class _Probe:
    """A store's first contact, run on a daemon thread, and what to call when it ends."""

    def __init__(self, probe: Callable[[], None], name: str, time_round_trip: Callable[[], None] | None) -> None:
        self.done = threading.Event()  # set once the probe and what waited for its end have run
        self.timed = threading.Event()  # set once R's first sample after it has been taken (or failed)
        self._lock = threading.Lock()
        self._ended = False
        self._claimed = False  # a request that waited for the probe is R's first sample
        self._then: list[Callable[[], None]] = []
        self.thread = threading.Thread(target=self._run, args=(probe, time_round_trip),
                                       name=f"tiered-progcache-probe {name}", daemon=True)
        self.thread.start()

    def add(self, then: Callable[[], None]) -> bool:
        """Keep ``then`` for the probe's end; False if it has ended (the caller calls it)."""
        with self._lock:
            if self._ended:
                return False
            self._then.append(then)
            return True

    def claim_sample(self) -> bool:
        """True for the first request to ask while the probe runs: it will be ``R``'s first sample, on the
        connection the probe opens, and the probe's thread makes no request of its own beside it."""
        with self._lock:
            if self._ended or self._claimed:
                return False
            self._claimed = True
            return True

    def sampled(self) -> None:
        """The claiming request has ended. If the probe outlived that request's wait, the claim is given back
        (the probe's thread takes the sample when it ends)."""
        with self._lock:
            if not self._ended:
                self._claimed = False
                return
        self.timed.set()

    def _run(self, probe: Callable[[], None], time_round_trip: Callable[[], None] | None) -> None:
        try:
            probe()
        except Exception:  # the probe records what it found on the breaker; anything else is a bug, said here
            logger.exception("probe of %s failed", self.thread.name)
        finally:
            with self._lock:
                self._ended = True
                then, self._then = self._then, []
                claimed = self._claimed
            for call in then:
                try:
                    call()
                except Exception:
                    logger.exception("after the probe of %s", self.thread.name)
            self.done.set()
            if not claimed:  # else the request that waited is the sample, and sets ``timed`` when it ends
                try:
                    if time_round_trip is not None:
                        time_round_trip()
                except Exception as exc:  # a request like any: the breaker has counted its failure
                    logger.debug("the round trip after the probe of %s failed: %r", self.thread.name, exc)
                finally:
                    self.timed.set()


_RUNNERS: weakref.WeakSet[RequestRunner] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for runner in list(_RUNNERS):
        runner._after_fork_in_child()


forks.register(_after_fork_in_child)


class _DaemonThreads:
    """At most ``max_threads`` daemon threads that run submitted calls; started on demand, reused."""

    def __init__(self, max_threads: int, *, name: str) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads!r}")
        self._max_threads = max_threads
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._jobs.put((future, fn, args))
            if self._idle == 0 and self._threads < self._max_threads:
                self._threads += 1
                try:
                    threading.Thread(
                        target=self._work,
                        args=(self._jobs,),
                        name=f"tiered-progcache-{self._name}-{self._threads}",
                        daemon=True,
                    ).start()
                except RuntimeError:  # no thread to be had (an exiting interpreter): the job is not run, not counted
                    self._threads -= 1
                    future.cancel()
                    raise
            elif self._idle:
                self._idle -= 1
        return future

    def close(self) -> None:
        """Let the threads go; a thread stuck in a call exits when the call returns.

        A later call starts fresh threads, so a closed runner still works (as cuda-core's
        tiers do after ``close()``).
        """
        with self._lock:
            jobs, threads = self._jobs, self._threads
            self._jobs = queue.SimpleQueue()
            self._threads = self._idle = 0
        for _ in range(threads):
            jobs.put(None)

    def _work(self, jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # handed to the waiting caller
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            with self._lock:
                if jobs is self._jobs:
                    self._idle += 1
