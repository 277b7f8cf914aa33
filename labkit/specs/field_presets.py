"""Presets of the models the field benchmarks now (2026), from their published configs.

Each number is the published `config.json`'s (read through `hf_config.py`, and
`tests/specs` checks each preset against a copy of that config and the published
parameter totals). Mechanisms labkit's simulation has no model of are mapped onto the
closest one, and the compute plane refuses these models unless their family is one it
computes:

- deepseek-r1-0528, kimi-k2.5: DeepSeek-V3 architecture (MLA, group-limited sigmoid
  routing, shared experts) — the simulation and, at tiny sizes, the compute plane.
- glm-5: DeepSeek-V3.2 architecture (MLA with the DSA indexer) at GLM's sizes; its
  indexer on every layer (GLM-5 shares none).
- minimax-m2.5: GQA with 256 sigmoid-routed experts; its all-heads q/k norm and
  partial RoPE only change the function, not the costs.
- qwen3.5-397b-a17b: gated-DeltaNet linear attention (3 of every 4 layers) beside
  gated full attention, priced through the linear-attention (KDA) fields:
  recurrent state exact, conv state and DeltaNet weights approximated (see
  `hf_readers.read_qwen3_5_moe`).
- deepseek-v4 (V4-Pro): compressed sparse attention priced as a shared 512-dim KV
  entry per kept token, one kept per 4 (CSA) or 128 (HCA) tokens per layer, with a
  DSA-like indexer; active parameters overcounted (~70 B against 49 B: its grouped
  low-rank output projection is priced as MLA's). See `hf_readers.read_deepseek_v4`.
  Its weights are priced in fp8, as gpt-oss's: labkit has no fp4, and V4-Pro ships
  its experts in FP4, so labkit's ~1.6 TB is about twice the real checkpoint, and with
  the attention overcount it needs dep32 on H200 where the real model fits on fewer.
"""

from __future__ import annotations

from dataclasses import replace

from labkit.specs.family import FAMILIES
from labkit.specs.models import ModelSpec

_MLA_DEEPSEEK = dict(attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_KIMI_K25 = replace(FAMILIES["kimi_k2"], rope=replace(FAMILIES["kimi_k2"].rope, factor=64.0))

# DeepSeek-V4-Pro: layers 0-1 HCA, then CSA and HCA alternate (compress_ratios, 61 layers)
_V4_PRO_RATIOS = (128, 128) + (4, 128) * 29 + (4,)

FIELD_MODELS = [
    ModelSpec(
        "deepseek-r1-0528", "deepseek_v3", num_layers=61, hidden_size=7168, vocab_size=129280,
        num_heads=128, **_MLA_DEEPSEEK, intermediate_size=18432, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
        first_k_dense=3, num_mtp_modules=1, weight_dtype="fp8", max_model_len=163840,
        block_size=64, source="deepseek-ai/DeepSeek-R1-0528 config.json",
    ),
    ModelSpec(
        "kimi-k2.5", "kimi_k2", num_layers=61, hidden_size=7168, vocab_size=163840,
        num_heads=64, **_MLA_DEEPSEEK, intermediate_size=18432, num_experts=384,
        num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
        first_k_dense=1, weight_dtype="fp8", max_model_len=262144, block_size=64,
        constants=_KIMI_K25, source="moonshotai/Kimi-K2.5 config.json (text_config)",
    ),
    ModelSpec(
        "glm-5", "glm_moe_dsa", num_layers=78, hidden_size=6144, vocab_size=154880,
        num_heads=64, attention="mla", q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, intermediate_size=12288,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        num_shared_experts=1, first_k_dense=3, index_num_heads=32, index_head_dim=128,
        index_topk=2048, num_mtp_modules=1, weight_dtype="fp8", max_model_len=202752,
        block_size=64, source="zai-org/GLM-5 config.json; GLM-5 technical report",
    ),
    ModelSpec(
        "minimax-m2.5", "minimax_m2", num_layers=62, hidden_size=3072, vocab_size=200064,
        num_heads=48, num_kv_heads=8, head_dim=128, intermediate_size=1536,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1536,
        num_mtp_modules=3, weight_dtype="fp8", max_model_len=196608,
        source="MiniMaxAI/MiniMax-M2.5 config.json (the MiniMax-M2 architecture)",
    ),
    ModelSpec(
        "qwen3.5-397b-a17b", "qwen3_5_moe", num_layers=60, hidden_size=4096,
        vocab_size=248320, num_heads=32, num_kv_heads=2, head_dim=256,
        intermediate_size=1024, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=1024, num_shared_experts=1,
        linear_layers=tuple(i for i in range(60) if (i + 1) % 4),
        linear_num_heads=64, linear_head_dim=128, linear_conv_kernel=4, num_mtp_modules=1,
        max_model_len=262144, block_size=64,
        source="Qwen/Qwen3.5-397B-A17B config.json (text_config; GDN:full 3:1)",
    ),
    ModelSpec(
        "deepseek-v4", "deepseek_v4", num_layers=61, hidden_size=7168, vocab_size=129280,
        num_heads=128, attention="mla", q_lora_rank=1536, kv_lora_rank=448,
        qk_nope_head_dim=448, qk_rope_head_dim=64, v_head_dim=512, intermediate_size=3072,
        num_experts=384, num_experts_per_tok=6, moe_intermediate_size=3072,
        num_shared_experts=1, index_num_heads=64, index_head_dim=128, index_topk=1024,
        kv_compress_ratios=_V4_PRO_RATIOS, num_mtp_modules=1, weight_dtype="fp8",
        max_model_len=1048576, block_size=64,
        source="deepseek-ai/DeepSeek-V4-Pro config.json (CSA/HCA mapped; see docstring)",
    ),
]
