"""Two real CCCL kernels the header benchmarks compile, and where CCCL's headers are (or None)."""

from __future__ import annotations

import os

from tiered_progcache.samples import matmul_source

#: libcu++ only: ``<cuda/std/...>`` headers in front of the sample kernel.
CUDA_STD_KERNEL = "#include <cuda/std/type_traits>\n#include <cuda/std/limits>\n" + matmul_source(16)

#: ``cub::BlockReduce``: its headers reach Thrust's computed ``#include``, so the whole CCCL tree is digested.
CUB_KERNEL = r"""#include <cub/block/block_reduce.cuh>
extern "C" __global__ void block_sum(const float* in, float* out) {
  using BlockReduce = cub::BlockReduce<float, 128>;
  __shared__ typename BlockReduce::TempStorage temp;
  float s = BlockReduce(temp).Sum(in[threadIdx.x]);
  if (threadIdx.x == 0) *out = s;
}
"""


def cccl_dir() -> str | None:
    """CCCL's include directory as cuda.pathfinder finds it, or None."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cccl")
    except Exception:
        found = None
    if found and os.path.isfile(os.path.join(found, "cub", "block", "block_reduce.cuh")):
        return found
    return None
