"""Bundle size and speed: export and import of the sample kernels, and what a node given the bundle compiles (nothing)."""

from __future__ import annotations

import tempfile, time, os, pathlib
import tiered_progcache
from cuda.core import ProgramOptions
from tiered_progcache import TieredProgramCache, LocalDir
from tiered_progcache.ops.bundle import export_bundle, import_bundle
from tiered_progcache.samples import matmul_source, TILE_SIZES, EPILOGUES
tmp = pathlib.Path(tempfile.mkdtemp())
srcs = [matmul_source(t, e) for t in TILE_SIZES for e in EPILOGUES]
archs = ["sm_80", "sm_90"]
t = time.perf_counter()
with TieredProgramCache(tmp / "b") as c:
    for a in archs:
        for s in srcs:
            tiered_progcache.compile(s, "c++", ProgramOptions(arch=a), cache=c)
compile_s = time.perf_counter() - t
raw = sum(e.size for e in LocalDir(tmp / "b").iter_entries())
for fmt in ("auto", None):
    t = time.perf_counter(); r = export_bundle(LocalDir(tmp / "b"), tmp / f"k{fmt}", compression=fmt); ex = time.perf_counter() - t
    t = time.perf_counter(); i = import_bundle(tmp / f"k{fmt}", LocalDir(tmp / f"f{fmt}")); im = time.perf_counter() - t
    print(f"{'zstd' if r.compressed else 'tar '}: {r.entries} entries, {raw} B raw -> bundle {os.path.getsize(tmp / f'k{fmt}')} B; export {ex*1e3:.1f} ms, import (verify+land) {im*1e3:.1f} ms")
before = tiered_progcache.compile_count(); t = time.perf_counter()
with TieredProgramCache(tmp / "fauto") as c:
    for a in archs:
        for s in srcs:
            tiered_progcache.compile(s, "c++", ProgramOptions(arch=a), cache=c)
print(f"cold compile of 8 kernels {compile_s:.2f} s; after import: {tiered_progcache.compile_count()-before} NVRTC runs, {time.perf_counter()-t:.3f} s")
r = export_bundle(LocalDir(tmp / "b"), tmp / "sm90", arch="sm_90"); print("arch sm_90 filter:", r.entries, "of 8, skipped", r.skipped)
