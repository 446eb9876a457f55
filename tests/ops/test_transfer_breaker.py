"""warm(names) and push(names) through a half-open breaker: a remote that failed and recovers is used again.

The issue: with the breaker half-open, ``warm(names)`` sent the probe inside a batch that
was abandoned, the probe's outcome was never recorded and the breaker stayed open for the
rest of the process. Each test drives a real async filesystem (every request fails while
``fs.failure`` is set) and an injected clock through fail -> half-open -> fail -> half-open
-> recover, and checks the breaker closes and the entries move.
"""

from __future__ import annotations

import pytest

from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.slowfs import SlowFileSystem
from tiered_progcache.chain.transfer import push, warm
from support import FakeClock

NAMES = [entry_name(f"k{i}".encode()) for i in range(5)]
COOLDOWN = 30.0


@pytest.fixture
def setup():
    clock = FakeClock()
    fs = SlowFileSystem()
    fs.mkdir("bucket")
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=COOLDOWN, clock=clock)
    remote = RemoteProgramCache(fs, "bucket/kernels", breaker=breaker, transfer_concurrency=2)
    yield clock, fs, breaker, remote
    remote.close()


def _go_down_and_half_open(clock: FakeClock, fs: SlowFileSystem, breaker: CircuitBreaker, remote) -> None:
    fs.failure = ConnectionError("remote down")
    with pytest.raises(ConnectionError):
        remote.read_entry(NAMES[0])
    assert breaker.state == "open"
    clock.now += COOLDOWN + 1
    assert breaker.state == "half-open"


def test_warm_with_names_on_a_half_open_breaker_records_the_probe_and_recovers(setup, tmp_path):
    clock, fs, breaker, remote = setup
    for i, name in enumerate(NAMES):
        remote.write_entry(name, b"payload %d" % i)
    local = LocalDir(tmp_path / "node")

    _go_down_and_half_open(clock, fs, breaker, remote)
    failed = warm(remote, local, NAMES)  # the probe fails: recorded, breaker opens for one more cooldown
    assert (failed.entries, failed.failures) == (0, len(NAMES))
    assert breaker.state == "open"
    clock.now += COOLDOWN + 1
    assert breaker.state == "half-open"  # not stuck: another probe may go

    fs.failure = None  # the remote recovers
    report = warm(remote, local, NAMES)
    assert (report.entries, report.failures) == (len(NAMES), 0)
    assert breaker.state == "closed"
    assert [local.read_entry(n) for n in NAMES] == [b"payload %d" % i for i in range(len(NAMES))]


def test_push_with_names_on_a_half_open_breaker_records_the_probe_and_recovers(setup, tmp_path):
    clock, fs, breaker, remote = setup
    local = LocalDir(tmp_path / "ci")
    for i, name in enumerate(NAMES):
        local.write_entry(name, b"\x7fELF\x02\x01" + bytes(46) + b"\x40\x00" + bytes(10) + bytes([i]))

    _go_down_and_half_open(clock, fs, breaker, remote)
    with pytest.raises(ConnectionError):  # the remote's listing is the probe: it fails, push says so
        push(local, remote, NAMES)
    assert breaker.state == "open"
    clock.now += COOLDOWN + 1
    assert breaker.state == "half-open"

    fs.failure = None
    report = push(local, remote, NAMES)
    assert (report.entries, report.failures) == (len(NAMES), 0)
    assert breaker.state == "closed"
    assert [remote.read_entry(n) for n in NAMES] == [local.read_entry(n) for n in NAMES]
