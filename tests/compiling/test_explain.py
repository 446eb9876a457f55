"""explain(): a hit names its tier; a miss names the nearest stored entry and exactly what differs (real NVRTC)."""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
from cuda.bindings import nvrtc
from cuda.core import ProgramOptions

import tiered_progcache
from tiered_progcache import LocalDir, TieredProgramCache, TierPolicy
from tiered_progcache.cluster.flightpolicy import compile_size
from tiered_progcache.cluster.singleflight import describe, predict
from tiered_progcache.compiling.explain import MAX_MANIFEST_READS, Difference, explain
from tiered_progcache.compiling.manifest import (
    MAX_MANIFEST_BYTES,
    build_manifest,
    decode_manifest,
    encode_manifest,
    manifest_key,
    manifest_name,
)
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing import WrapperEntryStore
from tiered_progcache.testing.redis_server import redis_server, redis_url  # noqa: F401  (fixtures)
from support import options

SRC = r"""
#include "x.h"
#include <a/b.h>
extern "C" __global__ void scale(float* out, int n) { int i = threadIdx.x; if (i < n) out[i] *= SCALE + OFFSET; }
"""
#: More than the largest envelope of a manifest of the bound (its listing alone rules it out).
OVERSIZE = MAX_MANIFEST_BYTES + 1000
OTHER = 'extern "C" __global__ void negate(float* out) { out[threadIdx.x] = -out[threadIdx.x]; }\n'


@pytest.fixture
def include(tmp_path):
    """An include directory with ``x.h`` and ``a/b.h`` (what SRC reads)."""
    root = tmp_path / "include"
    (root / "a").mkdir(parents=True)
    (root / "x.h").write_text("#define SCALE 2\n")
    (root / "a" / "b.h").write_text("#define OFFSET 1\n")
    return root


#: The options every compile here uses (sm_80, C++17), with the include roots given first.
_opts = functools.partial(options, arch="sm_80", std="c++17")


def _lines(report) -> list[str]:
    """The difference lines of the nearest candidate (what a person reads)."""
    assert not report.hit
    return [d.line for d in report.candidates[0].differences]


def _nvrtc() -> str:
    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


# -- a miss names the differing component ----------------------------------------------------------


def test_a_header_changed_by_one_byte_is_named(tmp_path, include):
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        (include / "x.h").write_text("#define SCALE 3\n")  # one byte
        report = explain(SRC, "c++", _opts(include), cache=cache)
    assert _lines(report) == ["header `x.h` content differs"]
    (diff,) = report.candidates[0].differences
    assert (diff.component, diff.subject) == ("header", "x.h") and diff.this != diff.stored
    assert report.candidates[0].similarity == "same source"
    assert report.lines()[0] == f"miss: entry {report.entry} is in no tier"


def test_a_header_only_on_one_side_is_named(tmp_path, include):
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        report = explain(SRC.replace("#include <a/b.h>\n", "#define OFFSET 1\n"), "c++", _opts(include), cache=cache)
    assert _lines(report) == ["source differs", "header `a/b.h` only in stored entry"]
    assert report.candidates[0].similarity == "same kernels"


@pytest.mark.parametrize(
    ("changed", "expected"),
    [
        ({"std": "c++20"}, ["option `--std` c++20 vs c++17"]),
        ({"use_fast_math": True}, ["option `--use_fast_math` only in this compile"]),
    ],
    ids=["std", "fast-math"],
)
def test_a_changed_option_is_named(tmp_path, include, changed, expected):
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        report = explain(SRC, "c++", _opts(include, **changed), cache=cache)
    assert _lines(report) == expected


def test_a_missing_include_root_is_named(tmp_path, include):
    extra = tmp_path / "more"
    extra.mkdir()
    (extra / "y.h").write_text("#define Y 1\n")
    src = SRC + '#if __has_include("y.h")\n#include "y.h"\n#endif\n'
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(src, "c++", _opts(include, extra), cache=cache)
        report = explain(src, "c++", _opts(include), cache=cache)
    assert _lines(report) == [
        "include root I1 missing",
        "header `y.h` only in stored entry",
        "include found nowhere: `y.h` only in this compile",  # its __has_include finds nothing now
    ]


def test_another_compiler_version_is_named(tmp_path, include, events):
    """An entry another node compiled with another NVRTC: its manifest, built and stored through the public API."""
    claimed = "13.3" if _nvrtc() != "13.3" else "13.4"
    with TieredProgramCache(tmp_path / "c") as cache:
        obj = tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        ours = events[0].key
        key = bytes(32)  # the other node's key (its NVRTC version is part of it)
        stored = decode_manifest(cache.get(manifest_key(ours)), entry=entry_name(ours))
        inputs = dataclasses.replace(stored.inputs, compiler_version=claimed)
        cache[manifest_key(key)] = encode_manifest(build_manifest(key, inputs, 1.5, now=lambda: 1.7e9))
        cache[key] = bytes(obj.code)
        del cache[ours]  # this node's own entry is gone: a miss
        report = explain(SRC, "c++", _opts(include), cache=cache)
    assert _lines(report) == [f"NVRTC {_nvrtc()} vs {claimed}"]
    nearest = report.candidates[0]
    assert nearest.entry == entry_name(key) and nearest.manifest.provenance.written_at == "2023-11-14T22:13:20Z"
    assert report.lines()[1].endswith(f"compiled in 1.500 s by NVRTC {claimed}")


@pytest.mark.parametrize(
    ("target", "arch", "expected"),
    [("cubin", "sm_90", ["arch sm_90 vs sm_80"]), ("ptx", "sm_80", ["target ptx vs cubin"])],
    ids=["arch", "target"],
)
def test_another_target_or_arch_is_named(tmp_path, include, target, arch, expected):
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(SRC, "c++", _opts(include), "cubin", cache=cache)
        report = explain(SRC, "c++", _opts(include, arch=arch), target, cache=cache)
    assert _lines(report) == expected


def test_a_miss_with_nothing_similar_says_so(tmp_path, include):
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        report = explain(OTHER, "c++", _opts(include), cache=cache)
    assert (report.hit, report.candidates, report.manifests_read) == (False, (), 1)
    c_ms = predict(cache, "c++", "cubin", compile_size(len(OTHER), len(report.inputs.headers))) * 1e3
    assert report.lines() == (
        f"miss: entry {report.entry} is in no tier",
        "nothing similar stored: none of the 1 manifests read has the same source, kernels or name expressions",
        f"flight: node: no shared tier, the node lock only (C {c_ms:.1f} ms)",
    )
    assert report.one_line() == f"miss {report.entry}: nothing similar stored (1 manifests read)"


@pytest.mark.parametrize("rtts, case", [(0.0, "lease"), (1e9, "short")])
def test_explain_says_which_flight_case_a_miss_takes_with_its_c_and_r(tmp_path, rtts, case):
    """A cache with a shared tier: the case (short: races the lookup; lease) from the predicted C and the store's R
    (a memory:// store's, measured: a file:// one on this host's disk is no distance)."""
    with TieredProgramCache(tmp_path / "c", remote=f"memory://{tmp_path.name}/remote", lease_min_compile_rtts=rtts) as cache:
        assert cache.shared_store.wait_ready(60)  # R's first sample taken: explain and this test read the same R
        report = explain(OTHER, "c++", ProgramOptions(arch="sm_80"), cache=cache)
        c = predict(cache, "c++", "cubin", compile_size(len(OTHER), 0))
        r = cache.shared_store.round_trip_s
    assert report.flight == describe(cache, c) and report.lines()[-1] == f"flight: {report.flight}"
    sign = ">=" if case == "lease" else "<"
    assert report.flight.startswith(f"{case}: C {c * 1e3:.1f} ms {sign} {rtts:g} x R {r * 1e3:.1f} ms: ")


def test_explain_says_a_long_kernel_no_node_recorded_is_flown_by_its_direct_key_until_it_is(tmp_path):
    """Over DEFER_PAST_FILES headers and no direct manifest: the flight by direct key, with the case it takes
    once recorded; after its compile (its set recorded) the case alone."""
    from tiered_progcache.cluster.flightpolicy import DEFER_PAST_FILES

    root = tmp_path / "include"
    root.mkdir()
    for i in range(DEFER_PAST_FILES + 1):
        (root / f"h{i}.h").write_text(f"#define H{i} {i}\n")
    src = "".join(f'#include "h{i}.h"\n' for i in range(DEFER_PAST_FILES + 1)) + OTHER
    with TieredProgramCache(tmp_path / "c", remote=f"memory://{tmp_path.name}/remote") as cache:
        before = explain(src, "c++", _opts(root), cache=cache).flight
        assert before.startswith(f"direct key: no node recorded the {DEFER_PAST_FILES + 1} headers it reads (over "
                                 f"{DEFER_PAST_FILES}): one compile at a time by its direct key")
        tiered_progcache.compile(src, "c++", _opts(root), cache=cache)
        after = explain(src, "c++", _opts(root), cache=cache).flight
    # then the case by C and R (C as timed by then: the compile itself was timed between the two)
    assert before.split("; once recorded, ")[1].startswith("lease: C ") and after.startswith("lease: C ")


def test_an_empty_cache_is_a_plain_miss(tmp_path):
    with TieredProgramCache(tmp_path / "c") as cache:
        report = explain(OTHER, "c++", ProgramOptions(arch="sm_80"), cache=cache)
    assert (report.hit, report.candidates, report.manifests_read, report.notes) == (False, (), 0, ())


# -- a hit names its tier, and explain writes nothing ----------------------------------------------


def test_a_hit_names_the_tier_that_holds_it_and_nothing_is_written(tmp_path, include):
    remote = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    with TieredProgramCache(tmp_path / "a", remote=remote) as cache:
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        assert cache.flush(30)
        in_memory = explain(SRC, "c++", _opts(include), cache=cache)
    with TieredProgramCache(tmp_path / "a") as cache:
        on_disk = explain(SRC, "c++", _opts(include), cache=cache)
    with TieredProgramCache(tmp_path / "b", remote=remote) as cache:
        compiles, before = tiered_progcache.compile_count(), cache.stats()
        in_bucket = explain(SRC, "c++", _opts(include), cache=cache)
        delta = cache.stats() - before
        assert [(s.hits, s.misses, s.writes) for _, s in delta.tiers] == [(0, 0, 0)] * 3  # not a lookup, not a write
    assert list(LocalDir(tmp_path / "b").iter_entries()) == []  # nothing promoted, nothing written
    assert tiered_progcache.compile_count() == compiles
    assert [(r.hit, r.tier) for r in (in_memory, on_disk, in_bucket)] == [(True, "memory"), (True, "local"), (True, "remote")]
    assert (on_disk.location, in_bucket.location) == (str(tmp_path / "a"), remote)
    assert in_bucket.lines()[0] == f"hit: entry {in_bucket.entry} in tier remote ({remote})"
    assert in_bucket.lines()[1].startswith("written by ") and in_bucket.one_line() == f"hit {in_bucket.entry}: held by tier remote"
    assert in_bucket.manifest.inputs == in_bucket.inputs  # the stored manifest records what this compile keys


def test_a_hit_without_a_manifest_says_so(tmp_path):
    from cuda.core import Program

    with TieredProgramCache(tmp_path / "c") as cache:
        Program(OTHER, "c++", ProgramOptions(arch="sm_80")).compile("cubin", cache=cache)  # writes no manifest
        report = explain(OTHER, "c++", ProgramOptions(arch="sm_80"), cache=cache)
    assert (report.hit, report.manifest) == (True, None)
    assert report.lines()[1] == "no manifest beside it (stored by Program.compile(cache=...), or before manifests)"


# -- manifests that cannot be trusted ----------------------------------------------------------------


def test_corrupt_forged_and_oversize_manifests_are_reported_and_never_change_a_compile(tmp_path, include, events):
    with TieredProgramCache(tmp_path / "c") as cache:
        first = tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        key = events[0].key
        other = tiered_progcache.compile(OTHER, "c++", _opts(include), cache=cache)
        name = entry_name(key)

        cache[manifest_key(key)] = b'{"format": "tiered-progcache/manifest", "version": 1, "entry": '  # cut short
        again = tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        corrupt = explain(SRC, "c++", _opts(include), cache=cache)

        # a whole manifest, but of the other entry, stored beside this one
        cache[manifest_key(key)] = cache.get(manifest_key(events[1].key))
        forged = explain(SRC, "c++", _opts(include), cache=cache)

        cache[manifest_key(key)] = b" " * OVERSIZE  # more than an envelope of the bound
        oversize_hit = explain(SRC, "c++", _opts(include), cache=cache)
        oversize_miss = explain(SRC, "c++", _opts(include, std="c++20"), cache=cache)
        last = tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
    assert len(events) == 2  # no compile after the first two: the manifests never matter to compile()
    assert bytes(first.code) == bytes(again.code) == bytes(last.code) != bytes(other.code)
    assert corrupt.hit and corrupt.manifest is None
    assert corrupt.lines()[1] == f"unreadable manifest beside entry {name} in tier memory: not JSON (JSONDecodeError)"
    assert forged.lines()[1] == (f"unreadable manifest beside entry {name} in tier memory: "
                                 f"describes entry {entry_name(events[1].key)[:12]}, not {name[:12]}")  # fmt: skip
    assert oversize_hit.lines()[1] == (f"unreadable manifest beside entry {name} in tier memory: "
                                       f"{OVERSIZE} bytes, over the {MAX_MANIFEST_BYTES}-byte bound")  # fmt: skip
    # on a miss the listing's size alone rules it out: it is not read
    assert [(u.entry, u.tier) for u in oversize_miss.unreadable] == [(name, "local")]
    assert oversize_miss.unreadable[0].reason == (f"{OVERSIZE} bytes, over the {MAX_MANIFEST_BYTES}"
                                                  "-byte manifest bound (not read)")  # fmt: skip
    assert oversize_miss.manifests_read == 1  # the other entry's, which is not similar
    assert f"unreadable manifest beside entry {name} in tier local: " in "\n".join(oversize_miss.lines())


# -- what explain costs ------------------------------------------------------------------------------


def _counting_remote(root) -> WrapperEntryStore:
    """A real file:// remote that counts its listings and the entries read from it (one by one or side by side)."""
    return WrapperEntryStore(RemoteProgramCache.from_url(root.as_uri()))


def test_a_miss_reads_at_most_the_bound_and_skips_oversize_manifests_by_their_listed_size(tmp_path, include):
    remote = _counting_remote(tmp_path / "bucket")
    with TieredProgramCache(tmp_path / "c") as builder:
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=builder)
    (real,) = [e.name for e in LocalDir(tmp_path / "c").iter_entries() if manifest_name(e.name) in
               {x.name for x in LocalDir(tmp_path / "c").iter_entries()}]  # fmt: skip
    template = decode_manifest(LocalDir(tmp_path / "c").read_entry(manifest_name(real)), entry=real)
    for n in range(MAX_MANIFEST_READS + 8):  # more manifests than one explanation reads
        key = f"other-{n}".encode()
        remote.write_entry(entry_name(key), b"\x7fELF-not-read")
        manifest = build_manifest(key, template.inputs, 0.1)
        remote.write_entry(manifest_name(entry_name(key)), encode_manifest(manifest))
    big = entry_name(b"big")
    remote.write_entry(big, b"\x7fELF")
    remote.write_entry(manifest_name(big), b" " * OVERSIZE)
    remote.reset_counts()
    report = explain(SRC, "c++", _opts(include, std="c++20"), cache=remote)
    reads = remote.names("read_entry", "read_many")
    assert remote.calls["iter_entries"] == 1
    assert len(reads) == MAX_MANIFEST_READS == report.manifests_read == 32
    assert manifest_name(big) not in reads and all(name in {manifest_name(entry_name(f"other-{n}".encode()))
                                                            for n in range(40)} for name in reads)  # fmt: skip
    assert f"read the {MAX_MANIFEST_READS} newest of {MAX_MANIFEST_READS + 8} manifests" in report.notes
    assert len(report.candidates) == 3 and {c.similarity for c in report.candidates} == {"same source"}
    assert [u.entry for u in report.unreadable] == [big]


def test_explain_misses_off_lists_nothing_and_on_lists_each_tier_once_per_miss(tmp_path, include):
    for on, listings in ((False, 0), (True, 2)):
        remote = _counting_remote(tmp_path / f"bucket-{on}")
        chain = TieredProgramCache(tiers=[(remote, TierPolicy("remote", shared=True))], explain_misses=on)  # sync writes
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=chain)  # a miss
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=chain)  # a hit
        tiered_progcache.compile(SRC, "c++", _opts(include, std="c++20"), cache=chain)  # a miss
        chain.close()
        assert remote.calls["iter_entries"] == listings, on


def test_compile_logs_one_info_line_per_miss_and_none_per_hit(tmp_path, include, monkeypatch, caplog):
    monkeypatch.setenv("TIERED_PROGCACHE_EXPLAIN", "1")
    monkeypatch.setenv("TIERED_PROGCACHE_DIR", str(tmp_path / "c"))
    cache = TieredProgramCache.from_env()
    assert cache.explain_misses is True
    with cache, caplog.at_level(logging.INFO, logger="tiered_progcache.compiling.compile"):
        def lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.compiling.compile" and r.levelno == logging.INFO]

        tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        assert len(lines()) == 1 and lines()[0].endswith(": nothing similar stored (0 manifests read)")
        for _ in range(3):
            tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        assert len(lines()) == 1  # hits log nothing
        tiered_progcache.compile(SRC, "c++", _opts(include, std="c++20"), cache=cache)
        assert len(lines()) == 2
    assert lines()[1].startswith("miss ") and lines()[1].endswith(": option `--std` c++20 vs c++17")
    assert "(tier local, same source)" in lines()[1]


# -- bad arguments -------------------------------------------------------------------------------------


def test_bad_arguments_are_named(tmp_path):
    with TieredProgramCache(tmp_path / "c") as cache:
        with pytest.raises(TypeError, match="source must be a str"):
            explain(b"bytes", "c++", cache=cache)
        with pytest.raises(ValueError, match="target_type must be one of"):
            explain(OTHER, "c++", target_type="elf", cache=cache)
        with pytest.raises(TypeError, match="^portable_keys: must be True or False"):
            explain(OTHER, "c++", ProgramOptions(arch="sm_80"), cache=cache, portable_keys="yes")
        with pytest.raises(TypeError, match="cache must be"):
            explain(OTHER, "c++", cache={})


def test_difference_lines_for_each_component():
    cases = {
        Difference("compiler", None, "NVRTC 13.0", "NVRTC 13.3"): "NVRTC 13.0 vs 13.3",
        Difference("compiler", None, "NVRTC 13.0", "NVVM 2.0"): "compiler NVRTC 13.0 vs NVVM 2.0",
        Difference("header", "cuda/std/__type_traits/x.h", "a" * 64, "b" * 64): "header `cuda/std/__type_traits/x.h` content differs",
        Difference("header", "a/b.h", None, "b" * 64): "header `a/b.h` only in stored entry",
        Difference("header", "a/b.h", "a" * 64, None): "header `a/b.h` only in this compile",
        Difference("option", "--std", "c++17", "c++20"): "option `--std` c++17 vs c++20",
        Difference("option", "-DX=1", None, "X=1"): "option `-DX=1` only in stored entry",
        Difference("include root", "I2", None, "I2"): "include root I2 missing",
        Difference("include root", "I2", "I2", None): "include root I2 only in this compile",
        Difference("target", None, "cubin", "ptx"): "target cubin vs ptx",
        Difference("arch", None, "sm_90", "sm_80"): "arch sm_90 vs sm_80",
        Difference("source", None, "a" * 64, "b" * 64): "source differs",
        Difference("missing include", "nowhere.h", "missing", None): "include found nowhere: `nowhere.h` only in this compile",
    }
    assert {d: d.line for d in cases} == cases


def test_a_tier_that_fails_is_a_note_not_an_exception(tmp_path, include):
    remote = WrapperEntryStore(RemoteProgramCache.from_url((tmp_path / "bucket").as_uri()))
    remote.fail("iter_entries", PermissionError("ListBucket denied"))  # a bucket that denies ListBucket
    with TieredProgramCache(tiers=[(remote, TierPolicy("remote", shared=True))]) as cache:
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        report = explain(SRC, "c++", _opts(include, std="c++20"), cache=cache)
    assert (report.hit, report.candidates) == (False, ())
    assert report.notes == ("tier remote: could not list it (PermissionError: ListBucket denied)",)
    assert report.lines()[-2] == "note: tier remote: could not list it (PermissionError: ListBucket denied)"


def test_on_redis_a_hit_and_a_miss_are_explained(tmp_path, include, redis_url):
    pytest.importorskip("redis")
    with TieredProgramCache(tmp_path / "a", remote=redis_url, strict=True) as cache:
        tiered_progcache.compile(SRC, "c++", _opts(include), cache=cache)
        assert cache.flush(30)
    with TieredProgramCache(tmp_path / "b", remote=redis_url, strict=True) as cache:
        hit = explain(SRC, "c++", _opts(include), cache=cache)
        miss = explain(SRC, "c++", _opts(include, arch="sm_90"), cache=cache)
    assert (hit.hit, hit.tier, hit.location) == (True, "redis", redis_url)
    assert hit.manifest is not None and hit.manifest.inputs == hit.inputs
    assert (miss.candidates[0].tier, _lines(miss)) == ("redis", ["arch sm_90 vs sm_80"])


_EXPLAINED_JOB = r'''
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, format="app %(name)s %(levelname)s: %(message)s")
import tiered_progcache
from cuda.core import ProgramOptions
from tiered_progcache import TieredProgramCache

src = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n'
with TieredProgramCache.from_env() as cache:
    tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_80", std="c++17"), cache=cache)
    tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_80", std="c++17"), cache=cache)  # a hit: no line
    tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_80", std="c++20"), cache=cache)
'''


@pytest.mark.parametrize("logging_setup", ["none", "configured"])
def test_explain_lines_reach_stderr_in_a_job_with_no_logging_set_up_and_once_with_it(tmp_path, logging_setup):
    """Issue 19 item 7: TIERED_PROGCACHE_EXPLAIN=1 printed nothing unless the application set up INFO logging."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TIERED_PROGCACHE_EXPLAIN": "1", "TIERED_PROGCACHE_DIR": str(tmp_path / "c")}
    job = subprocess.run([sys.executable, "-c", _EXPLAINED_JOB, logging_setup], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    assert job.returncode == 0, job.stderr
    prefix = "app " if logging_setup == "configured" else ""
    lines = [line for line in job.stderr.splitlines() if "tiered_progcache.compiling.compile INFO: miss " in line]
    assert len(lines) == 2, job.stderr  # one per miss, none for the hit, never twice
    assert all(line.startswith(prefix + "tiered_progcache.compiling.compile INFO: miss ") for line in lines), lines
    assert lines[0].endswith(": nothing similar stored (0 manifests read)")
    assert "(tier local, same source): option `--std` c++20 vs c++17" in lines[1]
    assert job.stdout == ""  # stderr only, as warnings are
