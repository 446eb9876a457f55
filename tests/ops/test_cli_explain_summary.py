"""Issue 28 item 8: what EXPLAIN and ``explain`` show a person: a first miss with nothing similar is logged
even under the application's WARNING level, a CUB-sized manifest prints a bounded summary whose ``missing``
line holds header spellings only, and ``explain ... | head`` ends without a traceback."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import tiered_progcache
from cuda.core import ProgramOptions
from tiered_progcache import LocalDir, TieredProgramCache
from tiered_progcache.compiling.keys import HeaderFile
from tiered_progcache.compiling.manifest import decode_manifest, encode_manifest, header_spellings, manifest_name
from tiered_progcache.ops.cli import EXPLAIN_HEADERS_SHOWN
from tiered_progcache.stores.store import entry_name

from support import run_cli

SRC = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
OPTS = ProgramOptions(arch="sm_80", std="c++17")
#: What a CUB kernel's scan records as missing: NVRTC built-ins and what is not a header at all.
MISSING = ("cuda_runtime.h", "cstdint", "-Wdeprecated", "cfi", "hidden", "min", "max",
           "__THRUST_DEVICE_SYSTEM_ROOT/execution_policy.h", "nv/target", "../up.h")  # fmt: skip
HEADERS = 1500


def _big_manifest(tmp_path, events) -> tuple[str, dict[str, str]]:
    """A local directory with one kernel whose manifest records CUB's number of headers and its missing list."""
    root = tmp_path / "c"
    with TieredProgramCache(root) as cache:
        tiered_progcache.compile(SRC, "c++", OPTS, cache=cache)
    name = entry_name(events[0].key)
    local = LocalDir(root)
    m = decode_manifest(local.read_entry(manifest_name(name)), entry=name)
    headers = tuple(HeaderFile("I0", f"cub/detail/header_{n:04d}.cuh", "ab" * 32) for n in range(HEADERS))
    big = dataclasses.replace(m, inputs=dataclasses.replace(m.inputs, headers=headers, missing=MISSING))
    local.write_entry(manifest_name(name), encode_manifest(big))
    return name, {"TIERED_PROGCACHE_DIR": str(root)}


def test_explain_of_a_cub_sized_manifest_is_a_bounded_summary(tmp_path, events):
    name, env = _big_manifest(tmp_path, events)
    shown = run_cli("explain", name, env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    header_lines = [line for line in lines if line.startswith("  I0 ")]
    assert len(header_lines) == EXPLAIN_HEADERS_SHOWN and len(lines) < EXPLAIN_HEADERS_SHOWN + 20
    assert f"  ... and {HEADERS - EXPLAIN_HEADERS_SHOWN} more headers (explain --json lists every one)" in lines
    (missing,) = [line for line in lines if line.startswith("missing ")]
    assert missing == "missing       cuda_runtime.h, cstdint, nv/target, ../up.h (+6 not header names)"
    every = run_cli("explain", name, "--all", env=env)
    assert len([line for line in every.stdout.splitlines() if line.startswith("  I0 ")]) == HEADERS


def test_header_spellings_keep_paths_and_standard_names_only():
    assert header_spellings(MISSING) == ["cuda_runtime.h", "cstdint", "nv/target", "../up.h"]
    assert header_spellings(["vector", "type_traits", "a b.h", ""]) == ["vector", "type_traits"]


def test_explain_into_a_closed_pipe_ends_without_a_traceback(tmp_path, events):
    name, env = _big_manifest(tmp_path, events)
    cmd = f"{sys.executable} -m tiered_progcache explain {name} --all | head -1"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert proc.stdout.startswith(f"entry         {name}") and proc.stdout.count("\n") == 1
    assert proc.stderr == ""


_APP = r"""
import logging
logging.basicConfig()  # the application's logging: WARNING and up
import tiered_progcache
from cuda.core import ProgramOptions
cache = tiered_progcache.TieredProgramCache.from_env()
tiered_progcache.compile('extern "C" __global__ void first(int *p) { *p = 1; }', "c++", ProgramOptions(arch="sm_80"),
                         cache=cache)
"""


def test_explain_logs_a_first_miss_with_nothing_similar_under_the_application_s_warning_level(tmp_path):
    env = {**os.environ, "TIERED_PROGCACHE_DIR": str(tmp_path / "c"), "TIERED_PROGCACHE_EXPLAIN": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _APP], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if ": nothing similar stored (0 manifests read)" in line]
    assert len(lines) == 1 and lines[0].startswith("tiered_progcache.compiling.compile INFO: miss "), proc.stderr
