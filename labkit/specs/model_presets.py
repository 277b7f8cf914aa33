"""Model presets: published architecture numbers, plus tiny variants for CPU tests.

Numbers come from each model's public `config.json` (Hugging Face) and technical
report; `tests/specs` checks the derived parameter counts against the published
totals (Llama-3.1-8B 8.0B, DeepSeek-V3 671B total / 37B active, ...).

The `tiny-*` presets keep each family's structure (GQA vs MLA, MoE routing, shared
experts, dense first layers, indexer, linear-attention and sliding-window layers) at
sizes a laptop CPU runs in milliseconds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from labkit.errors import unknown_choice
from labkit.specs.measured_presets import MEASURED_MODELS
from labkit.specs.family import FAMILIES
from labkit.specs.field_presets import FIELD_MODELS
from labkit.specs.hf_config import from_hf_config, is_hf_path
from labkit.specs.models import ModelSpec

_DEEPSEEK_MLA = dict(
    attention="mla", q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)
_DEEPSEEK_MOE = dict(
    intermediate_size=18432, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=2048, num_shared_experts=1,
)
_DSA_INDEXER = dict(index_num_heads=64, index_head_dim=128, index_topk=2048)

# Kimi-Linear-48B-A3B: KDA (linear) layers everywhere except every 4th layer and the
# last, which use MLA (1-based full-attention layers 4, 8, ..., 24, 27).
_KIMI_LINEAR_FULL = (3, 7, 11, 15, 19, 23, 26)

# gpt-oss: sliding-window (128 tokens) and full attention alternate, starting with a
# sliding layer. Its MoE weights ship in MXFP4 (4.25 bits); labkit has no fp4 kernels
# and serves them as fp8, so weights take ~2x the published 61 GiB.
_GPT_OSS_SLIDING = tuple(range(0, 36, 2))

# The tiny DeepSeek variants have 8 experts: group-limited routing in 2 groups of 4, the
# best one kept (DeepSeek-V3's 8 groups / top 4 need at least 2 experts a group).
_TINY_DEEPSEEK = replace(FAMILIES["deepseek_v3"], n_group=2, topk_group=1)

MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            "llama-3.1-8b", "llama", num_layers=32, hidden_size=4096, vocab_size=128256,
            num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
            max_model_len=131072, source="meta-llama/Llama-3.1-8B config.json",
        ),
        ModelSpec(
            "llama-3.1-70b", "llama", num_layers=80, hidden_size=8192, vocab_size=128256,
            num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28672,
            max_model_len=131072, source="meta-llama/Llama-3.1-70B config.json",
        ),
        ModelSpec(
            "qwen3-30b-a3b", "qwen3_moe", num_layers=48, hidden_size=2048, vocab_size=151936,
            num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            max_model_len=40960, source="Qwen/Qwen3-30B-A3B config.json",
        ),
        ModelSpec(
            "deepseek-v3", "deepseek_v3", num_layers=61, hidden_size=7168, vocab_size=129280,
            num_heads=128, **_DEEPSEEK_MLA, **_DEEPSEEK_MOE, first_k_dense=3,
            num_mtp_modules=1, weight_dtype="fp8", max_model_len=163840, block_size=64,
            source="deepseek-ai/DeepSeek-V3 config.json; arXiv:2412.19437",
        ),
        ModelSpec(
            "deepseek-v3.2", "deepseek_v32", num_layers=61, hidden_size=7168,
            vocab_size=129280, num_heads=128, **_DEEPSEEK_MLA, **_DEEPSEEK_MOE,
            first_k_dense=3, **_DSA_INDEXER, num_mtp_modules=1, weight_dtype="fp8",
            max_model_len=163840, block_size=64,
            source="deepseek-ai/DeepSeek-V3.2-Exp config.json (DSA indexer)",
        ),
        ModelSpec(
            "kimi-k2", "kimi_k2", num_layers=61, hidden_size=7168, vocab_size=163840,
            num_heads=64, **_DEEPSEEK_MLA, intermediate_size=18432, num_experts=384,
            num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
            first_k_dense=1, weight_dtype="fp8", max_model_len=131072, block_size=64,
            source="moonshotai/Kimi-K2-Instruct config.json",
        ),
        ModelSpec(
            "kimi-linear-48b-a3b", "kimi_linear", num_layers=27, hidden_size=2304,
            vocab_size=163840, num_heads=32, attention="mla", q_lora_rank=0,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            intermediate_size=9216, num_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=1024, num_shared_experts=1, first_k_dense=1,
            linear_layers=tuple(i for i in range(27) if i not in _KIMI_LINEAR_FULL),
            linear_num_heads=32, linear_head_dim=128, linear_conv_kernel=4,
            max_model_len=1048576, block_size=64,
            source="moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (KDA:MLA 3:1)",
        ),
        ModelSpec(
            "gpt-oss-120b", "gpt_oss", num_layers=36, hidden_size=2880, vocab_size=201088,
            num_heads=64, num_kv_heads=8, head_dim=64, intermediate_size=2880,
            num_experts=128, num_experts_per_tok=4, moe_intermediate_size=2880,
            sliding_window=128, sliding_window_layers=_GPT_OSS_SLIDING, weight_dtype="fp8",
            max_model_len=131072, source="openai/gpt-oss-120b config.json (SWA:full 1:1)",
        ),
        # ---------------------------------------------------------- tiny variants
        ModelSpec(
            "tiny-llama", "llama", num_layers=2, hidden_size=64, vocab_size=512,
            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
            max_model_len=65536, source="tiny variant of llama-3.1",
        ),
        ModelSpec(
            "tiny-qwen3-moe", "qwen3_moe", num_layers=2, hidden_size=64, vocab_size=512,
            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            max_model_len=65536, source="tiny variant of qwen3-30b-a3b",
        ),
        ModelSpec(
            "tiny-deepseek-v3", "deepseek_v3", num_layers=3, hidden_size=64, vocab_size=512,
            num_heads=4, attention="mla", q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            num_shared_experts=1, first_k_dense=1, num_mtp_modules=1,
            max_model_len=65536, block_size=16, source="tiny variant of deepseek-v3",
            constants=_TINY_DEEPSEEK,
        ),
        ModelSpec(
            "tiny-deepseek-v3.2", "deepseek_v32", num_layers=3, hidden_size=64,
            vocab_size=512, num_heads=4, attention="mla", q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            num_shared_experts=1, first_k_dense=1, index_num_heads=2, index_head_dim=16,
            index_topk=32, num_mtp_modules=1, max_model_len=65536, block_size=16,
            source="tiny variant of deepseek-v3.2", constants=_TINY_DEEPSEEK,
        ),
        ModelSpec(
            "tiny-kimi-linear", "kimi_linear", num_layers=4, hidden_size=64, vocab_size=512,
            num_heads=4, attention="mla", kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
            first_k_dense=1, linear_layers=(0, 1, 2), linear_num_heads=4,
            linear_head_dim=16, linear_conv_kernel=4, max_model_len=65536, block_size=16,
            source="tiny variant of kimi-linear (3 KDA : 1 MLA)",
        ),
        ModelSpec(
            "tiny-gpt-oss", "gpt_oss", num_layers=2, hidden_size=64, vocab_size=512,
            num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            sliding_window=24, sliding_window_layers=(0,), max_model_len=65536,
            block_size=16, source="tiny variant of gpt-oss (SWA:full 1:1, window 24)",
        ),
    ] + FIELD_MODELS  # the models the field benchmarks now (field_presets.py)
}

# ---- models of the measured end-to-end runs (labkit validate); see measured_presets.py
MODEL_PRESETS.update({m.name: m for m in MEASURED_MODELS})

# Short names people type.
MODEL_ALIASES = {"gpt-oss": "gpt-oss-120b", "kimi-linear": "kimi-linear-48b-a3b",
                 "kimi-linear-style": "kimi-linear-48b-a3b"}


def get_model(model: str | Path | ModelSpec) -> ModelSpec:
    """A preset by name, a Hugging Face `config.json` (or a folder holding one) read by
    `ModelSpec.from_hf_config`, or a ModelSpec passed through; names the presets on a
    typo."""
    if isinstance(model, ModelSpec):
        return model
    if is_hf_path(model):
        return from_hf_config(model)
    name = str(model).lower()
    name = MODEL_ALIASES.get(name, name)
    if name not in MODEL_PRESETS:
        raise unknown_choice("model preset (or a path to a config.json or HF folder)",
                             model, MODEL_PRESETS)
    return MODEL_PRESETS[name]
