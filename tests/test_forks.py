"""The one fork registry: every module's reset runs in a real forked child, each once, in order.

The child reports over a pipe what ran, so the parent's assertions see the child's state.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

import tiered_progcache
from tiered_progcache import forks

from support import in_forked_child

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

#: Each module that keeps state a child must reset, and the reset it registers.
MODULE_RESETS = {
    "tiered_progcache.stores.breaker._after_fork_in_child",
    "tiered_progcache.chain.defaultcache._forget_default_after_fork",
    "tiered_progcache.chain.exitbudget.ExitBudget._after_fork_in_child",
    "tiered_progcache.compiling.headermemo._new_lock_after_fork",
    "tiered_progcache.compiling.headerwatch._forget_after_fork",
    "tiered_progcache.cluster.locks._forget_flights_after_fork",
    "tiered_progcache.cluster.locks._drop_lock_fds_after_fork",
    "tiered_progcache.stores.runner._after_fork_in_child",
    "tiered_progcache.chain.writeback._after_fork_in_child",
}


def _name(reset) -> str:
    return f"{reset.__module__}.{reset.__qualname__}"


def test_every_modules_reset_is_registered_once_with_the_one_registry():
    import tiered_progcache.compiling.compile  # noqa: F401  (every module that registers, imported)
    import tiered_progcache.chain.defaultcache  # noqa: F401
    import tiered_progcache.cluster.locks  # noqa: F401
    import tiered_progcache.stores.runner  # noqa: F401
    import tiered_progcache.chain.writeback  # noqa: F401

    names = [_name(reset) for reset in forks.registered()]
    assert MODULE_RESETS <= set(names)
    assert len(names) == len(set(names))


def test_a_forked_child_runs_each_registered_reset_once_in_order_and_past_a_failing_one(monkeypatch):
    ran: list[str] = []
    registered = list(forks.registered())

    def recording(reset):
        def run() -> None:
            ran.append(_name(reset))
            reset()
        return run

    def failing() -> None:
        ran.append("failing")
        raise RuntimeError("a reset that fails")

    monkeypatch.setattr(forks, "_resets", [recording(r) for r in registered])
    forks.register(failing)
    forks.register(recording(lambda: None))
    held = threading.Lock()
    held.acquire()  # a lock the parent holds at the fork

    assert in_forked_child(lambda: ran) == [*(_name(r) for r in registered), "failing", _name(lambda: None)]
    assert ran == []  # the parent ran none of them
    held.release()


def test_a_child_gets_fresh_locks_where_a_parent_thread_held_one():
    from tiered_progcache.stores.breaker import CircuitBreaker

    breaker = CircuitBreaker(name="fork test")
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with breaker._lock:
            entered.set()
            leave.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait()
    try:
        # In the child the holder thread does not exist; without the reset this acquire never returns.
        assert in_forked_child(lambda: breaker._lock.acquire(timeout=30)) is True
    finally:
        leave.set()
        holder.join()


def test_no_module_but_forks_calls_register_at_fork():
    package = Path(tiered_progcache.__file__).parent
    callers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "os.register_at_fork(" in path.read_text(encoding="utf-8")
    )
    assert callers == ["forks.py"]


class _NamelessReset:
    """A callable without ``__qualname__``: the log names it by its repr."""

    def __call__(self) -> None:
        raise RuntimeError("a nameless reset that fails")

    def __repr__(self) -> str:
        return "<the nameless reset>"


def test_a_failing_reset_is_logged_in_the_child_by_name_with_its_traceback_and_the_rest_run(monkeypatch):
    records: list[tuple[str, str, bool]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.levelname, record.getMessage(), record.exc_info is not None))

    def failing() -> None:
        raise RuntimeError("a reset that fails")

    ran: list[str] = []
    monkeypatch.setattr(forks, "_resets", [])
    forks.register(failing)
    forks.register(_NamelessReset())
    forks.register(lambda: ran.append("after"))
    handler = Collect()
    logging.getLogger("tiered_progcache.forks").addHandler(handler)
    try:
        seen = in_forked_child(lambda: [records, ran])
    finally:
        logging.getLogger("tiered_progcache.forks").removeHandler(handler)
    assert seen == [
        [
            ["ERROR", f"fork reset {failing.__qualname__} failed in the child", True],
            ["ERROR", "fork reset <the nameless reset> failed in the child", True],
        ],
        ["after"],
    ]


def test_a_forked_child_can_register_resets_of_its_own():
    assert in_forked_child(lambda: forks.register(print) is print and forks.registered()[-1] is print) is True


def test_registering_what_cannot_be_called_is_a_type_error_naming_its_type():
    with pytest.raises(TypeError, match=r"^a fork reset must be callable, got int$"):
        forks.register(3)
