"""Admission by compile time: entries that compiled faster than ``min_upload_compile_s`` stay on the node."""

from __future__ import annotations

import math

import pytest
from cuda.core import ProgramOptions

import tiered_progcache
from tiered_progcache import CacheConfig, LocalDir, TieredProgramCache
from tiered_progcache.compiling.compile import symbols_key
from tiered_progcache.compiling.direct import direct_key
from tiered_progcache.compiling.manifest import manifest_name
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name

FAST = 'extern "C" __global__ void fast(float* x) { x[threadIdx.x] = 1.0f; }'
SLOW = r"""
#include <cub/block/block_reduce.cuh>
extern "C" __global__ void block_sum(const float* in, float* out) {
    using Reduce = cub::BlockReduce<float, 128>;
    __shared__ typename Reduce::TempStorage tmp;
    float total = Reduce(tmp).Sum(in[threadIdx.x]);
    if (threadIdx.x == 0) *out = total;
}
"""
NAMED = r"""
template <typename T> __global__ void fill(T* out, T v) { out[threadIdx.x] = v; }
"""


def _remote_names(url: str) -> set[str]:
    return {e.name for e in RemoteProgramCache.from_url(url).iter_entries()}


def _local_names(root) -> set[str]:
    return {e.name for e in LocalDir(root).iter_entries()}


# -- the chain's rule, with the compile time given -------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "seconds", "uploaded"),
    [
        (1.0, 0.25, False),  # faster than the threshold: kept on the node
        (1.0, 1.0, True),  # exactly the threshold: uploaded ("less than N" stays)
        (1.0, 7.5, True),
        (1.0, None, True),  # no compile time known (Program.compile(cache=...)): uploaded as before
        (None, 0.001, True),  # admission off (the default): everything goes up
    ],
)
def test_put_keeps_fast_entries_local_and_uploads_the_rest(tmp_path, threshold, seconds, uploaded):
    url = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    with TieredProgramCache(tmp_path / "local", remote=url, min_upload_compile_s=threshold) as cache:
        cache.put(b"key", b"\x7fELF entry", compile_seconds=seconds)
        assert cache.flush(30)
        assert cache.get(b"key") == b"\x7fELF entry"
        stats = cache.stats()
    assert _local_names(tmp_path / "local") == {entry_name(b"key")}
    assert _remote_names(url) == ({entry_name(b"key")} if uploaded else set())
    assert (stats["remote"].writes, stats["local"].writes) == (int(uploaded), 1)


def test_setitem_uploads_as_before_with_admission_on(tmp_path):
    url = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    with TieredProgramCache(tmp_path / "local", remote=url, min_upload_compile_s=60.0) as cache:
        cache[b"key"] = b"\x7fELF entry"
        assert cache.flush(30)
    assert _remote_names(url) == {entry_name(b"key")}


def test_the_setting_is_a_row_env_flag_and_checked(tmp_path):
    assert CacheConfig().min_upload_compile_s is None
    config = CacheConfig.from_env({"TIERED_PROGCACHE_MIN_UPLOAD_COMPILE_S": "0.5"})
    assert config.min_upload_compile_s == 0.5 and config.sources()["min_upload_compile_s"].startswith("env ")
    with pytest.raises(ValueError, match="TIERED_PROGCACHE_MIN_UPLOAD_COMPILE_S"):
        CacheConfig.from_env({"TIERED_PROGCACHE_MIN_UPLOAD_COMPILE_S": "fast"})
    with pytest.raises(ValueError, match="min_upload_compile_s"):
        TieredProgramCache(tmp_path, min_upload_compile_s=-1)
    with pytest.raises(TypeError, match="min_upload_compile_s"):
        TieredProgramCache(tmp_path, min_upload_compile_s="1s")
    with TieredProgramCache(tmp_path) as cache:
        for bad, error in ((-1.0, ValueError), (math.nan, ValueError), ("1", TypeError), (True, TypeError)):
            with pytest.raises(error, match="compile_seconds"):
                cache.put(b"k", b"v", compile_seconds=bad)
    from support import run_cli

    proc = run_cli("config", "--json", "--min-upload-compile-s", "2.5", "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    import json

    assert json.loads(proc.stdout)["min_upload_compile_s"] == {"value": 2.5, "source": "flag --min-upload-compile-s"}


# -- end to end: real NVRTC, a fast kernel and a CCCL one ------------------------------------------


def _cccl_options() -> ProgramOptions:
    from cuda.pathfinder import find_nvidia_header_directory

    include = find_nvidia_header_directory("cccl")
    if include is None:
        pytest.skip("no CCCL headers")
    return ProgramOptions(arch="sm_90", std="c++17", include_path=[include])


def test_a_fast_kernel_stays_local_and_a_cccl_kernel_is_uploaded(tmp_path, events):
    fast_opts, slow_opts = ProgramOptions(arch="sm_90", std="c++17"), _cccl_options()
    # measure both here, and put the threshold between them (geometric mean: ~40x apart on this machine)
    with TieredProgramCache(tmp_path / "measure") as cache:
        tiered_progcache.compile(FAST, "c++", fast_opts, cache=cache)
        tiered_progcache.compile(SLOW, "c++", slow_opts, cache=cache)
    fast_s, slow_s = events[0].seconds, events[1].seconds
    assert slow_s > 4 * fast_s, (fast_s, slow_s)
    threshold = math.sqrt(fast_s * slow_s)

    url = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    events.clear()
    with TieredProgramCache(tmp_path / "node", remote=url, min_upload_compile_s=threshold) as cache:
        tiered_progcache.compile(FAST, "c++", fast_opts, cache=cache)
        tiered_progcache.compile(SLOW, "c++", slow_opts, cache=cache)
        tiered_progcache.compile(NAMED, "c++", fast_opts, cache=cache, name_expressions=["fill<float>"])
        assert cache.flush(60)
    fast_ev, slow_ev, named_ev = events
    # the rule, on the seconds this very run measured
    expected = {entry_name(e.key) for e in (fast_ev, slow_ev, named_ev) if e.seconds >= threshold}
    expected |= {manifest_name(name) for name in expected}  # a manifest goes where its binary goes
    expected |= {entry_name(symbols_key(named_ev.key))} if named_ev.seconds >= threshold else set()
    slow_direct = entry_name(direct_key(SLOW, "c++", slow_opts, "cubin", (), None, True))  # the CCCL kernel's headers
    expected |= {slow_direct} if slow_ev.seconds >= threshold else set()
    assert _remote_names(url) == expected
    # and what the issue asks: the fast one stays out, the CCCL one goes in
    assert entry_name(slow_ev.key) in _remote_names(url)
    assert entry_name(fast_ev.key) not in _remote_names(url)
    # the binary and its symbol map travel together: both local, neither uploaded
    assert {entry_name(named_ev.key), entry_name(symbols_key(named_ev.key))} <= _local_names(tmp_path / "node")
    assert not {entry_name(named_ev.key), entry_name(symbols_key(named_ev.key))} & _remote_names(url)
    assert len(_local_names(tmp_path / "node")) == 8  # 3 binaries, their 3 manifests, 1 symbol map, 1 direct
