"""Flax NNX layers, a Llama-style and a GPT-2-style model over coda-jax's fused ops."""
from flax_layers.config import CONFIGS, LlamaConfig, get_config
from flax_layers.layers import (FusedMLP, LMHeadLoss, OutProjection, QKVProjection,
                                causal_attention)
from flax_layers.model import Llama, LlamaBlock
from flax_layers.checkpoint import load_hf_checkpoint, save_hf_checkpoint  # after model
from flax_layers.gpt2 import GPT2, GPT2Config, get_gpt2_config  # after checkpoint

__all__ = ["CONFIGS", "FusedMLP", "GPT2", "GPT2Config", "LMHeadLoss", "Llama", "LlamaBlock",
           "LlamaConfig", "OutProjection", "QKVProjection", "causal_attention", "get_config",
           "get_gpt2_config", "load_hf_checkpoint", "save_hf_checkpoint"]
