"""The cuda-samples persistentProgramCache sample, on the tiered cache.

Compiles a tiled matmul + epilogue kernel through ``TieredProgramCache`` and says
which tier answered. Run it twice: the first run compiles (MISS), the second loads
the cubin from disk (LOCAL); within a run a second lookup is a MEMORY hit. With a
GPU it launches the kernel and checks it against numpy; without one it says so and
still compiles and reports.

    python examples/persistent_program_cache.py [--tile-size 32] [--epilogue relu]
    python examples/persistent_program_cache.py --remote file:///nfs/kernels   # a shared tier

Expected output (no GPU, second run; timings vary)::

    No CUDA device: compiling for sm_90 without launching (pass --arch to choose).
    Cache dir   : /root/.cache/cuda-python/program-cache
    Workload    : C = identity(A @ B + bias), M=512 N=512 K=512, tile 16
    Cache status: LOCAL
    Key         : cddc847b06b9fb2cfc249b71
    Artifact    : 5.4 KiB cubin
    Key derive  : 6.20 ms (make_program_cache_key; first call probes NVRTC)
    Lookup      : 0.32 ms
    Compile     : 0.00 ms (skipped)
    Store       : 0.00 ms (skipped)
    Module load : n/a (no GPU)
    Host prep   : 6.52 ms total
    Second lookup in this process: MEMORY (0.005 ms)

With a GPU the first lines name the device and the last three read
``Kernel time``, ``Max error`` and ``Validation  : PASSED``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from cuda.core import ObjectCode, Program, ProgramOptions
from cuda.core.utils import make_program_cache_key

from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.localdir import default_local_dir
from tiered_progcache.samples import EPILOGUES, KERNEL_NAME, TILE_SIZES, matmul_source


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--m", type=int, default=512)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--tile-size", type=int, choices=TILE_SIZES, default=16)
    p.add_argument("--epilogue", choices=EPILOGUES, default="identity")
    p.add_argument("--cache-dir", type=Path, default=None, help="local tier (default: cuda-core's cache dir)")
    p.add_argument("--remote", default=None, help="optional shared tier URL (s3://, gs://, file://, memory://)")
    p.add_argument("--clear-cache", action="store_true", help="empty the local tiers first")
    p.add_argument("--arch", default=None, help="target arch when there is no GPU (default sm_90)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iterations", type=int, default=20)
    args = p.parse_args(argv)
    if min(args.m, args.n, args.k) <= 0 or args.iterations <= 0 or args.warmup < 0:
        p.error("sizes and --iterations must be positive, --warmup non-negative")
    return args


def find_device(index: int):
    """The CUDA device, or None where there is none (no driver, no GPU)."""
    try:
        from cuda.core import Device, system

        if system.get_num_devices() <= index:
            return None
        device = Device(index)
        device.set_current()
        return device
    except Exception:
        return None


def tier_that_answered(before, after) -> str:
    for name in after:
        if (after[name] - before[name]).hits:
            return name.upper()
    return "MISS"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = find_device(args.device)
    if device is None:
        arch = args.arch or "sm_90"
        print(f"No CUDA device: compiling for {arch} without launching (pass --arch to choose).")
    else:
        major, minor = device.compute_capability
        arch = args.arch or f"sm_{major}{minor}"
        print(f"Device      : {device.name} (compute capability {major}.{minor})")

    cache_dir = args.cache_dir or default_local_dir()
    with TieredProgramCache(cache_dir, remote=args.remote) as cache:
        if args.clear_cache:
            cache.clear()
        source = matmul_source(args.tile_size, args.epilogue)
        options = ProgramOptions(std="c++17", arch=arch)
        print(f"Cache dir   : {cache_dir}" + (f" + remote {args.remote}" if args.remote else ""))
        print(f"Workload    : C = {args.epilogue}(A @ B + bias), M={args.m} N={args.n} K={args.k}, tile {args.tile_size}")

        tk = time.perf_counter()
        key = make_program_cache_key(code=source, code_type="c++", options=options, target_type="cubin")
        t0 = time.perf_counter()
        key_ms = (t0 - tk) * 1e3
        before = cache.stats()
        data = cache.get(key)
        t1 = time.perf_counter()
        status = tier_that_answered(before, cache.stats()) if data is not None else "MISS"
        compile_ms = store_ms = 0.0
        if data is None:
            obj = Program(source, "c++", options).compile("cubin")
            t2 = time.perf_counter()
            cache[key] = obj
            t3 = time.perf_counter()
            compile_ms, store_ms = (t2 - t1) * 1e3, (t3 - t2) * 1e3
            data = bytes(obj.code)
        else:
            obj = ObjectCode.from_cubin(data)
        lookup_ms = (t1 - t0) * 1e3

        load_ms = None
        kernel = None
        if device is not None:
            t4 = time.perf_counter()
            kernel = obj.get_kernel(KERNEL_NAME)
            load_ms = (time.perf_counter() - t4) * 1e3

        print(f"Cache status: {status}")
        print(f"Key         : {key.hex()[:24]}")
        print(f"Artifact    : {len(data) / 1024:.1f} KiB cubin")
        print(f"Key derive  : {key_ms:.2f} ms (make_program_cache_key; first call probes NVRTC)")
        print(f"Lookup      : {lookup_ms:.2f} ms")
        print(f"Compile     : {compile_ms:.2f} ms" + (" (skipped)" if status != "MISS" else ""))
        print(f"Store       : {store_ms:.2f} ms" + (" (skipped)" if status != "MISS" else ""))
        print(f"Module load : {'n/a (no GPU)' if load_ms is None else f'{load_ms:.2f} ms'}")
        print(f"Host prep   : {key_ms + lookup_ms + compile_ms + store_ms + (load_ms or 0.0):.2f} ms total")

        before = cache.stats()
        t5 = time.perf_counter()
        again = cache.get(key)
        second_ms = (time.perf_counter() - t5) * 1e3
        assert again == data
        print(f"Second lookup in this process: {tier_that_answered(before, cache.stats())} ({second_ms:.3f} ms)")

        if kernel is not None:
            return run_on_gpu(device, kernel, args)
    return 0


def run_on_gpu(device, kernel, args) -> int:
    """Launch the kernel, time it with CUDA events and check it against numpy."""
    import numpy as np
    from cuda.core import EventOptions, LaunchConfig, launch

    try:
        import cupy as cp
    except ImportError:
        print("cupy is not installed (pip install -e '.[examples]'): kernel not launched.")
        return 0

    rng = np.random.default_rng(0)
    m, n, k, tile = args.m, args.n, args.k, args.tile_size
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32)
    d_a, d_b, d_bias = cp.asarray(a), cp.asarray(b), cp.asarray(bias)
    d_c = cp.empty((m, n), dtype=cp.float32)
    device.sync()

    stream = device.create_stream()
    config = LaunchConfig(grid=(math.ceil(n / tile), math.ceil(m / tile)), block=(tile, tile))
    launch_args = (d_a.data.ptr, d_b.data.ptr, d_bias.data.ptr, d_c.data.ptr, np.int32(m), np.int32(n), np.int32(k))
    for _ in range(args.warmup):
        launch(stream, config, kernel, *launch_args)
    timing = EventOptions(timing_enabled=True)
    start = stream.record(options=timing)
    for _ in range(args.iterations):
        launch(stream, config, kernel, *launch_args)
    end = stream.record(options=timing)
    end.sync()
    kernel_ms = (end - start) / args.iterations

    expected = a.astype(np.float64) @ b.astype(np.float64) + bias
    if args.epilogue == "relu":
        expected = np.maximum(expected, 0.0)
    got = cp.asnumpy(d_c)
    max_err = float(np.max(np.abs(got - expected)))
    ok = np.allclose(got, expected, rtol=1e-3, atol=1e-3)
    gflops = 2.0 * m * n * k / (kernel_ms * 1e-3) / 1e9
    print(f"Kernel time : {kernel_ms:.4f} ms ({gflops:.1f} GFLOP/s, {args.iterations} iterations)")
    print(f"Max error   : {max_err:.3e}")
    print(f"Validation  : {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
