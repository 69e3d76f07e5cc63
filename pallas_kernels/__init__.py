"""Mosaic GPU kernels for Hopper. Nothing here knows about Transformers."""
from pallas_kernels.epilogue import EpilogueOutput, EpilogueTile, InputKind, OutputKind
from pallas_kernels import epilogue
from pallas_kernels.gemm_mgpu import (CLIP_M_MULTIPLE, GemmConfig, MatDim, Schedule,
                                     check_operands, default_config, gemm, interpret_params,
                                     smem_bytes)
from pallas_kernels import autotune, kernel_cache

__all__ = [
    "CLIP_M_MULTIPLE", "EpilogueOutput", "EpilogueTile", "GemmConfig", "InputKind", "MatDim", "Schedule",
    "OutputKind", "autotune", "check_operands", "default_config", "epilogue", "gemm", "interpret_params", "kernel_cache", "smem_bytes",
]
