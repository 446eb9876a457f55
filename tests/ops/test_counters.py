"""Issue 28: counters that say what happened, one set of names across stats(), `stats`, `stats --run` and Prometheus.

Item 1: a dead or hanging remote counts an error or a timeout, not only misses. Item 4: an
uncacheable compile is counted with its reason and logged once. Item 5: NVRTC runs include
``Program.compile(cache=)``'s misses; symbol-map reads are not lookups.
"""

from __future__ import annotations

import logging
import socket

import pytest
from cuda.core import Program, ProgramOptions

import tiered_progcache
from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import ledger
from tiered_progcache.samples import matmul_source

OPTS = ProgramOptions(arch="sm_90", std="c++17")
TEMPLATED = r"""
template <typename T>
__global__ void fill(T* out, T value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""
NAMES = ("fill<float>", "fill<int>")
COMPUTED = '#define STR(x) #x\n#include STR(v.h)\nextern "C" __global__ void k(int *p) { *p = V; }\n'


@pytest.fixture
def refused_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused
    return port


@pytest.fixture
def silent_port():
    """A port that accepts connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


# -- item 1 ----------------------------------------------------------------------------------------


def test_a_refused_remote_counts_an_error_in_stats_and_the_directory_ledger(tmp_path, refused_port):
    cache = TieredProgramCache(tmp_path / "c", remote=f"redis://127.0.0.1:{refused_port}/0", remote_timeout=2)
    assert cache.get(b"k" * 32) is None
    remote = cache.stats()["redis"]
    assert (remote.errors, remote.timeouts, remote.misses, remote.skipped) == (1, 0, 1, 1)
    cache.close()
    totals = ledger.read_totals(tmp_path / "c")
    assert (totals.errors, totals.timeouts) == (1, 0)
    assert dict(totals.tiers)["redis"] == (("hits", 0), ("misses", 1), ("errors", 1), ("timeouts", 0))


def test_a_hanging_remote_counts_a_timeout(tmp_path, silent_port):
    cache = TieredProgramCache(tmp_path / "c", remote=f"redis://127.0.0.1:{silent_port}/0", remote_timeout=0.5)
    cache.get(b"k" * 32)
    remote = cache.stats()["redis"]
    assert (remote.errors, remote.timeouts) == (0, 1)
    cache.close()
    assert ledger.read_totals(tmp_path / "c").timeouts == 1


# -- item 4 ----------------------------------------------------------------------------------------


def test_an_uncacheable_compile_is_counted_with_its_reason_and_logged_once(tmp_path, monkeypatch, caplog):
    work = tmp_path / "work"
    work.mkdir()
    (work / "v.h").write_text("#define V 1\n")
    monkeypatch.chdir(work)
    cache = TieredProgramCache(tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.compiling.compile"):
        for _ in range(3):
            tiered_progcache.compile(COMPUTED, "c++", OPTS, cache=cache)
    snap = cache.stats()
    assert snap.uncacheable == {"computed_include": 3} and snap.compiles == 3
    lines = [r.getMessage() for r in caplog.records if "uncacheable" in r.getMessage()]
    assert len(lines) == 1 and "computed #include" in lines[0]
    cache.close()
    totals = ledger.read_totals(tmp_path / "c")
    assert dict(totals.uncacheable) == {"computed_include": 3} and totals.compiles == 3


def test_uncacheable_reasons_are_few_labels_never_paths():
    from tiered_progcache.chain.stats import UNCACHEABLE_REASONS, uncacheable_reason

    assert uncacheable_reason("a computed #include the scanner cannot resolve could read ...") == "computed_include"
    assert uncacheable_reason("/usr/include/x.h: a header over 67108864 bytes") == "header_too_large"
    assert uncacheable_reason("inc:big.h is over 67108864 bytes") == "header_too_large"
    assert uncacheable_reason("something new") == "other"
    assert set(UNCACHEABLE_REASONS) == {"computed_include", "header_too_large", "other"}


# -- item 5 ----------------------------------------------------------------------------------------


def test_nvrtc_runs_include_program_compile_misses(tmp_path):
    with TieredProgramCache(tmp_path / "c") as cache:
        Program(matmul_source(16), "c++", OPTS).compile("cubin", cache=cache)  # a miss: NVRTC runs
        Program(matmul_source(16), "c++", OPTS).compile("cubin", cache=cache)  # a hit: it does not
        tiered_progcache.compile(matmul_source(32), "c++", OPTS, cache=cache)
        assert cache.stats().compiles == 2
    assert ledger.read_totals(tmp_path / "c").compiles == 2


def test_a_name_expression_hit_is_one_lookup_not_two(tmp_path):
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(TEMPLATED, "c++", OPTS, cache=cache, name_expressions=NAMES)
        before = cache.stats()
        hit = tiered_progcache.compile(TEMPLATED, "c++", OPTS, cache=cache, name_expressions=NAMES)
        delta = cache.stats() - before
    assert hit.symbol_mapping and set(NAMES) <= set(hit.symbol_mapping)
    assert (delta["memory"].hits, delta["memory"].misses, delta.compiles) == (1, 0, 0)


def test_a_symbol_map_read_from_the_local_tier_is_promoted_and_not_counted(tmp_path):
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(TEMPLATED, "c++", OPTS, cache=cache, name_expressions=NAMES)
    with TieredProgramCache(tmp_path / "c") as fresh:  # a new process: memory is empty
        tiered_progcache.compile(TEMPLATED, "c++", OPTS, cache=fresh, name_expressions=NAMES)
        snap = fresh.stats()
        assert (snap["memory"].misses, snap["local"].hits, snap["local"].misses) == (1, 1, 0)
        assert snap["memory"].promotions == 3  # the binary, its symbol map, and its manifest (the seconds saved)


def test_the_exit_report_counts_the_manifest_reads_its_saved_seconds_make(tmp_path):
    """The tally is read before the tiers' counters: the hit's manifest, read for its seconds then, is in them."""
    from tiered_progcache.chain import exitreport

    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(TEMPLATED, "c++", OPTS, cache=cache, name_expressions=NAMES)
    with TieredProgramCache(tmp_path / "c") as fresh:
        tiered_progcache.compile(TEMPLATED, "c++", OPTS, cache=fresh, name_expressions=NAMES)
        counts = exitreport.tier_counts([(t.name, t.counters) for t in fresh.tiers], fresh.compile_tally)
        assert counts.tiers["memory"]["promotions"] == 3 and counts.compiling.saved_seconds > 0
