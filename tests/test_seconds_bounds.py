"""Issue 28 item 18: every seconds setting has an upper bound every wait, timer and deadline can take.

Above :data:`~tiered_progcache.settings.MAX_SECONDS` (``inf``, ``1e10``, ``1e300``) a value is refused as
it is read, naming the setting and the fix, by keyword, variable, flag and ``compile()`` argument alike;
at the bound itself the real waits work: concurrent ``compile()`` calls waiting on each other, remote
requests under that timeout, and a lease renewed by a live thread.
"""

from __future__ import annotations

import functools
import threading

import pytest
from support import ARCH, run_cli_here

import tiered_progcache
from tiered_progcache import BatchWrite, CacheConfig, TieredProgramCache, settings
from tiered_progcache.cluster.lease import RemoteLease
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.runner import BATCH_PARALLELISM


@pytest.fixture
def cli(capsys):
    """The command's main in this process (tests/support.py, run_cli_here): no interpreter start per run."""
    return functools.partial(run_cli_here, capsys)


MAX = settings.MAX_SECONDS
TOO_LONG = [float("inf"), 1e10, 1e300, MAX + 1]
SECONDS_ROWS = [row for row in settings.SETTINGS if row.kind.name == "seconds"]


def test_the_bound_is_a_wait_the_platform_takes():
    assert MAX == 365 * 86400
    assert MAX < threading.TIMEOUT_MAX
    done = threading.Event()
    done.set()
    assert done.wait(MAX) is True  # taken as it is


def test_every_seconds_row_is_covered():
    assert {row.name for row in SECONDS_ROWS} >= {
        "remote_timeout", "wait_timeout", "lease_ttl", "exit_timeout", "header_recheck_s", "redis_expire_s",
        "min_upload_compile_s", "compile_time_prior_s",
    }  # fmt: skip


@pytest.mark.parametrize("row", SECONDS_ROWS, ids=lambda row: row.name)
@pytest.mark.parametrize("value", TOO_LONG, ids=["inf", "1e10", "1e300", "max+1"])
def test_every_seconds_row_refuses_a_value_above_the_bound(row, value):
    with pytest.raises(ValueError, match=f"^{row.name}: must be "):
        CacheConfig(**{row.name: value})
    if row.variable is not None:
        with pytest.raises(ValueError, match=f"^{row.variable}: must be ") as raised:
            CacheConfig.from_env({row.variable: repr(value)})
        if value != float("inf"):
            assert "at most 31536000 seconds" in str(raised.value)  # names the bound, so the fix is plain


@pytest.mark.parametrize("row", SECONDS_ROWS, ids=lambda row: row.name)
def test_every_seconds_row_takes_the_bound_itself(row):
    assert CacheConfig(**{row.name: MAX}).as_dict()[row.name] == MAX
    if row.variable is not None:
        assert CacheConfig.from_env({row.variable: "31536000"}).as_dict()[row.name] == MAX


@pytest.mark.parametrize("flag", ["--wait-timeout", "--remote-timeout", "--lease-ttl", "--exit-timeout"])
def test_the_command_refuses_a_flag_above_the_bound_at_once(cli, flag):
    result = cli("config", flag, "1e10")
    assert result.returncode == 2 and "at most 31536000 seconds" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("knob", ["wait_timeout", "lease_ttl", "header_recheck_s"])
def test_compile_refuses_a_knob_above_the_bound(tmp_path, knob):
    with TieredProgramCache(tmp_path) as cache, pytest.raises(ValueError, match=f"^{knob}: must be at most"):
        tiered_progcache.compile(_SOURCE, "c++", _options(), cache=cache, **{knob: 1e10})


_SOURCE = 'extern "C" __global__ void bound_k(int* out) { *out = 18; }\n'


def _options():
    from cuda.core import ProgramOptions

    return ProgramOptions(arch=ARCH)


def test_concurrent_compiles_waiting_up_to_the_bound_all_get_the_entry(tmp_path):
    """Before: wait_timeout=inf (accepted then) or 1e10 made 3 of 4 waiters raise OverflowError."""
    cache = TieredProgramCache(tmp_path, wait_timeout=MAX, lease_ttl=MAX)
    barrier, results, errors = threading.Barrier(4), [], []

    def work() -> None:
        barrier.wait(30)
        try:
            results.append(bytes(tiered_progcache.compile(_SOURCE, "c++", _options(), cache=cache).code))
        except BaseException as exc:  # noqa: BLE001 - the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cache.close()
    assert errors == [] and len(results) == 4 and len(set(results)) == 1


def test_remote_requests_and_batches_under_the_longest_timeout_work(tmp_path):
    """Before: REMOTE_TIMEOUT=1e12 made every request fail with OverflowError and nothing was uploaded."""
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()
    with TieredProgramCache(tmp_path / "node", remote=url, remote_timeout=MAX) as cache:
        cache[b"k"] = b"v" * 100
        assert cache.flush(30) is True
    remote = RemoteProgramCache.from_url(url, timeout=MAX)
    try:
        assert remote.read_key(b"k") == b"v" * 100
        assert remote.runner.batch_timeout(BATCH_PARALLELISM * 10**6) == MAX  # a huge batch: still a wait we can take
        names = {f"{n:064x}": b"x" for n in range(3)}
        assert remote.write_many(names) == BatchWrite(frozenset(names))
    finally:
        remote.close()


def test_a_lease_with_the_longest_ttl_is_renewed_by_a_live_thread(tmp_path):
    """Before: lease_ttl=1e12 killed the renewer thread (Event.wait overflowed)."""
    remote = RemoteProgramCache.from_url(f"file://{tmp_path / 'remote'}", create_root=True)
    holder = RemoteLease(remote.leases(), "ab" * 32, MAX)
    assert holder.try_acquire()
    try:
        renewers = [t for t in threading.enumerate() if t.name == "tiered-progcache-lease"]
        assert renewers and all(t.is_alive() for t in renewers)
        assert holder.renew()
    finally:
        holder.release()
        remote.close()


def test_redis_takes_the_longest_timeout_expiry_and_lease(tmp_path):
    """redis-py's socket timeouts, ``SET ... PX`` of the expiry and of a lease, all at the bound."""
    pytest.importorskip("redis")
    from tiered_progcache.stores.redis_store import RedisProgramCache
    from tiered_progcache.testing.redis_server import RedisServer

    with RedisServer() as server:
        tier = RedisProgramCache.from_url(server.url, timeout=MAX, expire_s=MAX, strict=True)
        try:
            tier.write_key(b"k", b"v" * 10)
            assert tier.read_key(b"k") == b"v" * 10
            holder = RemoteLease(tier.leases(), "cd" * 32, MAX)
            assert holder.try_acquire()
            try:
                assert [t for t in threading.enumerate() if t.name == "tiered-progcache-lease" and t.is_alive()]
                assert holder.renew()
            finally:
                holder.release()
        finally:
            tier.close()
