"""Torch models of every labkit family, as pure functions over explicit weights.

- `weights`: seeded random weights named like Hugging Face checkpoints (the naming
  scheme is documented there); `checkpoint`: local safetensors loading, through
  `hf_names` (the families whose checkpoints name things otherwise).
- building blocks a tensor-parallel rank calls on its slice: `layers` (norms, RoPE,
  attention with LSE, SwiGLU), `gqa`, `mla` (naive and absorbed), `dsa` (indexer),
  `kda` (gated delta rule), `moe` (routing, experts); `sharding`: TP slices.
- `reference`: single-device whole-sequence forward passes, the ground truth.
- `family`: the constants a model computes with (RoPE, eps, router; from its
  config.json or its family's defaults) and whether labkit can compute it.
"""

from labkit.engine.compute.models.checkpoint import CheckpointError, load_safetensors
from labkit.engine.compute.models.family import FamilyConfig, check_computable, family_config
from labkit.engine.compute.models.reference import (
    attention_block, decoder_layer, lm_head_weight, mlp_block, reference_greedy, reference_hidden,
    reference_logits, reference_mtp_logits)
from labkit.engine.compute.models.sharding import tp_shard
from labkit.engine.compute.models.weights import (
    init_tensor, init_weights, layer_shapes, layer_weights, weight_shapes)

__all__ = [
    "CheckpointError", "FamilyConfig", "attention_block", "check_computable", "decoder_layer",
    "family_config",
    "init_tensor", "init_weights", "layer_shapes", "layer_weights", "lm_head_weight",
    "load_safetensors", "mlp_block", "reference_greedy", "reference_hidden", "reference_logits",
    "reference_mtp_logits", "tp_shard", "weight_shapes",
]
