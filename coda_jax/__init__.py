"""coda-jax: Transformer-block operators run inside Hopper GEMM epilogues."""
from coda_jax.ops import IMPLS, gemm_epilogue, kernel_config, reference, scalar_operand
from coda_jax.primitives import (AddTile, ColSum, Gated, Rotate, RowLogSumExp, RowSum,
                                 ScaleCol, ScaleConst, ScaleRow, Store, finish_lse)

__all__ = [
    "IMPLS", "AddTile", "ColSum", "Gated", "Rotate", "RowLogSumExp", "RowSum", "ScaleCol",
    "ScaleConst", "ScaleRow", "Store", "finish_lse", "gemm_epilogue", "kernel_config", "reference",
    "scalar_operand",
]
