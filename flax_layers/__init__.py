"""Flax NNX layers and a Llama-style model over coda-jax's fused ops."""
from flax_layers.config import CONFIGS, LlamaConfig, get_config
from flax_layers.layers import (FusedMLP, LMHeadLoss, OutProjection, QKVProjection,
                                causal_attention)
from flax_layers.model import Llama, LlamaBlock
from flax_layers.checkpoint import load_hf_checkpoint, save_hf_checkpoint  # after model

__all__ = ["CONFIGS", "FusedMLP", "LMHeadLoss", "Llama", "LlamaBlock", "LlamaConfig",
           "OutProjection", "QKVProjection", "causal_attention", "get_config",
           "load_hf_checkpoint", "save_hf_checkpoint"]
