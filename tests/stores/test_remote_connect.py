"""A remote whose filesystem connects in its constructor (ftp://) costs one deadline, not 30 s.

The server is a loopback port that accepts connections and never says a word, so the
FTP client waits for its welcome line. The construction time is printed (``-s``) for
the report, not asserted against the wall clock; the assertions are on what the tier
says: a warning, an open breaker, the chain working local-only, a strict error naming the URL.
"""

from __future__ import annotations

import logging
import time

import pytest

from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.breaker import CircuitBreaker
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.testing.servers import blackhole_server  # noqa: F401
from support import FakeClock


def _ftp_url(server) -> str:
    port = server.endpoint_url.rsplit(":", 1)[1]
    return f"ftp://127.0.0.1:{port}/cache"


def test_a_silent_ftp_server_degrades_to_an_open_breaker(blackhole_server, caplog):
    url = _ftp_url(blackhole_server)
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=30, clock=clock, name=f"remote cache {url}")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tiered_progcache"):
        remote = RemoteProgramCache.from_url(url, timeout=1, breaker=breaker)
        assert remote.wait_ready(60)  # the probe runs beside the constructor
    print(f"\nftp:// construction with a silent server took {time.monotonic() - started:.2f} s (timeout 1 s)")
    assert remote.available is False and breaker.state == "open"
    assert any("no answer within 1 s" in r.getMessage() and url in r.getMessage() for r in caplog.records)
    clock.now += 31  # the next probe builds the filesystem again, under the deadline, and fails again
    with pytest.raises(TimeoutError, match="connecting to"):
        remote.read_entry("ab" * 32)
    assert breaker.state == "open"
    clock.now += 31
    assert breaker.state == "half-open"  # never stuck


def test_strict_raises_naming_the_url(blackhole_server):
    url = _ftp_url(blackhole_server)
    with pytest.raises(TimeoutError, match=f"remote cache {url}: no answer within 1 s"):
        RemoteProgramCache.from_url(url, timeout=1, strict=True)


def test_the_chain_works_local_only_behind_a_silent_ftp_server(blackhole_server, tmp_path):
    cache = TieredProgramCache(tmp_path / "node", remote=_ftp_url(blackhole_server), remote_timeout=1)
    cache[b"k"] = b"\x7fELF cubin"
    assert cache.get(b"k") == b"\x7fELF cubin"
    assert cache.stats()["remote"].hits == 0
    cache.close(timeout=5)
