"""The compile helper on one thread: keys, hits per tier, name expressions, errors, the hook."""

from __future__ import annotations

import functools
import json

import pytest
from cuda.core import Program, ProgramOptions
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache, make_program_cache_key

import tiered_progcache
import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.compiling.compile import CompileEvent, default_cache, symbols_key
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.compiling.manifest import manifest_name
from tiered_progcache.stores.store import LeaseStore, entry_name
from tiered_progcache.samples import matmul_source
from support import options

ARCH = "sm_90"
TEMPLATED = r"""
template <typename T>
__global__ void fill(T* out, T value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""
NAMES = ("fill<float>", "fill<int>")


#: The options every compile here uses, unless a test adds to them.
_opts = functools.partial(options, std="c++17")


@pytest.fixture
def events():
    seen: list[CompileEvent] = []
    stop = tpc.on_compile(seen.append)
    yield seen
    stop()


def test_plain_compile_uses_cuda_cores_key_so_entries_are_shared(tmp_path, events):
    src = matmul_source(16)
    with TieredProgramCache(tmp_path) as cache:
        obj = tiered_progcache.compile(src, "c++", _opts(), cache=cache)
        key = make_program_cache_key(code=src, code_type="c++", options=_opts(), target_type="cubin")
        assert cache.get(key) == bytes(obj.code)
        assert [e.key for e in events] == [key] and events[0].ok and events[0].target_type == "cubin"
    # cuda-core's own Program.compile(cache=...) hits the entry the helper wrote
    with FileStreamProgramCache(tmp_path) as plain:
        again = Program(src, "c++", _opts()).compile("cubin", cache=plain)
    assert bytes(again.code) == bytes(obj.code)


def test_second_call_is_a_memory_hit_and_a_new_process_view_is_a_local_hit(tmp_path, events):
    src = matmul_source(32, "relu")
    with TieredProgramCache(tmp_path) as cache:
        first = tiered_progcache.compile(src, "c++", _opts(), cache=cache)
        before = cache.stats()
        second = tiered_progcache.compile(src, "c++", _opts(), cache=cache)
        delta = cache.stats() - before
    assert delta["memory"].hits == 1 and delta["local"].lookups == 0
    assert bytes(second.code) == bytes(first.code) and second.code_type == "cubin"
    with TieredProgramCache(tmp_path) as fresh:
        third = tiered_progcache.compile(src, "c++", _opts(), cache=fresh)
        assert fresh.stats()["local"].hits == 1
    assert bytes(third.code) == bytes(first.code)
    assert len(events) == 1


def test_name_expressions_are_cached_with_their_symbol_mapping(tmp_path, events):
    cache = InMemoryProgramCache()
    with pytest.raises(ValueError, match="name_expressions"):  # cuda-core on its own
        Program(TEMPLATED, "c++", _opts()).compile("cubin", name_expressions=NAMES, cache=cache)
    first = tiered_progcache.compile(TEMPLATED, "c++", _opts(), cache=cache, name_expressions=NAMES)
    hit = tiered_progcache.compile(TEMPLATED, "c++", _opts(), cache=cache, name_expressions=NAMES)
    assert len(events) == 1
    assert hit.symbol_mapping == first.symbol_mapping
    assert hit.symbol_mapping["fill<float>"] == b"_Z4fillIfEvPT_S0_i"
    assert hit.symbol_mapping["fill<int>"] == b"_Z4fillIiEvPT_S0_i"
    assert bytes(hit.code) == bytes(first.code)

    key = events[0].key
    doc = json.loads(cache.get(symbols_key(key)))  # plain JSON beside the binary
    assert doc["format"] == "tiered-progcache/symbols"
    # another set of names is another key (cuda-core keys them), compiled once as well
    tiered_progcache.compile(TEMPLATED, "c++", _opts(), cache=cache, name_expressions=["fill<int>"])
    assert len(events) == 2


def test_bytes_name_expressions_keep_their_type(events):
    cache = InMemoryProgramCache()
    tiered_progcache.compile(TEMPLATED, "c++", _opts(), cache=cache, name_expressions=[b"fill<int>"])
    hit = tiered_progcache.compile(TEMPLATED, "c++", _opts(), cache=cache, name_expressions=[b"fill<int>"])
    assert list(hit.symbol_mapping) == [b"fill<int>"] and len(events) == 1


@pytest.mark.parametrize("damage", ["missing", "garbage", "wrong-names"])
def test_a_hit_without_a_usable_symbol_mapping_recompiles(damage, events):
    cache = InMemoryProgramCache()
    tiered_progcache.compile(TEMPLATED, "c++", _opts(), cache=cache, name_expressions=NAMES)
    skey = symbols_key(events[0].key)
    if damage == "missing":
        del cache[skey]
    elif damage == "garbage":
        cache[skey] = b"\x80\x04not json"
    else:
        cache[skey] = json.dumps(
            {"format": "tiered-progcache/symbols", "version": 1, "symbols": [[["s", "other"], ["s", "_Z1x"]]]}
        ).encode()
    again = tiered_progcache.compile(TEMPLATED, "c++", _opts(), cache=cache, name_expressions=NAMES)
    assert len(events) == 2
    assert set(again.symbol_mapping) == set(NAMES)
    hit = tiered_progcache.compile(TEMPLATED, "c++", _opts(), cache=cache, name_expressions=NAMES)
    assert len(events) == 2 and set(hit.symbol_mapping) == set(NAMES)  # repaired


def test_user_extra_digest_is_kept_alone_and_mixed_with_header_digests(tmp_path, monkeypatch, events):
    monkeypatch.chdir(tmp_path)
    src = matmul_source(16)
    cache = InMemoryProgramCache()
    tiered_progcache.compile(src, "c++", _opts(), cache=cache, extra_digest=b"v1")
    assert events[-1].key == make_program_cache_key(
        code=src, code_type="c++", options=_opts(), target_type="cubin", extra_digest=b"v1"
    )
    tiered_progcache.compile(src, "c++", _opts(), cache=cache, extra_digest=b"v2")
    assert len(events) == 2  # a different user digest is a different entry
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "h.h").write_text("#define H 1\n")
    with_inc = "#include <h.h>\n" + src
    opts = _opts(tmp_path / "inc")
    tiered_progcache.compile(with_inc, "c++", opts, cache=cache, extra_digest=b"v1")
    tiered_progcache.compile(with_inc, "c++", opts, cache=cache, extra_digest=b"v2")
    assert len(events) == 4
    tiered_progcache.compile(with_inc, "c++", opts, cache=cache, extra_digest=b"v2")
    assert len(events) == 4


def test_compile_errors_reach_the_caller_and_nothing_is_stored(tmp_path, events):
    bad = 'extern "C" __global__ void broken(int* p) { *p = not_declared; }'
    with TieredProgramCache(tmp_path) as cache:
        for _ in range(2):
            with pytest.raises(Exception, match="not_declared"):
                tiered_progcache.compile(bad, "c++", _opts(), cache=cache)
        assert len(cache) == 0
    assert [e.ok for e in events] == [False, False]  # a failure is not cached: it compiles again
    assert not any((tmp_path / "locks").iterdir())  # and left no lock behind


def test_ltoir_target_round_trips(events):
    # (PTX output needs the CUDA driver in cuda-core 1.2, so it is not tried on a GPU-less host)
    cache = InMemoryProgramCache()
    opts = ProgramOptions(arch=ARCH, link_time_optimization=True)
    first = tiered_progcache.compile(matmul_source(16), "c++", opts, "ltoir", cache=cache)
    hit = tiered_progcache.compile(matmul_source(16), "c++", opts, "ltoir", cache=cache)
    assert hit.code_type == "ltoir" and bytes(hit.code) == bytes(first.code)
    assert len(events) == 1


def test_default_cache_is_one_lazily_built_chain(tmp_path, events):
    cache = default_cache()
    assert cache is default_cache()
    src = matmul_source(16, "relu")
    tiered_progcache.compile(src, "c++", _opts())
    tiered_progcache.compile(src, "c++", _opts())
    assert len(events) == 1
    key = make_program_cache_key(code=src, code_type="c++", options=_opts(), target_type="cubin")
    assert cache.get(key) is not None


def test_compile_count_counts_every_compiler_run():
    start = tpc.compile_count()
    cache = InMemoryProgramCache()
    tiered_progcache.compile(matmul_source(16), "c++", _opts(), cache=cache)
    tiered_progcache.compile(matmul_source(16), "c++", _opts(), cache=cache)
    tiered_progcache.compile(matmul_source(32), "c++", _opts(), cache=cache)
    assert tpc.compile_count() - start == 2


def test_a_failing_hook_does_not_fail_the_compile(caplog):
    def boom(event: CompileEvent) -> None:
        raise RuntimeError("hook broke")

    stop = tpc.on_compile(boom)
    try:
        obj = tiered_progcache.compile(matmul_source(16), "c++", _opts(), cache=InMemoryProgramCache())
    finally:
        stop()
    assert bytes(obj.code)[:4] == b"\x7fELF"
    assert "hook broke" in caplog.text


class _LeasesWithoutAtomicCreate(LeaseStore):
    """A lease namespace that declares no atomic create: single-flight must not touch it."""

    def __init__(self, location: str, calls: list[str]) -> None:
        self._location = location
        self.calls = calls

    @property
    def location(self) -> str:
        return self._location

    @property
    def atomic_create(self) -> bool:
        return False

    def create(self, name, document, ttl_s):
        self.calls.append("create")
        return True

    def read(self, name):
        self.calls.append("read")
        return None

    def replace(self, name, document, ttl_s):
        self.calls.append("replace")

    def delete(self, name):
        self.calls.append("delete")


class RemoteWithoutAtomicCreate(RemoteProgramCache):
    """A real shared store whose leases declare no atomic create (as fsspec's racy generic create would)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lease_calls: list[str] = []

    def leases(self) -> LeaseStore | None:
        return _LeasesWithoutAtomicCreate(f"{self.location}/leases", self.lease_calls)


def test_a_remote_without_conditional_create_falls_back_to_node_level_and_says_so_once(tmp_path, caplog, events):
    from tiered_progcache import TierPolicy

    remote = RemoteWithoutAtomicCreate.from_url(f"file://{tmp_path / 'remote'}")
    chain = TieredProgramCache(
        tiers=[
            InMemoryProgramCache(),
            (FileStreamProgramCache(tmp_path / "local"), TierPolicy("local")),
            (remote, TierPolicy("remote", shared=True)),
        ]
    )
    with chain as cache, caplog.at_level("WARNING", logger="tiered_progcache.cluster.singleflight"):
        assert cache.shared_store is remote
        tiered_progcache.compile(matmul_source(16), "c++", _opts(), cache=cache)
        tiered_progcache.compile(matmul_source(32), "c++", _opts(), cache=cache)
    assert len(events) == 2
    assert caplog.text.count("no atomic create-if-absent") == 1
    assert remote.lease_calls == []  # no lease object read or written
    binaries = {entry_name(e.key) for e in events}
    # the entries still reach the shared tier, each with its manifest
    assert {e.name for e in remote.iter_entries()} == binaries | {manifest_name(n) for n in binaries}


def test_threads_on_two_caches_each_fill_their_own(tmp_path, events):
    import threading

    caches = [InMemoryProgramCache(), InMemoryProgramCache()]
    barrier = threading.Barrier(2)

    def work(cache) -> None:
        barrier.wait(30)
        tiered_progcache.compile(matmul_source(16), "c++", _opts(), cache=cache)

    threads = [threading.Thread(target=work, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len(c) == 2 for c in caches)  # the binary and its manifest


# -- bad arguments: a clear error naming the argument, before anything runs --------------------------

_GOOD_SRC = 'extern "C" __global__ void k(int* out) { *out = 1; }\n'


@pytest.mark.parametrize(("kwargs", "error", "names"), [
    ({"cache": "x"}, TypeError, "cache"),
    ({"cache": {}}, TypeError, "cache"),
    ({"source": 42}, TypeError, "source"),
    ({"source": None}, TypeError, "source"),
    ({"source": b"bytes are for nvvm"}, TypeError, "source"),
    ({"code_type": 3}, TypeError, "code_type"),
    ({"code_type": "fortran"}, ValueError, "code_type"),
    ({"options": {"arch": "sm_90"}}, TypeError, "options"),
    ({"target_type": "exe"}, ValueError, "target_type"),
    ({"target_type": b"cubin"}, TypeError, "target_type"),
    ({"name_expressions": "f<int>"}, TypeError, "name_expressions"),
    ({"name_expressions": [1, 2]}, TypeError, "name_expressions"),
    ({"name_expressions": 5}, TypeError, "name_expressions"),
    ({"extra_digest": "abc"}, TypeError, "extra_digest"),
    ({"wait_timeout": "soon"}, TypeError, "wait_timeout"),
    ({"wait_timeout": -1}, ValueError, "wait_timeout"),
    ({"wait_timeout": float("nan")}, ValueError, "wait_timeout"),
    ({"wait_timeout": True}, TypeError, "wait_timeout"),
    ({"lease_ttl": "60"}, TypeError, "lease_ttl"),
    ({"lease_ttl": 0}, ValueError, "lease_ttl"),
    ({"lease_ttl": float("inf")}, ValueError, "lease_ttl"),
    ({"header_recheck_s": "1"}, TypeError, "header_recheck_s"),
    ({"header_recheck_s": -1.0}, ValueError, "header_recheck_s"),
    ({"single_flight": "false"}, TypeError, "single_flight"),
])
def test_a_bad_argument_is_a_clear_error_naming_it(kwargs, error, names, events):
    call = {"source": _GOOD_SRC, "code_type": "c++", "options": _opts(), "cache": InMemoryProgramCache()}
    call.update(kwargs)
    with pytest.raises(error, match=names):
        tpc.compile(call.pop("source"), **call)
    assert events == []  # nothing compiled


def test_good_arguments_of_every_kind_are_accepted(events):
    cache = InMemoryProgramCache()
    obj = tpc.compile(_GOOD_SRC, "C++", _opts(), "CUBIN", cache=cache, name_expressions=(),
                      extra_digest=bytearray(b"x"), wait_timeout=0, lease_ttl=1, header_recheck_s=0,
                      single_flight=False)
    assert bytes(obj.code)[:4] == b"\x7fELF" and len(events) == 1
