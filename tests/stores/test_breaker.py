"""The circuit breaker's state machine, stepped with an injected clock (no sleeps)."""

from __future__ import annotations

import logging

import pytest

from tiered_progcache import TierUnavailable
from tiered_progcache.stores.breaker import DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD, CircuitBreaker
from support import FakeClock


def test_defaults_are_the_documented_ones():
    assert (DEFAULT_FAILURE_THRESHOLD, DEFAULT_COOLDOWN_S) == (3, 30.0)
    breaker = CircuitBreaker()
    assert (breaker.failure_threshold, breaker.cooldown_s, breaker.state) == (3, 30.0, "closed")


def test_a_success_resets_the_count_of_consecutive_failures():
    """fail, fail, ok, fail must not open a threshold-3 breaker: the failures are not consecutive."""
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=30, clock=FakeClock())
    for _ in range(2):
        breaker.record_failure(ConnectionError("x"))
    assert breaker.consecutive_failures == 2
    breaker.record_success()
    assert breaker.consecutive_failures == 0
    breaker.record_failure(ConnectionError("x"))
    breaker.record_failure(ConnectionError("x"))
    assert breaker.state == "closed" and breaker.consecutive_failures == 2
    breaker.before_call()  # goes through
    breaker.record_failure(ConnectionError("third in a row"))
    assert breaker.state == "open" and breaker.consecutive_failures == 3


def test_open_refuses_for_exactly_the_cooldown_then_lets_one_probe_through(caplog):
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=30, clock=clock, name="remote X")
    breaker.record_failure(ConnectionError("a"))
    breaker.before_call()
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.stores.breaker"):
        breaker.record_failure(ConnectionError("b"))
    assert [r.getMessage() for r in caplog.records] == [
        "remote X failed 2 times in a row (last: ConnectionError: b); skipping it for 30 s, then probing again"
    ]
    with pytest.raises(TierUnavailable, match=r"remote X skipped after 2 consecutive failures \(last: ConnectionError: b\); next probe in 30 s"):
        breaker.before_call()
    clock.now += 29.999
    assert breaker.state == "open"
    with pytest.raises(TierUnavailable, match="next probe in 0 s"):
        breaker.before_call()
    clock.now += 0.001
    assert breaker.state == "half-open"
    breaker.before_call()  # the probe
    assert breaker.state == "open"  # while the probe is out, everyone else is refused
    with pytest.raises(TierUnavailable):
        breaker.before_call()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.stores.breaker"):
        breaker.record_success()
    assert breaker.state == "closed" and breaker.consecutive_failures == 0
    assert [r.getMessage() for r in caplog.records] == ["remote X is reachable again; using it"]


def test_a_failed_probe_opens_for_another_full_cooldown():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.record_failure(ConnectionError("down"))
    clock.now += 10
    breaker.before_call()
    breaker.record_failure(ConnectionError("still down"))
    assert breaker.state == "open" and breaker.consecutive_failures == 2
    clock.now += 9.999
    assert breaker.state == "open"
    clock.now += 0.001
    assert breaker.state == "half-open"


def test_failures_of_calls_made_before_it_opened_do_not_extend_the_cooldown():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.record_failure(ConnectionError("first"))
    clock.now += 5
    breaker.record_failure(ConnectionError("a straggler"))  # a request sent before it opened
    clock.now += 5
    assert breaker.state == "half-open"


def test_trip_opens_at_once_for_one_cooldown():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=clock)
    breaker.trip(OSError("unreachable"))
    assert breaker.state == "open" and breaker.consecutive_failures == 3
    with pytest.raises(TierUnavailable, match="OSError: unreachable"):
        breaker.before_call()
    clock.now += 10
    assert breaker.state == "half-open"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"failure_threshold": True}, "failure_threshold"),
        ({"failure_threshold": 1.5}, "failure_threshold"),
        ({"cooldown_s": -1}, "cooldown_s"),
        ({"cooldown_s": float("inf")}, "cooldown_s"),
        ({"cooldown_s": True}, "cooldown_s"),
        ({"cooldown_s": "30"}, "cooldown_s"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CircuitBreaker(**kwargs)


def test_zero_cooldown_is_allowed():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=0, clock=clock)
    breaker.record_failure(ConnectionError("x"))
    assert breaker.state == "half-open"


def test_a_single_failure_then_a_success_starts_the_count_again():
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=30, clock=FakeClock())
    breaker.record_failure(ConnectionError("one"))
    breaker.record_success()
    assert breaker.consecutive_failures == 0
    breaker.record_failure(ConnectionError("a"))
    breaker.record_failure(ConnectionError("b"))
    assert breaker.state == "closed"


def test_the_default_name_is_remote():
    breaker = CircuitBreaker(failure_threshold=1)
    breaker.record_failure(ConnectionError("x"))
    with pytest.raises(TierUnavailable, match=r"^remote skipped after 1 consecutive failures"):
        breaker.before_call()
