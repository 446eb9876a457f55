"""What the configuration builds: the shared tiers' names, settings and breakers, the local directory's fallback,
the settings ``from_env``/``from_config`` pass on, and the type checks of the APIs that hold a chain.

Real ``file://`` remotes and a refused Redis port; no server needed.
"""

from __future__ import annotations

import logging

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache.chain.downmemo import DownMemo
from tiered_progcache.chain.tiered import default_chain, require_chain, shared_chain, shared_tier
from tiered_progcache.configvalues import ConfigValues
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.testing.redis_server import free_port
from tiered_progcache.errors import one_line


def _refused_redis_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: a connection is refused


# -- the shared tiers ---------------------------------------------------------------------------


def test_three_remotes_of_one_kind_are_named_remote_remote2_remote3(tmp_path):
    urls = [(tmp_path / f"r{n}").as_uri() for n in range(3)]
    specs = shared_chain(ConfigValues(remote=tuple(urls), create_remote_root=True))
    assert [policy.name for _, policy in specs] == ["remote", "remote2", "remote3"]
    assert all(policy.shared and policy.write == "background" for _, policy in specs)


@pytest.mark.parametrize("setting, argument, created", [
    (False, None, False), (True, None, True), (True, False, False), (False, True, True),
])
def test_create_root_overrides_the_setting_and_none_means_the_setting(tmp_path, setting, argument, created):
    root = tmp_path / "missing"
    shared, kind = shared_tier(ConfigValues(create_remote_root=setting), root.as_uri(), create_root=argument)
    assert shared.wait_ready(60)  # the probe runs beside the constructor
    assert kind == "remote" and root.is_dir() is created
    assert shared.breaker.state == ("closed" if created else "open")  # a missing root is an outage


@pytest.mark.parametrize("url, kind", [("redis", "redis"), ("file", "remote")])
def test_a_tier_found_down_by_another_process_starts_open_under_its_kind_and_masked_url(tmp_path, url, kind):
    url = _refused_redis_url().replace("redis://", "redis://:pw@") if url == "redis" else (tmp_path / "r").as_uri()
    memo = DownMemo(tmp_path / "local")
    memo.remember(url, "refused")
    shared, built_kind = shared_tier(ConfigValues(), url, down_memo=memo)
    assert built_kind == kind and shared.breaker.state == "open"
    shown = url.replace(":pw@", ":***@")
    assert shared.breaker.name == f"{kind} cache {shown}"
    assert "pw" not in shared.breaker.name


def test_a_redis_tier_takes_the_chain_settings(tmp_path):
    memo = DownMemo(tmp_path / "local")
    url = _refused_redis_url()
    memo.remember(url, "refused")  # starts open: nothing connects
    shared, kind = shared_tier(ConfigValues(remote_read_only=True, remote_timeout=7.5), url, namespace="triton",
                               down_memo=memo)  # fmt: skip
    assert kind == "redis" and shared.read_only and shared.timeout == 7.5


def test_the_default_chain_remembers_a_failed_probe_in_its_local_directory(tmp_path):
    url = _refused_redis_url()
    cache = TieredProgramCache(tmp_path / "local", remote=url, remote_timeout=2.0)
    try:
        assert cache.shared_store.wait_ready(60)  # the probe runs beside the constructor
        assert cache.shared_store.breaker.state == "open"
        recalled = DownMemo(tmp_path / "local").recall(url)
        assert recalled is not None and "refused" in recalled[0].lower()
    finally:
        cache.close()
    specs = shared_chain(ConfigValues(remote=url), down_memo=DownMemo(tmp_path / "local"))
    assert specs[0][0].breaker.state == "open"  # the next chain on this node does not probe again


def test_an_unusable_local_directory_is_left_out_with_one_warning_naming_it(tmp_path, caplog):
    (tmp_path / "file").write_bytes(b"")
    root = tmp_path / "file" / "cache"
    try:
        FileStreamProgramCache(root)
    except OSError as exc:
        why = one_line(exc)
    with caplog.at_level(logging.WARNING, "tiered_progcache.chain.tiered"):
        specs = default_chain(ConfigValues(local_dir=root))
    assert [policy.name for _, policy in specs] == ["memory"]
    assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.chain.tiered"] == [
        f"local cache directory {root} is unusable, running without the local tier: {why}"
    ]


# -- from_env / from_config ---------------------------------------------------------------------


def test_from_env_overrides_are_used(tmp_path):
    with TieredProgramCache.from_env({}, local_dir=tmp_path / "here") as cache:
        assert cache.local_store.location == str(tmp_path / "here")


def test_from_config_with_tiers_keeps_the_chain_wide_settings(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    config = ConfigValues(min_upload_compile_s=100.0)
    tiers = [(InMemoryProgramCache(), TierPolicy("memory")), shared_tier(config, remote.as_uri())[0]]
    with TieredProgramCache.from_config(config, tiers=tiers) as cache:
        cache.put(b"k" * 32, b"cubin", compile_seconds=1.0)  # under the threshold: not uploaded
        cache.flush(60)
        assert list(cache.shared_store.iter_entries()) == [] and cache.get(b"k" * 32) == b"cubin"


# -- what holds a chain, and what a put accepts --------------------------------------------------


def test_require_chain_says_what_it_needs_word_for_word(tmp_path):
    with pytest.raises(TypeError) as plain:
        require_chain(5)
    assert str(plain.value) == "cache must be a TieredProgramCache, got int"
    with pytest.raises(TypeError) as named:
        require_chain(InMemoryProgramCache(), "metrics.register's cache", none_ok=True)
    assert str(named.value) == "metrics.register's cache must be a TieredProgramCache or None, got InMemoryProgramCache"
    with pytest.raises(TypeError):
        require_chain(None)  # None only with none_ok
    require_chain(None, none_ok=True)
    with TieredProgramCache(tiers=[InMemoryProgramCache()]) as cache:
        require_chain(cache)


def test_repr_names_each_tier_and_its_resource(tmp_path):
    with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path)]) as cache:
        assert repr(cache) == "TieredProgramCache(memory:InMemoryProgramCache -> local:FileStreamProgramCache)"


@pytest.mark.parametrize("seconds", [0, 0.0, 2.5])
def test_put_accepts_zero_and_finite_compile_seconds(tmp_path, seconds):
    with TieredProgramCache(tiers=[InMemoryProgramCache()]) as cache:
        cache.put(b"k" * 32, b"cubin", compile_seconds=seconds)
        assert cache.get(b"k" * 32) == b"cubin"


@pytest.mark.parametrize("seconds, error, message", [
    (float("inf"), ValueError, "compile_seconds must be a non-negative, finite number, got inf"),
    (-1.0, ValueError, "compile_seconds must be a non-negative, finite number, got -1.0"),
    ("1", TypeError, "compile_seconds must be a number of seconds or None, got str"),
    (True, TypeError, "compile_seconds must be a number of seconds or None, got bool"),
])
def test_put_refuses_a_bad_compile_seconds_naming_it(seconds, error, message):
    with TieredProgramCache(tiers=[InMemoryProgramCache()]) as cache:
        with pytest.raises(error) as info:
            cache.put(b"k" * 32, b"cubin", compile_seconds=seconds)
        assert str(info.value) == message and len(cache) == 0


def test_local_dir_is_the_store_of_the_chain(tmp_path):
    with TieredProgramCache(tmp_path) as cache:
        assert isinstance(cache.local_store, LocalDir)


def test_bare_tiers_of_one_kind_are_numbered_in_order():
    with TieredProgramCache(tiers=[InMemoryProgramCache(), InMemoryProgramCache(), InMemoryProgramCache()]) as cache:
        assert [name for name, _ in cache.stats().tiers] == ["memory", "memory2", "memory3"]


def test_a_chain_whose_first_tier_is_the_local_directory_reads_and_writes(tmp_path):
    with TieredProgramCache(tiers=[FileStreamProgramCache(tmp_path)]) as cache:
        cache[b"a" * 32] = b"cubin-a"
        assert cache.get(b"a" * 32) == b"cubin-a"  # a hit in the first tier, which is no memory tier
        cache[b"b" * 32] = b"cubin-b"  # a write after a hit: nothing of memory's read order to touch
        assert cache.get(b"b" * 32) == b"cubin-b" and len(cache) == 2


def test_the_boot_fetch_budget_is_at_most_the_local_cap(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    with TieredProgramCache(tmp_path / "local", remote=remote.as_uri(), max_local_bytes=4096,
                            boot_fetch_bytes=1 << 30) as cache:  # fmt: skip
        assert cache._boot._max_bytes == 4096  # what lands is not evicted at once


def test_deleting_an_absent_key_raises_keyerror_with_a_read_only_tier_in_the_chain(tmp_path):
    shared = tmp_path / "shared"
    with TieredProgramCache(tiers=[InMemoryProgramCache(),
                                   (FileStreamProgramCache(shared), TierPolicy("shared", read_only=True))]) as cache:
        with pytest.raises(KeyError):
            del cache[b"absent" * 6]  # the read-only tier deletes nothing, so it held nothing
