"""compile()'s knobs are settings: an argument wins, else the cache's setting (its constructor, its variable), else the row."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache, explain
from tiered_progcache.compiling.compileargs import KNOBS, check_arguments, knob_for, knobs_for
from tiered_progcache.compiling.keys import compile_key
from tiered_progcache.settings import DEFAULT_LEASE_TTL_S, DEFAULT_WAIT_TIMEOUT_S, by_name
from tiered_progcache.stores.store import entry_name
from tiered_progcache.chain.tiered import as_chain

ARCH = "sm_90"
JOIN_S = 90
ENV = "TIERED_PROGCACHE_"


def kernel(i: int) -> str:
    return f'extern "C" __global__ void knob{i}_{uuid.uuid4().hex[:8]}(float* a) {{ a[threadIdx.x] *= {i + 1}.0f; }}\n'


def test_every_knob_is_a_row_and_the_rows_hold_the_old_defaults():
    rows = by_name()
    assert [rows[name].default for name in KNOBS] == [True, DEFAULT_WAIT_TIMEOUT_S, DEFAULT_LEASE_TTL_S, 0.0, True]
    assert (DEFAULT_WAIT_TIMEOUT_S, DEFAULT_LEASE_TTL_S) == (300.0, 60.0)
    assert all(not rows[name].builds_tiers and rows[name].variable and rows[name].flag for name in KNOBS)


def test_a_knob_left_out_is_the_chain_s_setting_and_an_argument_wins(tmp_path):
    given = dict(single_flight=False, wait_timeout=7.0, lease_ttl=9.0, header_recheck_s=2.0, portable_keys=False)
    with TieredProgramCache(tiers=[InMemoryProgramCache()], **given) as chain:
        assert knobs_for(chain, None, None, None, None, None) == (False, 7.0, 9.0, 2.0, False)
        assert knobs_for(chain, True, 0, 1, 0, True) == (True, 0.0, 1.0, 0.0, True)  # each argument wins
        assert knob_for(chain, "lease_ttl", None) == 9.0 and knob_for(chain, "lease_ttl", 3.0) == 3.0
    environ = {ENV + "DIR": str(tmp_path), ENV + "WAIT_TIMEOUT": "0", ENV + "NO_SUCH": "1", ENV + "PORTABLE_KEYS": "0"}
    with TieredProgramCache.from_env(environ) as from_env:  # the default cache is built so
        assert knobs_for(from_env, None, None, None, None, None) == (True, 0.0, 60.0, 0.0, False)
        assert from_env.settings.sources()["wait_timeout"] == "env TIERED_PROGCACHE_WAIT_TIMEOUT"
    # A bare resource, wrapped into a chain on the way in, has no settings: the rows' defaults.
    assert knobs_for(as_chain(InMemoryProgramCache()), None, None, None, None, None) == (True, 300.0, 60.0, 0.0, True)


@pytest.mark.parametrize(("knob", "bad", "error"), [
    ("wait_timeout", -1, ValueError), ("lease_ttl", 0, ValueError), ("lease_ttl", None, TypeError),
    ("header_recheck_s", float("nan"), ValueError), ("single_flight", "no", TypeError), ("portable_keys", 1, TypeError),
])  # fmt: skip
def test_a_chain_refuses_a_bad_knob_naming_it(knob, bad, error):
    with pytest.raises(error, match=f"^{knob}: "):
        TieredProgramCache(tiers=[InMemoryProgramCache()], **{knob: bad})


def test_a_chain_s_wait_timeout_bounds_a_thread_waiting_on_a_stuck_leader():
    """The leader's compile is held in the hook; the follower, with the chain's wait_timeout (0.2 s), compiles itself."""
    cache = TieredProgramCache(tiers=[InMemoryProgramCache()], wait_timeout=0.2)
    leader_in, let_go = threading.Event(), threading.Event()
    runs: list[str] = []

    def hold_the_first(event: tpc.CompileEvent) -> None:
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            leader_in.set()
            assert let_go.wait(JOIN_S)

    stop = tpc.on_compile(hold_the_first)
    source = kernel(1)

    def compile_as(wait_timeout: float | None) -> None:
        tpc.compile(source, "c++", ProgramOptions(arch=ARCH), cache=cache, wait_timeout=wait_timeout)

    leader = threading.Thread(target=compile_as, args=(300.0,), name="leader")  # the argument wins for the leader
    follower = threading.Thread(target=compile_as, args=(None,), name="follower")  # the chain's 0.2 s
    try:
        leader.start()
        assert leader_in.wait(JOIN_S)
        follower.start()
        follower.join(JOIN_S)
        assert not follower.is_alive(), "the follower waited past the chain's wait_timeout"
        assert leader.is_alive() and runs == ["leader", "follower"]
    finally:
        let_go.set()
        leader.join(JOIN_S)
        stop()
        cache.close()


@pytest.fixture
def node(tmp_path):
    """A chain on a memory:// remote that takes a lease for every compile (lease_min_compile_rtts=0)."""

    def build(**knobs):
        return TieredProgramCache(tmp_path / uuid.uuid4().hex, remote=f"memory://knobs-{uuid.uuid4().hex}/k",
                                  lease_min_compile_rtts=0, **knobs)  # fmt: skip

    return build


def _lease_seconds_seen(cache: TieredProgramCache, source: str, **arguments) -> list[float | None]:
    """Compile ``source``; the lease's lifetime (expires_at - acquired_at) as the compiling thread saw it, None: none."""
    seen: list[float | None] = []

    def look(event: tpc.CompileEvent) -> None:
        raw = cache.shared_store.leases().read(entry_name(event.key))
        seen.append(None if raw is None else round((lambda d: d["expires_at"] - d["acquired_at"])(json.loads(raw)), 3))

    stop = tpc.on_compile(look)
    try:
        tpc.compile(source, "c++", ProgramOptions(arch=ARCH), cache=cache, **arguments)
    finally:
        stop()
    return seen


def test_the_chain_s_lease_ttl_is_the_lease_s_and_an_argument_wins(node):
    with node(lease_ttl=45.0) as cache:
        assert _lease_seconds_seen(cache, kernel(2)) == [45.0]
        assert _lease_seconds_seen(cache, kernel(3), lease_ttl=50.0) == [50.0]
    with node() as cache:
        assert _lease_seconds_seen(cache, kernel(4)) == [DEFAULT_LEASE_TTL_S]


def test_single_flight_off_in_the_settings_takes_no_lease_and_an_argument_turns_it_on(node):
    with node(single_flight=False) as cache:
        assert _lease_seconds_seen(cache, kernel(5)) == [None]
        assert _lease_seconds_seen(cache, kernel(6), single_flight=True) == [DEFAULT_LEASE_TTL_S]


def test_portable_keys_off_in_the_settings_keys_by_path_for_compile_and_explain(tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    (include / "knob.h").write_text("#define KNOB_SCALE 3.0f\n")
    source = '#include "knob.h"\nextern "C" __global__ void scaled(float* a) { a[threadIdx.x] *= KNOB_SCALE; }\n'
    options = ProgramOptions(arch=ARCH, include_path=[str(include)])
    by_path = compile_key(source, "c++", options, "cubin", (), None, portable=False).key
    by_role = compile_key(source, "c++", options, "cubin", (), None, portable=True).key
    assert by_path != by_role
    keys: list[bytes] = []
    stop = tpc.on_compile(lambda event: keys.append(event.key))
    try:
        with TieredProgramCache(tiers=[InMemoryProgramCache()], portable_keys=False) as cache:
            tpc.compile(source, "c++", options, cache=cache)
            tpc.compile(source, "c++", options, cache=cache, portable_keys=True)
            assert explain(source, "c++", options, cache=cache).entry == entry_name(by_path)
            assert explain(source, "c++", options, cache=cache, portable_keys=True).entry == entry_name(by_role)
    finally:
        stop()
    assert keys == [by_path, by_role]


_GOOD_ARGS = {"source": "x", "code_type": "c++", "options": None, "target_type": "cubin", "cache": None,
              "name_expressions": (), "extra_digest": None}


@pytest.mark.parametrize(("bad", "error", "message"), [
    ({"cache": {}}, TypeError, "cache must be a cuda.core ProgramCacheResource (a TieredProgramCache, say), a "
                               "tiered_progcache EntryStore or None, got dict"),
    ({"source": 42}, TypeError, "source must be a str for code_type='c++', got int"),
    ({"source": b"b"}, TypeError, "source must be a str for code_type='c++', got bytes"),
    ({"code_type": "nvvm", "source": 42}, TypeError, "source must be str or bytes for code_type='nvvm', got int"),
    ({"code_type": 3}, TypeError, "code_type must be a str, got int"),
    ({"code_type": "fortran"}, ValueError, "code_type must be one of c++, ptx, nvvm, got 'fortran'"),
    ({"options": {"arch": "sm_90"}}, TypeError, "options must be a cuda.core ProgramOptions or None, got dict"),
    ({"target_type": "exe"}, ValueError, "target_type must be one of cubin, ptx, ltoir, got 'exe'"),
    ({"target_type": b"cubin"}, TypeError, "target_type must be a str, got bytes"),
    ({"name_expressions": "f<int>"}, TypeError,
     "name_expressions must be a sequence of str or bytes (not one string), got str"),
    ({"name_expressions": 5}, TypeError,
     "name_expressions must be a sequence of str or bytes (not one string), got int"),
    ({"name_expressions": [b"ok", 1, 2]}, TypeError, "name_expressions must hold str or bytes, got ['bytes', 'int', 'int']"),
    ({"extra_digest": "abc"}, TypeError, "extra_digest must be bytes or None, got str"),
    ({"wait_timeout": -1}, ValueError, "wait_timeout: must be zero or more seconds, got -1"),
    ({"wait_timeout": True}, TypeError, "wait_timeout: must be a number of seconds, got bool"),
    ({"single_flight": "false"}, TypeError, "single_flight: must be True or False, got str"),
    ({"portable_keys": 1}, TypeError, "portable_keys: must be True or False, got int"),
])
def test_each_bad_argument_is_refused_word_for_word(bad, error, message):
    with pytest.raises(error) as raised:
        check_arguments(**{**_GOOD_ARGS, **bad})
    assert str(raised.value) == message


@pytest.mark.parametrize("good", [
    {"code_type": "C++", "target_type": "CUBIN", "name_expressions": ["f<int>", b"g"]},
    {"code_type": "PTX", "target_type": "ptx", "options": ProgramOptions(arch="sm_90")},
    {"code_type": "NVVM", "source": b"\x42\x43", "target_type": "LTOIR", "extra_digest": memoryview(b"x")},
    {"code_type": "nvvm", "source": bytearray(b"ir"), "extra_digest": bytearray(b"y"), "cache": InMemoryProgramCache()},
    {"single_flight": False, "portable_keys": True, "wait_timeout": 0, "lease_ttl": 1.5, "header_recheck_s": 0.0},
])
def test_good_arguments_pass_and_the_name_expressions_come_back_as_a_tuple(good):
    names = check_arguments(**{**_GOOD_ARGS, **good})
    assert names == tuple(good.get("name_expressions", ()))
