"""Published config.json files of the models the field benchmarks now (independent data).

Copied from the models' published Hugging Face `config.json` (key names as there; only
the keys that shape the model), with the published parameter totals. Nothing here
imports labkit: `test_hf_config.py` reads these through `ModelSpec.from_hf_config`
and compares with the hand-written presets of `labkit/specs/field_presets.py`.
"""

from __future__ import annotations

# deepseek-ai/DeepSeek-R1-0528 config.json: DeepSeek-V3's architecture
DEEPSEEK_R1_0528 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
    norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_nextn_predict_layers=1, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
    tie_word_embeddings=False, torch_dtype="bfloat16",
    quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                             weight_block_size=[128, 128]),
)

# moonshotai/Kimi-K2.5 config.json: a multimodal wrapper around Kimi-K2's text model
KIMI_K25 = dict(
    model_type="kimi_k25", architectures=["KimiK25ForConditionalGeneration"],
    tie_word_embeddings=False,
    text_config=dict(
        model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
        num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.827,
        first_k_dense_replace=1, moe_layer_freq=1, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_nextn_predict_layers=0, max_position_embeddings=262144, rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=dict(beta_fast=1.0, beta_slow=1.0, factor=64.0, mscale=1.0,
                          mscale_all_dim=1.0, original_max_position_embeddings=4096,
                          type="yarn"),
        tie_word_embeddings=False,
        quantization_config=dict(quant_method="compressed-tensors"),
    ),
)

# zai-org/GLM-5 config.json (MLA + the DSA indexer on every layer)
GLM_5 = dict(
    model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64,
    num_key_value_heads=64, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=3,
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
    v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
    num_nextn_predict_layers=1, max_position_embeddings=202752, rms_norm_eps=1e-5,
    tie_word_embeddings=False, quantization_config=dict(quant_method="fp8"),
)

# MiniMaxAI/MiniMax-M2.5 config.json (the MiniMax-M2 architecture)
MINIMAX_M25 = dict(
    model_type="minimax_m2", vocab_size=200064, hidden_size=3072, intermediate_size=1536,
    num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
    num_local_experts=256, num_experts_per_tok=8, scoring_func="sigmoid",
    use_routing_bias=True, use_qk_norm=True, rotary_dim=64, rope_theta=5000000,
    use_mtp=True, num_mtp_modules=3, mtp_transformer_layers=1,
    max_position_embeddings=196608, rms_norm_eps=1e-6, tie_word_embeddings=False,
    quantization_config=dict(quant_method="fp8"),
)

# Qwen/Qwen3.5-397B-A17B config.json (text_config): 15 x (3 gated DeltaNet + 1 full)
# layers, 512 experts (10 routed + 1 shared). shared_expert_intermediate_size is not in
# the copies found; 1024 (= an expert's) is what the published 17 B active parameters
# imply.
QWEN35_397B = dict(
    model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"],
    text_config=dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=4096,
        num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024, mtp_num_hidden_layers=1,
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000000,
                             partial_rotary_factor=0.25),
    ),
)

# deepseek-ai/DeepSeek-V4-Pro config.json (compress_ratios: 61 layers + the MTP layer)
DEEPSEEK_V4_PRO = dict(
    model_type="deepseek_v4", vocab_size=129280, hidden_size=7168, moe_intermediate_size=3072,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=1, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1536, o_lora_rank=1024, o_groups=16,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6, num_hash_layers=3,
    scoring_func="sqrtsoftplus", routed_scaling_factor=2.5, norm_topk_prob=True,
    index_n_heads=64, index_head_dim=128, index_topk=1024, sliding_window=128,
    compress_rope_theta=160000, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
    hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=10.0, num_nextn_predict_layers=1,
    max_position_embeddings=1048576, rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=16,
                      original_max_position_embeddings=65536, type="yarn"),
    tie_word_embeddings=False, expert_dtype="fp4",
    quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128]),
)

FIELD_CONFIGS = {
    "deepseek-r1-0528": DEEPSEEK_R1_0528, "kimi-k2.5": KIMI_K25, "glm-5": GLM_5,
    "minimax-m2.5": MINIMAX_M25, "qwen3.5-397b-a17b": QWEN35_397B,
    "deepseek-v4": DEEPSEEK_V4_PRO,
}

# Published totals, in billions: (total, active) from the model cards / reports
FIELD_TOTALS = {
    "deepseek-r1-0528": (671, 37), "kimi-k2.5": (1040, 32), "glm-5": (744, 40),
    "minimax-m2.5": (229, 10), "qwen3.5-397b-a17b": (397, 17), "deepseek-v4": (1600, 49),
}
