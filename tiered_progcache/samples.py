"""The cuda-samples persistentProgramCache kernel: a tiled matmul with a compile-time epilogue.

``C = epilogue(A @ B + bias)``, specialised by tile size (16 or 32) and epilogue
(``identity`` or ``relu``). Shared by the example, the tests and the benchmarks so
they all compile the same, realistic kernel.
"""

from __future__ import annotations

__all__ = ["EPILOGUES", "KERNEL_NAME", "TILE_SIZES", "matmul_source"]

KERNEL_NAME = "matmul_epilogue"
TILE_SIZES = (16, 32)
EPILOGUES = ("identity", "relu")

_EPILOGUE_BODY = {
    "identity": "return x;",
    "relu": "return x > 0.0f ? x : 0.0f;",
}

_TEMPLATE = r"""
#define TILE {tile}

__device__ __forceinline__ float epilogue(float x) {{ {epilogue} }}

extern "C" __global__ void {name}(const float* __restrict__ A, const float* __restrict__ B,
                                  const float* __restrict__ bias, float* __restrict__ C,
                                  int M, int N, int K)
{{
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int row = blockIdx.y * TILE + threadIdx.y;
    const int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < (K + TILE - 1) / TILE; ++t) {{
        const int a_col = t * TILE + threadIdx.x;
        const int b_row = t * TILE + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < M && a_col < K) ? A[row * K + a_col] : 0.0f;
        Bs[threadIdx.y][threadIdx.x] = (b_row < K && col < N) ? B[b_row * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TILE; ++i) {{
            acc += As[threadIdx.y][i] * Bs[i][threadIdx.x];
        }}
        __syncthreads();
    }}
    if (row < M && col < N) {{
        C[row * N + col] = epilogue(acc + bias[col]);
    }}
}}
"""


def matmul_source(tile: int = 16, epilogue: str = "identity") -> str:
    """CUDA C++ source of the sample kernel for one (tile, epilogue) specialisation."""
    if tile not in TILE_SIZES:
        raise ValueError(f"tile must be one of {TILE_SIZES}, got {tile!r}")
    if epilogue not in _EPILOGUE_BODY:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    return _TEMPLATE.format(tile=tile, epilogue=_EPILOGUE_BODY[epilogue], name=KERNEL_NAME)
