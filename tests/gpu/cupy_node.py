"""One GPU node for the CuPy check, and the driver that runs two of them (``--drive OUT``).

A node runs, in a fresh process with its own empty ``CUPY_CACHE_DIR`` and the shared
``file://`` remote the driver gives it, an ``ElementwiseKernel``, a ``ReductionKernel``
and a ``RawModule`` with ``name_expressions`` whose source includes a header through
``-I``, each checked against numpy, with :func:`tiered_progcache.cupy.install` in place.
It reports one JSON line: seconds from interpreter start to the first result (all three
checked) and from the first launch to it; NVRTC runs counted at CuPy's own call of
``nvrtc.compileProgram`` (this script's instrumentation, not the library's), split into
CuPy's empty-file preprocess (``compiler._preprocess``, which CuPy runs once per option
set in every process to name its entries, hit or miss) and kernel compiles; and the
backend's own counters (a save is a compile CuPy made). The driver runs node A, then
node B, on one remote, prints both, and writes them to ``OUT/cupy_gpu.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()

REPO = Path(__file__).resolve().parents[2]

HEADER = "#define SCALE_BY(x) ((x) * 3)\n"
RAW_SOURCE = r"""
#include "scale.h"
template<typename T>
__global__ void scale(const T* x, T* y, int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) y[i] = SCALE_BY(x[i]);
}
"""
NAME_EXPRESSIONS = ("scale<float>", "scale<double>")


def node(include_dir: str) -> dict:
    """Run the three kernels (see the module docstring) and say what it took."""
    import numpy as np
    import cupy
    from cupy.cuda import compiler
    from cupy_backends.cuda.libs import nvrtc

    import tiered_progcache.cupy as tpc

    counts = {"nvrtc": 0, "preprocess": 0, "preprocess_s": 0.0}
    compile_program, preprocess = nvrtc.compileProgram, compiler._preprocess

    def counted_compile(*args, **kwargs):
        counts["nvrtc"] += 1
        return compile_program(*args, **kwargs)

    def counted_preprocess(*args, **kwargs):
        counts["preprocess"] += 1
        started = time.perf_counter()
        try:
            return preprocess(*args, **kwargs)
        finally:
            counts["preprocess_s"] += time.perf_counter() - started

    nvrtc.compileProgram, compiler._preprocess = counted_compile, counted_preprocess
    installed = tpc.install()

    n = 1 << 20
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal(n).astype(np.float32)
    y_host = rng.standard_normal(n).astype(np.float32)
    xd_host = rng.standard_normal(4096)
    x, y = cupy.asarray(x_host), cupy.asarray(y_host)
    xd = cupy.asarray(xd_host)
    cupy.cuda.Device().synchronize()
    launched = time.perf_counter()

    axpby = cupy.ElementwiseKernel("T x, T y, T a", "T z", "z = a * x + y * y", "tpc_axpby")
    z = axpby(x, y, np.float32(2.0))
    sum_sq = cupy.ReductionKernel("T x", "T y", "x * x", "a + b", "y = a", "0", "tpc_sum_sq")
    s = sum_sq(xd)
    module = cupy.RawModule(code=RAW_SOURCE, options=("-std=c++17", "-I" + include_dir),
                            name_expressions=NAME_EXPRESSIONS)  # fmt: skip
    out_f = cupy.empty_like(x)
    module.get_function("scale<float>")(((n + 255) // 256,), (256,), (x, out_f, np.int32(n)))
    out_d = cupy.empty_like(xd)
    module.get_function("scale<double>")(((xd.size + 255) // 256,), (256,), (xd, out_d, np.int32(xd.size)))
    z_host, s_host, f_host, d_host = z.get(), float(s.get()), out_f.get(), out_d.get()
    done = time.perf_counter()

    matches = {
        "elementwise": bool(np.allclose(z_host, 2.0 * x_host + y_host * y_host, rtol=1e-5, atol=1e-5)),
        "reduction": bool(np.isclose(s_host, float(np.sum(xd_host * xd_host)), rtol=1e-9)),
        "raw_module_float": bool(np.allclose(f_host, x_host * 3, rtol=1e-6)),
        "raw_module_double": bool(np.allclose(d_host, xd_host * 3, rtol=1e-12)),
    }
    chain = tpc.shared_cache()
    flushed = chain.flush(timeout=60) if chain is not None else True
    stats = tpc.stats()
    local = stats["cupy-local"]
    return {
        "installed": installed,
        "first_result_s": round(done - STARTED, 3),
        "launch_to_result_s": round(done - launched, 3),
        "matches": matches,
        "nvrtc_runs": counts["nvrtc"],
        "preprocess_runs": counts["preprocess"],
        "kernel_nvrtc_runs": counts["nvrtc"] - counts["preprocess"],
        "preprocess_s": round(counts["preprocess_s"], 3),
        "saves": local.writes,
        "local": {"hits": local.hits, "misses": local.misses, "skipped": local.skipped},
        "remote": stats["remote"].as_dict() if "remote" in stats else None,
        "cache_files": sorted(os.listdir(os.environ["CUPY_CACHE_DIR"])),
        "flushed": flushed,
        "cupy": cupy.__version__,
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
    }


def run_node(work: Path, name: str, remote: Path, include_dir: Path) -> dict:
    env = dict(os.environ, CUPY_CACHE_DIR=str(work / name), TIERED_PROGCACHE_REMOTE=f"file://{remote}",
               TIERED_PROGCACHE_STRICT="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))  # fmt: skip
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    done = subprocess.run([sys.executable, __file__, "--node", str(include_dir)], env=env, capture_output=True,
                          text=True, timeout=150)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"node {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def drive(out: Path) -> dict:
    """Node A, then node B, each fresh, on one ``file://`` remote; both reports, printed and written under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tpc-cupy-") as tmp:
        work = Path(tmp)
        remote, include_dir = work / "remote", work / "include"
        remote.mkdir()
        include_dir.mkdir()
        (include_dir / "scale.h").write_text(HEADER)
        a = run_node(work, "node-a", remote, include_dir)
        b = run_node(work, "node-b", remote, include_dir)
    result = {"node_a": a, "node_b": b, "b_over_a_first_result": round(b["first_result_s"] / a["first_result_s"], 3),
              "b_over_a_launch_to_result": round(b["launch_to_result_s"] / a["launch_to_result_s"], 3)}  # fmt: skip
    (out / "cupy_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"node A: {json.dumps(a)}\nnode B: {json.dumps(b)}")
    print(f"time to first result (interpreter start -> 3 kernels checked): node A {a['first_result_s']:.3f} s "
          f"(compiled), node B {b['first_result_s']:.3f} s (shared tier), B/A = {result['b_over_a_first_result']:.2f}; "
          f"first launch to result: A {a['launch_to_result_s']:.3f} s, B {b['launch_to_result_s']:.3f} s, "
          f"B/A = {result['b_over_a_launch_to_result']:.2f}")  # fmt: skip
    print(f"NVRTC runs: A {a['kernel_nvrtc_runs']} kernel compiles + {a['preprocess_runs']} CuPy empty-file "
          f"preprocess ({a['preprocess_s']:.3f} s); B {b['kernel_nvrtc_runs']} kernel compiles + "
          f"{b['preprocess_runs']} CuPy empty-file preprocess ({b['preprocess_s']:.3f} s)")  # fmt: skip
    ok = (all(a["matches"].values()) and all(b["matches"].values()) and b["kernel_nvrtc_runs"] == 0
          and b["saves"] == 0 and a["saves"] >= 3 and a["flushed"])  # fmt: skip
    print("PASS" if ok else "FAIL")
    result["ok"] = ok
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--node"]:
        print(json.dumps(node(sys.argv[2])))
    elif sys.argv[1:2] == ["--drive"]:
        sys.exit(0 if drive(Path(sys.argv[2]))["ok"] else 1)
    else:
        sys.exit(f"usage: {sys.argv[0]} --drive OUT_DIR")
