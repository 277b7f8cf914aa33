"""Independent reference data for the specs tests.

Nothing here imports labkit. It holds

- `CONFIGS`: the published architecture numbers of each preset, copied from the
  model's public Hugging Face ``config.json`` (key names as there), and
- `checkpoint_tensors` / `count`: a naive parameter counter that lists every tensor a
  Hugging Face checkpoint of such a config holds, by name, one tensor at a time
  (experts one by one), written from the checkpoints' tensor names rather than from
  labkit's closed-form formulas.

Convention shared with labkit: labkit counts the *matrices* (projections, experts,
routers, embeddings). Norm weights, biases, conv filters and per-head scalars are
tagged "small" here; labkit ignores them, the exact published checkpoint totals
include them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

MATRIX, SMALL, MTP_COPY = "matrix", "small", "mtp_copy"

# --------------------------------------------------------------------------- configs
# meta-llama/Llama-3.1-8B config.json
LLAMA_31_8B = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    tie_word_embeddings=False, max_position_embeddings=131072,
)
# meta-llama/Llama-3.1-70B config.json
LLAMA_31_70B = dict(
    model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
    tie_word_embeddings=False, max_position_embeddings=131072,
)
# Qwen/Qwen3-30B-A3B config.json (decoder_sparse_step 1, mlp_only_layers []: all MoE)
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    tie_word_embeddings=False, max_position_embeddings=40960,
)
# deepseek-ai/DeepSeek-V3 config.json
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_nextn_predict_layers=1,
    tie_word_embeddings=False, max_position_embeddings=163840,
)
# deepseek-ai/DeepSeek-V3.2-Exp config.json: DeepSeek-V3 plus the DSA indexer
DEEPSEEK_V32 = dict(
    DEEPSEEK_V3, model_type="deepseek_v32", index_n_heads=64, index_head_dim=128,
    index_topk=2048,
)
# moonshotai/Kimi-K2-Instruct config.json
KIMI_K2 = dict(
    model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_nextn_predict_layers=0,
    tie_word_embeddings=False, max_position_embeddings=131072,
)
# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json. Layer ids in
# linear_attn_config are 1-based there; MLA on every 4th layer and the last.
_KL_FULL = [4, 8, 12, 16, 20, 24, 27]
KIMI_LINEAR_48B = dict(
    model_type="kimi_linear", vocab_size=163840, hidden_size=2304, intermediate_size=9216,
    moe_intermediate_size=1024, num_hidden_layers=27, num_attention_heads=32,
    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_experts=256, num_experts_per_token=8, num_shared_experts=1,
    first_k_dense_replace=1, tie_word_embeddings=False,
    linear_attn_config=dict(
        full_attn_layers=_KL_FULL,
        kda_layers=[i for i in range(1, 28) if i not in _KL_FULL],
        num_heads=32, head_dim=128, short_conv_kernel_size=4,
    ),
)

CONFIGS = {
    "llama-3.1-8b": LLAMA_31_8B,
    "llama-3.1-70b": LLAMA_31_70B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v3": DEEPSEEK_V3,
    "deepseek-v3.2": DEEPSEEK_V32,
    "kimi-k2": KIMI_K2,
    "kimi-linear-48b-a3b": KIMI_LINEAR_48B,
}


# --------------------------------------------------------------------- the counter
def _first(cfg: dict, *keys, default=0):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def n_experts(cfg: dict) -> int:
    return _first(cfg, "n_routed_experts", "num_experts")


def top_k(cfg: dict) -> int:
    return _first(cfg, "num_experts_per_tok", "num_experts_per_token")


def kda_layers_0based(cfg: dict) -> set[int]:
    lin = cfg.get("linear_attn_config")
    return {i - 1 for i in lin["kda_layers"]} if lin else set()


def _attention(cfg: dict, i: int, a: str):
    h = cfg["hidden_size"]
    if i in kda_layers_0based(cfg):
        # Kimi Delta Attention (fla-org KimiDeltaAttention / modeling_kimi.py)
        lin = cfg["linear_attn_config"]
        nh, d, ker = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
        p = nh * d
        for n in "qkv":
            yield f"{a}.{n}_proj.weight", p * h, MATRIX
            yield f"{a}.{n}_conv1d.weight", p * ker, SMALL
        yield f"{a}.A_log", nh, SMALL
        yield f"{a}.dt_bias", p, SMALL
        yield f"{a}.f_a_proj.weight", d * h, MATRIX
        yield f"{a}.f_b_proj.weight", p * d, MATRIX
        yield f"{a}.b_proj.weight", nh * h, MATRIX
        yield f"{a}.g_a_proj.weight", d * h, MATRIX
        yield f"{a}.g_b_proj.weight", p * d, MATRIX
        yield f"{a}.o_norm.weight", d, SMALL
        yield f"{a}.o_proj.weight", h * p, MATRIX
    elif "kv_lora_rank" in cfg:
        # Multi-head latent attention (modeling_deepseek.py DeepseekV3Attention)
        nh = cfg["num_attention_heads"]
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        kv_lora, q_lora = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
        if q_lora:
            yield f"{a}.q_a_proj.weight", q_lora * h, MATRIX
            yield f"{a}.q_a_layernorm.weight", q_lora, SMALL
            yield f"{a}.q_b_proj.weight", nh * (nope + rope) * q_lora, MATRIX
        else:
            yield f"{a}.q_proj.weight", nh * (nope + rope) * h, MATRIX
        yield f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope) * h, MATRIX
        yield f"{a}.kv_a_layernorm.weight", kv_lora, SMALL
        yield f"{a}.kv_b_proj.weight", nh * (nope + v) * kv_lora, MATRIX
        yield f"{a}.o_proj.weight", h * nh * v, MATRIX
        if cfg.get("index_n_heads"):
            # DeepSeek-V3.2-Exp inference/model.py class Indexer
            ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
            yield f"{a}.indexer.wq_b.weight", ih * idim * (q_lora or h), MATRIX
            yield f"{a}.indexer.wk.weight", idim * h, MATRIX
            yield f"{a}.indexer.k_norm.weight", idim, SMALL
            yield f"{a}.indexer.k_norm.bias", idim, SMALL
            yield f"{a}.indexer.weights_proj.weight", ih * h, MATRIX
    else:
        # grouped-query attention (LlamaAttention / Qwen3MoeAttention)
        nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or h // nh
        yield f"{a}.q_proj.weight", nh * hd * h, MATRIX
        yield f"{a}.k_proj.weight", kvh * hd * h, MATRIX
        yield f"{a}.v_proj.weight", kvh * hd * h, MATRIX
        yield f"{a}.o_proj.weight", h * nh * hd, MATRIX
        if cfg["model_type"].startswith("qwen3"):
            yield f"{a}.q_norm.weight", hd, SMALL
            yield f"{a}.k_norm.weight", hd, SMALL


def _mlp(cfg: dict, i: int, m: str):
    """Yields (name, numel, kind, expert index or None)."""
    h = cfg["hidden_size"]
    E = n_experts(cfg)
    if E and i >= cfg.get("first_k_dense_replace", 0):
        inter = cfg["moe_intermediate_size"]
        yield f"{m}.gate.weight", E * h, MATRIX, None
        if not cfg["model_type"].startswith("qwen3"):
            # sigmoid routing with aux-loss-free balancing bias (DeepSeek-V3 style)
            yield f"{m}.gate.e_score_correction_bias", E, SMALL, None
        for e in range(E):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{m}.experts.{e}.{proj}.weight", inter * h, MATRIX, e
        shared = _first(cfg, "n_shared_experts", "num_shared_experts")
        if shared:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{m}.shared_experts.{proj}.weight", shared * inter * h, MATRIX, None
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"{m}.{proj}.weight", cfg["intermediate_size"] * h, MATRIX, None


def _decoder_layer(cfg: dict, i: int, prefix: str):
    h = cfg["hidden_size"]
    yield f"{prefix}.input_layernorm.weight", h, SMALL, None
    yield f"{prefix}.post_attention_layernorm.weight", h, SMALL, None
    for name, numel, kind in _attention(cfg, i, f"{prefix}.self_attn"):
        yield name, numel, kind, None
    yield from _mlp(cfg, i, f"{prefix}.mlp")


def checkpoint_tensors(cfg: dict):
    """Every tensor of a checkpoint: (name, numel, kind, is_mtp, expert index or None)."""
    h, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    yield "model.embed_tokens.weight", V * h, MATRIX, False, None
    for i in range(L):
        for name, numel, kind, e in _decoder_layer(cfg, i, f"model.layers.{i}"):
            yield name, numel, kind, False, e
    yield "model.norm.weight", h, SMALL, False, None
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", V * h, MATRIX, False, None
    # DeepSeek MTP modules are stored as extra layers L, L+1, ... with their own copies
    # of the embedding and the output head (DeepSeek-V3 README_WEIGHTS.md).
    for j in range(cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{L + j}"
        yield f"{p}.embed_tokens.weight", V * h, MTP_COPY, True, None
        yield f"{p}.enorm.weight", h, SMALL, True, None
        yield f"{p}.hnorm.weight", h, SMALL, True, None
        yield f"{p}.eh_proj.weight", h * 2 * h, MATRIX, True, None
        for name, numel, kind, e in _decoder_layer(cfg, L + j, p):
            yield name, numel, kind, True, e
        yield f"{p}.shared_head.norm.weight", h, SMALL, True, None
        yield f"{p}.shared_head.head.weight", V * h, MTP_COPY, True, None


@dataclass(frozen=True)
class Counts:
    matrices: int  # main model, what labkit's total_params() counts
    small: int  # main model norms, biases, conv filters, scalars
    mtp_matrices: int  # MTP modules, without their copies of embedding / head
    mtp_small: int
    mtp_copies: int  # MTP's own copies of the embedding and the output head
    active_matrices: int  # main-model matrices a token touches (routed to k experts)


def count(cfg: dict) -> Counts:
    k = top_k(cfg)
    sums = dict(matrices=0, small=0, mtp_matrices=0, mtp_small=0, mtp_copies=0,
                active_matrices=0)
    for _name, numel, kind, is_mtp, expert in checkpoint_tensors(cfg):
        if kind == MTP_COPY:
            sums["mtp_copies"] += numel
        elif is_mtp:
            sums["mtp_matrices" if kind == MATRIX else "mtp_small"] += numel
        elif kind == MATRIX:
            sums["matrices"] += numel
            # A token routed to experts 0..k-1 (which k does not change the count).
            if expert is None or expert < k:
                sums["active_matrices"] += numel
        else:
            sums["small"] += numel
    return Counts(**sums)


@lru_cache(maxsize=None)
def count_preset(name: str) -> Counts:
    return count(CONFIGS[name])


def config_from_spec(spec) -> dict:
    """An HF-style config for a ModelSpec (used for the tiny presets, which have no
    published config): a plain renaming of fields, no arithmetic."""
    cfg = dict(
        model_type={"llama": "llama", "qwen3_moe": "qwen3_moe"}.get(spec.family, spec.family),
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, tie_word_embeddings=spec.tie_word_embeddings,
        num_nextn_predict_layers=spec.num_mtp_modules,
    )
    if spec.attention == "mla":
        cfg.update(q_lora_rank=spec.q_lora_rank or None, kv_lora_rank=spec.kv_lora_rank,
                   qk_nope_head_dim=spec.qk_nope_head_dim,
                   qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim)
    else:
        cfg.update(num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    if spec.num_experts:
        cfg.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                   moe_intermediate_size=spec.moe_intermediate_size,
                   num_shared_experts=spec.num_shared_experts,
                   first_k_dense_replace=spec.first_k_dense)
    if spec.index_topk:
        cfg.update(index_n_heads=spec.index_num_heads, index_head_dim=spec.index_head_dim,
                   index_topk=spec.index_topk)
    if spec.linear_layers:
        cfg["linear_attn_config"] = dict(
            kda_layers=[i + 1 for i in spec.linear_layers],
            num_heads=spec.linear_num_heads, head_dim=spec.linear_head_dim,
            short_conv_kernel_size=spec.linear_conv_kernel,
        )
    return cfg
