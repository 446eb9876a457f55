"""Manifest size: the bytes compile() stores beside an entry that includes CCCL headers (no compile needed).

A manifest's size does not depend on the compile, only on what the key covers, so this
builds the manifests of three CCCL includes with the public manifest API and prints
their header counts and encoded sizes (and zstd's, as a remote with compression stores
them), against the bound ``MAX_MANIFEST_BYTES``.

    PYTHONPATH=. python benchmarks/bench_manifest_size.py
"""

from __future__ import annotations

from cuda.core import ProgramOptions
from cuda.pathfinder import find_nvidia_header_directory

from tiered_progcache.compiling.keys import compile_key
from tiered_progcache.compiling.manifest import MAX_MANIFEST_BYTES, build_manifest, compile_inputs, encode_manifest

try:
    import zstandard
except ImportError:
    zstandard = None

options = ProgramOptions(arch="sm_90", std="c++17", include_path=[find_nvidia_header_directory("cccl")])
print(f"bound: MAX_MANIFEST_BYTES = {MAX_MANIFEST_BYTES} bytes")
for header in ("cuda/std/type_traits", "cub/block/block_reduce.cuh", "cub/cub.cuh"):
    source = f"#include <{header}>\n__global__ void k() {{}}\n"
    key = compile_key(source, "c++", options, "cubin")
    data = encode_manifest(build_manifest(key.key, compile_inputs(key, source, "c++", options, "cubin"), 1.0))
    packed = f", {len(zstandard.ZstdCompressor(level=3).compress(data))} with zstd" if zstandard else ""
    print(f"<{header}>: {len(key.headers)} headers, {len(key.missing)} found nowhere; manifest {len(data)} bytes{packed}")
