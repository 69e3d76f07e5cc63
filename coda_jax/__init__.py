"""coda-jax: Transformer-block operators run inside Hopper GEMM epilogues.

The public API for writing a fused op of your own (docs/new_fused_op.md): ``gemm_epilogue``
(and ``epilogue_pass``, the same program with no GEMM), the primitives below,
``Primitive`` to subclass, the operand and output kinds, and ``reduce_like`` for weight
gradients under ``jax.shard_map``. Beyond Llama: LayerNorm,
biases and the GELU MLP (``layernorm_ops``), QK-norm (``qk_norm``)."""
from coda_jax.epilogue_gemm import (IMPLS, epilogue_pass, gemm_epilogue, kernel_config, reference,
                          scalar_operand)
from coda_jax.primitives import (AddBias, AddTile, BColumnSum, ColSum, Env, Gated, MulTile,
                                 PickColumn, Primitive, Rotate, RowDot, RowLogSumExp, RowSum,
                                 ScaleCol, ScaleConst, ScaleRow, Store, finish_lse)
from coda_jax.dispatch import implementation
from coda_jax.sharding import reduce_like
from pallas_kernels import EpilogueOutput, InputKind, OutputKind

__all__ = [
    "IMPLS", "AddBias", "AddTile", "BColumnSum", "ColSum", "Env", "EpilogueOutput", "Gated",
    "InputKind", "MulTile", "OutputKind", "PickColumn", "Primitive", "Rotate", "RowDot",
    "RowLogSumExp", "RowSum", "ScaleCol", "ScaleConst", "ScaleRow", "Store",
    "epilogue_pass", "finish_lse", "gemm_epilogue", "implementation", "kernel_config",
    "reduce_like", "reference", "scalar_operand",
]

# Each imports the library's own modules (above) first.
from coda_jax.layernorm_ops import (AddOuter, Gelu, GeluGrad,  # noqa: E402
                                    LayerNormConfig, LayerNormGrad, layernorm_gelu_mlp,
                                    layernorm_matmul, residual_layernorm,
                                    residual_layernorm_gelu_mlp)
from coda_jax.qk_norm import (HeadRmsNorm, HeadRmsNormGrad,  # noqa: E402
                              rmsnorm_qkv_qknorm_rope)

__all__ += ["AddOuter", "Gelu", "GeluGrad", "HeadRmsNorm", "HeadRmsNormGrad", "LayerNormConfig",
            "LayerNormGrad", "layernorm_gelu_mlp", "layernorm_matmul", "residual_layernorm",
            "residual_layernorm_gelu_mlp", "rmsnorm_qkv_qknorm_rope"]
