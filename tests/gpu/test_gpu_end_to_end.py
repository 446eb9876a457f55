"""GPU end to end: compile through ``tiered_progcache.compiling.compile``, load from each tier, launch, check.

Two kernels: the cuda-samples tiled matmul (``tiered_progcache.samples``) and a templated
block sum built on CCCL's ``cub::BlockReduce`` (an ``include_path`` compile with a
``name_expressions`` lookup, both of which cuda-core's own cache refuses). Each is
compiled once, then loaded from the memory tier, from the local directory in a fresh
chain, and from a ``file://`` remote into an empty local directory; every load is
launched and compared with numpy.

The device tests skip where no CUDA device (or cupy) is usable. ``test_tier_walk_without_a_device``
runs everything but the launch, so the same code paths are exercised on a CPU-only host.

Needs: cuda-core >= 1.2, NVRTC, numpy, fsspec, cupy (device tests only) and CCCL headers
(from cuda.pathfinder, CUDA_HOME, the nvidia wheels or cupy's bundled copy).
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda.core import ObjectCode, ProgramOptions

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.samples import KERNEL_NAME, matmul_source

pytestmark = pytest.mark.gpu

BLOCK_SUM = r"""
#include <cub/block/block_reduce.cuh>

template <int BLOCK>
__global__ void block_sum(const float* __restrict__ in, float* __restrict__ out, int n)
{
    using Reduce = cub::BlockReduce<float, BLOCK>;
    __shared__ typename Reduce::TempStorage scratch;
    const int i = blockIdx.x * BLOCK + threadIdx.x;
    const float v = i < n ? in[i] : 0.0f;
    const float total = Reduce(scratch).Sum(v);
    if (threadIdx.x == 0) out[blockIdx.x] = total;
}
"""
BLOCK = 128
BLOCK_SUM_NAME = f"block_sum<{BLOCK}>"


# -- what the host has -------------------------------------------------------------------------------


def _device_or_skip():
    """The first CUDA device, made current; skips the test when none is usable here."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuInit: {err}")
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or count < 1:
            raise RuntimeError(f"no CUDA device (cuDeviceGetCount: {err}, {count})")
        from cuda.core import Device

        dev = Device(0)
        dev.set_current()
        return dev
    except Exception as exc:  # any failure to reach a device means: not a GPU host
        pytest.skip(f"no usable CUDA device: {type(exc).__name__}: {exc}")


def _cupy_or_skip():
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception as exc:
        pytest.skip(f"cupy not usable: {type(exc).__name__}: {exc}")


def _cccl_include_dirs() -> list[str]:
    """Directories that together provide <cub/...> and <cuda/std/...>, or [] if none are found."""
    candidates: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cccl")
        if found:
            candidates.append(found)
    except Exception:
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates += [os.path.join(os.environ[env], "include", "cccl"), os.path.join(os.environ[env], "include")]
    candidates += ["/usr/local/cuda/include/cccl", "/usr/local/cuda/include"]
    for site in sys.path:
        candidates += glob.glob(os.path.join(site, "nvidia", "cu*", "include", "cccl"))
        candidates += glob.glob(os.path.join(site, "nvidia", "cuda_cccl", "include"))
        cupy_cccl = os.path.join(site, "cupy", "_core", "include", "cupy", "_cccl")
        candidates += [os.path.join(cupy_cccl, "cub"), os.path.join(cupy_cccl, "libcudacxx"),
                       os.path.join(cupy_cccl, "thrust")]
    cub = next((d for d in candidates if os.path.isfile(os.path.join(d, "cub", "block", "block_reduce.cuh"))), None)
    std = next((d for d in candidates if os.path.isfile(os.path.join(d, "cuda", "std", "type_traits"))), None)
    if cub is None or std is None:
        return []
    dirs = [cub] if cub == std else [cub, std]
    thrust = next((d for d in candidates if os.path.isfile(os.path.join(d, "thrust", "version.h"))), None)
    if thrust is not None and thrust not in dirs:
        dirs.append(thrust)  # cub reaches into thrust in some versions
    return dirs


def _cccl_or_skip() -> list[str]:
    dirs = _cccl_include_dirs()
    if not dirs:
        pytest.skip("no CCCL headers found (cuda.pathfinder, CUDA_HOME, nvidia wheels, cupy)")
    return dirs


# -- the tier walk (no device needed) ----------------------------------------------------------------


def tier_walk(
    root: Path, source: str, options: ProgramOptions, names: tuple[str, ...] = ()
) -> list[tuple[str, ObjectCode]]:
    """Compile once, then get the same entry from memory, local and remote: ``[(tier, obj), ...]``.

    Asserts that each load came from the tier it is named after and that the compiler ran once.
    """
    remote = f"file://{root / 'remote'}"
    (root / "remote").mkdir(parents=True, exist_ok=True)  # a missing file:// root is an error, not created
    compiles = tpc.compile_count()
    loads: list[tuple[str, ObjectCode]] = []

    def get(cache: TieredProgramCache, tier: str) -> ObjectCode:
        before = cache.stats()
        obj = tpc.compile(source, "c++", options, cache=cache, name_expressions=names)
        delta = cache.stats() - before
        assert delta[tier].hits >= 1, f"expected a {tier} hit, got {delta}"
        return obj

    with TieredProgramCache(root / "node-a", remote=remote) as cache:
        loads.append(("compiled", tpc.compile(source, "c++", options, cache=cache, name_expressions=names)))
        assert cache.flush(60), "upload to the file:// remote did not finish"
        loads.append(("memory", get(cache, "memory")))
    with TieredProgramCache(root / "node-a") as cache:  # a new process's view: empty memory
        loads.append(("local", get(cache, "local")))
    with TieredProgramCache(root / "node-b", remote=remote) as cache:  # another node: empty local dir
        loads.append(("remote", get(cache, "remote")))

    assert tpc.compile_count() - compiles == 1
    first = bytes(loads[0][1].code)
    for tier, obj in loads:
        assert bytes(obj.code) == first, tier
        for name in names:
            assert obj.symbol_mapping[name] == loads[0][1].symbol_mapping[name], tier
    return loads


def _matmul_options(arch: str) -> ProgramOptions:
    return ProgramOptions(arch=arch, std="c++17")


def _block_sum_options(arch: str, include_dirs: list[str]) -> ProgramOptions:
    return ProgramOptions(arch=arch, std="c++17", include_path=include_dirs)


def test_tier_walk_without_a_device(tmp_path):
    """Everything the device tests do up to the launch, for sm_90, on any host."""
    for tile in (16, 32):
        loads = tier_walk(tmp_path / f"mm{tile}", matmul_source(tile, "relu"), _matmul_options("sm_90"))
        assert [t for t, _ in loads] == ["compiled", "memory", "local", "remote"]
    dirs = _cccl_or_skip()
    loads = tier_walk(tmp_path / "cub", BLOCK_SUM, _block_sum_options("sm_90", dirs), (BLOCK_SUM_NAME,))
    for _, obj in loads:
        assert obj.symbol_mapping[BLOCK_SUM_NAME].startswith(b"_Z9block_sumILi128EE")


# -- on the device -------------------------------------------------------------------------------------


def _arch(dev) -> str:
    return f"sm_{dev.arch}"


@pytest.mark.parametrize("tile,epilogue", [(16, "identity"), (32, "relu")])
def test_matmul_from_every_tier_matches_numpy(tmp_path, tile, epilogue):
    dev = _device_or_skip()
    cp = _cupy_or_skip()
    from cuda.core import LaunchConfig, launch

    m, n, k = 200, 130, 96  # not multiples of the tile: the bounds checks matter
    rng = np.random.default_rng(tile)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32)
    expected = a @ b + bias
    if epilogue == "relu":
        expected = np.maximum(expected, 0.0)

    d_a, d_b, d_bias = cp.asarray(a), cp.asarray(b), cp.asarray(bias)
    stream = dev.create_stream()
    config = LaunchConfig(grid=((n + tile - 1) // tile, (m + tile - 1) // tile, 1), block=(tile, tile, 1))
    for tier, obj in tier_walk(tmp_path, matmul_source(tile, epilogue), _matmul_options(_arch(dev))):
        d_c = cp.zeros((m, n), dtype=cp.float32)
        cp.cuda.runtime.deviceSynchronize()
        launch(stream, config, obj.get_kernel(KERNEL_NAME), d_a.data.ptr, d_b.data.ptr, d_bias.data.ptr,
               d_c.data.ptr, np.int32(m), np.int32(n), np.int32(k))
        stream.sync()
        np.testing.assert_allclose(cp.asnumpy(d_c), expected, rtol=1e-3, atol=1e-3, err_msg=f"from {tier}")


def test_cccl_block_sum_from_every_tier_matches_numpy(tmp_path):
    dev = _device_or_skip()
    cp = _cupy_or_skip()
    dirs = _cccl_or_skip()
    from cuda.core import LaunchConfig, launch

    blocks = 37
    total = blocks * BLOCK - 50  # a ragged last block
    data = np.random.default_rng(7).standard_normal(total, dtype=np.float32)
    padded = np.zeros(blocks * BLOCK, dtype=np.float32)
    padded[:total] = data
    expected = padded.reshape(blocks, BLOCK).sum(axis=1, dtype=np.float64)

    d_in = cp.asarray(data)
    stream = dev.create_stream()
    config = LaunchConfig(grid=(blocks, 1, 1), block=(BLOCK, 1, 1))
    loads = tier_walk(tmp_path, BLOCK_SUM, _block_sum_options(_arch(dev), dirs), (BLOCK_SUM_NAME,))
    for tier, obj in loads:
        d_out = cp.zeros(blocks, dtype=cp.float32)
        cp.cuda.runtime.deviceSynchronize()
        launch(stream, config, obj.get_kernel(BLOCK_SUM_NAME), d_in.data.ptr, d_out.data.ptr, np.int32(total))
        stream.sync()
        np.testing.assert_allclose(cp.asnumpy(d_out), expected, rtol=1e-4, atol=1e-3, err_msg=f"from {tier}")
