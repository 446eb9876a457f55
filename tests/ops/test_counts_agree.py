"""Issue 28 item 6: one count for one directory: stats, export, Prometheus; export --arch ships no lone symbol map."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cuda.core import ProgramOptions

import tiered_progcache
from tiered_progcache import LocalDir, TieredProgramCache
from tiered_progcache.compiling.keys import HeaderFile
from tiered_progcache.compiling.manifest import decode_manifest, encode_manifest, manifest_name
from tiered_progcache.ops.bundle import export_bundle
from tiered_progcache.stores.kinds import METADATA_READ_BYTES
from tiered_progcache.stores.store import entry_name

from support import run_cli

TEMPLATED = r"""
template <typename T>
__global__ void fill(T* out, T value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""
PLAIN = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'


@pytest.fixture
def directory(tmp_path, events):
    """Two sm_90 kernels (one with name expressions: binary, manifest, symbol map), one manifest CUB-sized."""
    root = tmp_path / "c"
    opts = ProgramOptions(arch="sm_90", std="c++17")
    with TieredProgramCache(root) as cache:
        tiered_progcache.compile(TEMPLATED, "c++", opts, cache=cache, name_expressions=["fill<int>"])
        tiered_progcache.compile(PLAIN, "c++", opts, cache=cache)
    local = LocalDir(root)
    name = entry_name(events[1].key)
    m = decode_manifest(local.read_entry(manifest_name(name)), entry=name)
    headers = tuple(HeaderFile("I0", f"cub/detail/header_{n:04d}.cuh", "ab" * 32) for n in range(900))
    local.write_entry(manifest_name(name), encode_manifest(dataclasses.replace(m, inputs=dataclasses.replace(m.inputs, headers=headers))))
    assert local.path_for(manifest_name(name)).stat().st_size > METADATA_READ_BYTES  # what kind_of calls a kernel
    return root


def test_stats_export_and_prometheus_count_the_same_kernels(directory, tmp_path):
    env = {"TIERED_PROGCACHE_DIR": str(directory)}
    shown = json.loads(run_cli("stats", "--json", env=env).stdout)["local"]
    assert (shown["kernels"], shown["metadata"]) == (2, 3)
    exported = export_bundle(LocalDir(directory), tmp_path / "all.tpcb")
    assert (exported.entries - exported.metadata, exported.metadata) == (2, 3)
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    text = run_cli("stats", "--prometheus", env=env).stdout
    gauges = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.labels.get("tier") == "local"}
    assert (gauges["tiered_progcache_kernels"], gauges["tiered_progcache_entries"]) == (2, 5)


def test_export_arch_of_another_sm_ships_no_lone_symbol_map(directory, tmp_path):
    other = export_bundle(LocalDir(directory), tmp_path / "sm80.tpcb", arch="sm_80")
    assert (other.entries, other.metadata, other.skipped) == (0, 0, 5)
    same = export_bundle(LocalDir(directory), tmp_path / "sm90.tpcb", arch="sm_90")
    assert (same.entries, same.metadata, same.skipped) == (5, 3, 0)  # the symbol map goes with its binary
    proc = run_cli("export", str(tmp_path / "x.tpcb"), "--arch", "sm_80", env={"TIERED_PROGCACHE_DIR": str(directory)})
    assert proc.returncode == 0 and "exported 0 kernels (+0 metadata" in proc.stdout and "5 filtered out" in proc.stdout
