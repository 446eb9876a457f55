"""The one exit budget, on an injected clock: the smallest allowance wins, the clock starts once, work stops in time."""

from __future__ import annotations

import threading

import pytest
from cuda.core.utils import InMemoryProgramCache

from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import exitbudget
from tiered_progcache.chain.exitbudget import TEARDOWN_RESERVE_S, ExitBudget
from tiered_progcache.settings import DEFAULT_EXIT_TIMEOUT_S
from support import FakeClock


def test_the_budget_is_the_default_until_allowed_and_then_the_smallest_allowance():
    budget = ExitBudget(FakeClock(100.0))
    assert budget.budget_s == DEFAULT_EXIT_TIMEOUT_S == 10.0
    budget.allow(30)
    assert budget.budget_s == 30.0  # one cache may ask for more than the default
    budget.allow(4.5)
    budget.allow(6)
    assert budget.budget_s == 4.5  # but never more than the smallest any cache asked for


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "5"])
def test_a_bad_allowance_is_a_value_error_naming_the_setting(bad):
    with pytest.raises(ValueError, match="exit_timeout"):
        ExitBudget().allow(bad)


def test_the_clock_starts_once_and_the_work_stops_the_teardown_reserve_before_the_budget():
    clock = FakeClock(100.0)
    budget = ExitBudget(clock)
    budget.allow(4)
    assert not budget.began
    assert budget.begin() == 100.0 + 4 - TEARDOWN_RESERVE_S
    assert budget.began
    clock.now += 3
    assert budget.begin() == 100.0 + 4 - TEARDOWN_RESERVE_S  # a second begin leaves the deadline
    assert budget.remaining() == pytest.approx(1 - TEARDOWN_RESERVE_S)
    clock.now += 10
    assert budget.remaining() == 0.0  # spent: never negative


def test_a_small_budget_keeps_at_least_half_of_itself_for_the_work():
    budget = ExitBudget(FakeClock(100.0))
    budget.allow(0.4)
    assert budget.begin() == pytest.approx(100.0 + 0.2)


def test_remaining_starts_the_clock_when_exit_work_asks_first():
    clock = FakeClock(100.0)
    budget = ExitBudget(clock)
    assert budget.remaining() == DEFAULT_EXIT_TIMEOUT_S - TEARDOWN_RESERVE_S
    assert budget.began


def test_join_waits_for_a_thread_that_ends_and_gives_up_on_one_that_hangs_once_the_budget_is_spent(cleanup):
    budget = ExitBudget(FakeClock(100.0))
    go, stuck = threading.Event(), threading.Event()
    cleanup.gate(go)
    cleanup.gate(stuck)  # the "hung" thread ends at teardown, not with the test process
    ends = cleanup.thread(go.wait)
    cleanup.join(threading.Timer(0, go.set)).start()
    assert budget.join(ends) is True  # before exit: waited for, however long it takes
    hangs = cleanup.thread(stuck.wait)
    budget.begin()
    budget._clock.now += 100  # type: ignore[attr-defined]  # the budget is spent
    assert budget.join(hangs) is False  # exit does not wait for it
    assert hangs.is_alive()


def test_a_cache_hands_its_exit_timeout_to_the_process_budget(monkeypatch):
    process = ExitBudget(FakeClock(100.0))
    monkeypatch.setattr(exitbudget, "PROCESS", process)
    TieredProgramCache(tiers=[InMemoryProgramCache()], exit_timeout=2.5)
    assert process.budget_s == 2.5
    with pytest.raises(ValueError, match="exit_timeout"):
        TieredProgramCache(tiers=[InMemoryProgramCache()], exit_timeout=0)
