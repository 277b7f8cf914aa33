"""Model presets of the measured serving runs that `labkit validate` replays.

The end-to-end data (../shared/data/e2e/blis_h100_vllm) was taken on older dense and
MoE models: Llama-2, CodeLlama, Mixtral, Qwen3/Qwen2.5, Mistral-Nemo. Their numbers
come from each model's public Hugging Face `config.json` (checked against several
published copies); `tests/specs` checks the derived parameter counts against the
published totals. Kept apart from `model_presets.py` so the two lists grow
independently; `model_presets.MODEL_PRESETS` includes these.

Llama-2-7B is the odd one: full multi-head attention (32 KV heads), so its KV cache is
four times Llama-3.1-8B's per token. Mixtral's experts are whole SwiGLU MLPs
(`moe_intermediate_size` = the dense width) with top-2 routing and no shared expert.
"""

from __future__ import annotations

from labkit.specs.models import ModelSpec

_MIXTRAL = dict(num_experts=8, num_experts_per_tok=2)

MEASURED_MODELS: list[ModelSpec] = [
    ModelSpec(
        "llama-2-7b", "llama", num_layers=32, hidden_size=4096, vocab_size=32000,
        num_heads=32, num_kv_heads=32, head_dim=128, intermediate_size=11008,
        max_model_len=4096, source="meta-llama/Llama-2-7b-hf config.json",
    ),
    ModelSpec(
        "llama-2-70b", "llama", num_layers=80, hidden_size=8192, vocab_size=32000,
        num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28672,
        max_model_len=4096, source="meta-llama/Llama-2-70b-hf config.json",
    ),
    ModelSpec(
        "codellama-34b", "llama", num_layers=48, hidden_size=8192, vocab_size=32000,
        num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=22016,
        max_model_len=16384, source="codellama/CodeLlama-34b-Instruct-hf config.json",
    ),
    ModelSpec(
        "mixtral-8x7b", "mixtral", num_layers=32, hidden_size=4096, vocab_size=32000,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        moe_intermediate_size=14336, **_MIXTRAL, max_model_len=32768,
        source="mistralai/Mixtral-8x7B-v0.1 config.json",
    ),
    ModelSpec(
        "mixtral-8x22b", "mixtral", num_layers=56, hidden_size=6144, vocab_size=32768,
        num_heads=48, num_kv_heads=8, head_dim=128, intermediate_size=16384,
        moe_intermediate_size=16384, **_MIXTRAL, max_model_len=65536,
        source="mistralai/Mixtral-8x22B-Instruct-v0.1 config.json",
    ),
    ModelSpec(
        "qwen3-14b", "qwen3", num_layers=40, hidden_size=5120, vocab_size=151936,
        num_heads=40, num_kv_heads=8, head_dim=128, intermediate_size=17408,
        max_model_len=40960, source="Qwen/Qwen3-14B config.json",
    ),
    ModelSpec(
        "qwen2.5-7b", "qwen2", num_layers=28, hidden_size=3584, vocab_size=152064,
        num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944,
        max_model_len=131072, source="Qwen/Qwen2.5-7B-Instruct config.json",
    ),
    ModelSpec(
        "mistral-nemo-12b", "mistral", num_layers=40, hidden_size=5120, vocab_size=131072,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        max_model_len=131072, source="mistralai/Mistral-Nemo-Instruct-2407 config.json",
    ),
]
