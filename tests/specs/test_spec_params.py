"""Parameter counts of the model presets.

Three independent references:
1. a hand computation from Llama-3.1-8B's config.json, written out term by term;
2. `reference.count`, a naive counter that walks every tensor of a Hugging Face
   checkpoint (experts one at a time) built from the published config.json. The
   counter itself is first checked against exact published checkpoint totals
   (Hugging Face safetensors metadata), so that it can then pin labkit exactly;
3. the published headline figures (model cards, technical reports), compared with a
   tolerance that reflects what those figures round or leave out (said per row).

labkit counts matrices only (projections, experts, routers, embeddings); norm
weights, biases, conv filters and per-head scalars are ignored (< 0.005 % of any
preset here, checked below).
"""

from __future__ import annotations

import pytest

from labkit.specs import MODEL_PRESETS, get_model

from .reference import CONFIGS, checkpoint_tensors, config_from_spec, count, count_preset

BIG = list(CONFIGS)
TINY = [name for name in MODEL_PRESETS if name.startswith("tiny-")]


def rel_err(actual: float, published: float) -> float:
    return abs(actual - published) / published


# ----------------------------------------------------------------- 1. by hand
def test_llama_31_8b_layer_by_hand():
    # meta-llama/Llama-3.1-8B config.json: hidden 4096, 32 heads, 8 KV heads,
    # head_dim 4096/32 = 128, intermediate 14336, 32 layers, vocab 128256, untied.
    m = get_model("llama-3.1-8b")
    q = 4096 * 4096  # q_proj: 32 heads x 128
    k = 4096 * 1024  # k_proj: 8 KV heads x 128
    v = 4096 * 1024
    o = 4096 * 4096
    assert m.attention_params(0) == q + k + v + o == 41_943_040
    gate = up = down = 4096 * 14336
    assert m.mlp_params(0) == gate + up + down == 176_160_768
    for layer in range(32):
        assert m.layer_params(layer) == 41_943_040 + 176_160_768
    embed = lm_head = 128256 * 4096
    assert m.embedding_params() == embed + lm_head == 1_050_673_152
    assert m.total_params() == 32 * (41_943_040 + 176_160_768) + 1_050_673_152
    # Dense: every parameter is active.
    assert m.active_params_per_token() == m.total_params()


def test_deepseek_v3_mla_layer_by_hand():
    # deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 128 heads, q_lora 1536,
    # kv_lora 512, qk_nope 128, qk_rope 64, v 128; experts of 2048, 256 + 1 shared.
    m = get_model("deepseek-v3")
    q_a = 7168 * 1536
    q_b = 1536 * 128 * (128 + 64)
    kv_a = 7168 * (512 + 64)
    kv_b = 512 * 128 * (128 + 128)
    o = 128 * 128 * 7168
    assert m.attention_params(0) == q_a + q_b + kv_a + kv_b + o
    assert m.mlp_params(0) == 3 * 7168 * 18432  # layers 0..2 are dense
    expert = 3 * 7168 * 2048
    router = 7168 * 256
    assert m.expert_params() == expert
    assert m.mlp_params(3) == 256 * expert + 1 * expert + router
    assert m.num_moe_layers == 61 - 3


# ------------------------------------------- 2a. the counter vs exact published
def test_reference_counter_reproduces_published_checkpoints():
    """Guards the reference itself: with norms included it hits the exact totals."""
    # Hugging Face safetensors metadata ("total") of each checkpoint:
    published = {
        "llama-3.1-8b": 8_030_261_248,  # meta-llama/Llama-3.1-8B
        "llama-3.1-70b": 70_553_706_496,  # meta-llama/Llama-3.1-70B
        "qwen3-30b-a3b": 30_532_122_624,  # Qwen/Qwen3-30B-A3B (= GGUF parameter_count)
        # deepseek-ai/DeepSeek-V3, main model only (layers 0-60, embedding, head,
        # norms; the MTP layer 61 and the fp8 scale tensors excluded).
        "deepseek-v3": 671_026_419_200,
    }
    for name, total in published.items():
        c = count_preset(name)
        assert c.matrices + c.small == total, name


def test_reference_counter_reproduces_deepseek_v3_dtype_breakdown():
    # Hugging Face API, deepseek-ai/DeepSeek-V3 safetensors parameters by dtype:
    # BF16 3,918,786,560 and F8_E4M3 680,571,043,840 (F32: scales and routing biases).
    # BF16 holds the embeddings and heads (the MTP layer keeps its own copies), the
    # routers, the MTP eh_proj and the norms; every other matrix is fp8.
    bf16_suffixes = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight",
                     "mlp.gate.weight", "eh_proj.weight")
    bf16 = fp8 = 0
    for name, numel, kind, _mtp, _e in checkpoint_tensors(CONFIGS["deepseek-v3"]):
        if name.endswith("e_score_correction_bias"):
            continue  # F32
        if kind != "matrix" or name.endswith(bf16_suffixes):
            bf16 += numel
        else:
            fp8 += numel
    assert bf16 == 3_918_786_560
    assert fp8 == 680_571_043_840


# -------------------------------------------- 2b. labkit vs the naive counter
@pytest.mark.parametrize("name", BIG)
def test_total_and_active_equal_naive_count(name):
    m, c = get_model(name), count_preset(name)
    assert m.total_params() == c.matrices
    assert m.total_params(include_mtp=True) == c.matrices + c.mtp_matrices
    assert m.active_params_per_token() == c.active_matrices
    # What labkit ignores is negligible.
    assert c.small / c.matrices < 5e-5


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3.2", "kimi-linear-48b-a3b"])
def test_per_layer_attention_and_mlp_equal_naive_count(name):
    """Layer by layer, so that a dense/MoE or KDA/MLA mix-up shows where it is."""
    m = get_model(name)
    attn: dict[int, int] = {}
    mlp: dict[int, int] = {}
    for tensor, numel, kind, is_mtp, _e in checkpoint_tensors(CONFIGS[name]):
        if kind != "matrix" or is_mtp or not tensor.startswith("model.layers."):
            continue
        layer = int(tensor.split(".")[2])
        bucket = attn if ".self_attn." in tensor else mlp
        bucket[layer] = bucket.get(layer, 0) + numel
    for layer in range(m.num_layers):
        assert m.attention_params(layer) == attn[layer], layer
        assert m.mlp_params(layer) == mlp[layer], layer


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_equal_naive_count(name):
    m = get_model(name)
    c = count(config_from_spec(m))
    assert m.total_params() == c.matrices
    assert m.total_params(include_mtp=True) == c.matrices + c.mtp_matrices
    assert m.active_params_per_token() == c.active_matrices


def test_deepseek_v32_is_v3_plus_one_indexer_per_layer():
    # DeepSeek-V3.2-Exp indexer: wq_b (q_lora 1536 -> 64 heads x 128),
    # wk (7168 -> 128), weights_proj (7168 -> 64 heads); k_norm ignored.
    indexer = 1536 * 64 * 128 + 7168 * 128 + 7168 * 64
    v3, v32 = get_model("deepseek-v3"), get_model("deepseek-v3.2")
    assert v32.indexer_params() == indexer
    assert v32.total_params() - v3.total_params() == 61 * indexer
    assert v32.active_params_per_token() - v3.active_params_per_token() == 61 * indexer
    assert v3.indexer_params() == 0


# --------------------------------------------------- 3. published headline figures
# (name, published total, rel tol, published active, rel tol, why the tolerance)
PUBLISHED = [
    # Exact checkpoint totals: labkit leaves out only norms (3e-5 of the total).
    ("llama-3.1-8b", 8_030_261_248, 1e-4, 8_030_261_248, 1e-4,
     "HF safetensors total; dense, so active == total"),
    ("llama-3.1-70b", 70_553_706_496, 1e-4, 70_553_706_496, 1e-4,
     "HF safetensors total; dense"),
    ("qwen3-30b-a3b", 30_532_122_624, 1e-4, 3.3e9, 0.02,
     "HF safetensors total; model card: 3.3B activated (one decimal: 3.35B rounds to it)"),
    ("deepseek-v3", 671_026_419_200, 1e-5, 37e9, 0.03,
     "exact main-model checkpoint count (README: 671B); README '37B activated' is "
     "rounded down and its convention for the input embedding varies (37.55B with it)"),
    ("deepseek-v3.2", 671e9, 0.005, 37e9, 0.05,
     "model card gives V3's figures; the indexer adds 0.85B (0.13 %)"),
    ("kimi-k2", 1_026_408_235_864, 1e-5, 32e9, 0.03,
     "HF safetensors total of Kimi-K2-Instruct; model card: 32B activated (32.9 with "
     "the embedding)"),
    ("gpt-oss-120b", 116.83e9, 1e-3, 5.13e9 + 201088 * 2880, 0.01,
     "model card: 116.83B total, 5.13B active without the input embedding (labkit's "
     "active count includes it: +0.58B); biases, sinks and norms are left out"),
    ("kimi-linear-48b-a3b", 48e9, 0.03, 3e9, 0.17,
     "the '48B-A3B' labels are rounded class names: config.json gives 49.1B total and "
     "3.48B active with both embeddings (2.73B without)"),
]


@pytest.mark.parametrize("name,total,tol,active,atol,why", PUBLISHED,
                         ids=[row[0] for row in PUBLISHED])
def test_published_totals(name, total, tol, active, atol, why):
    m = get_model(name)
    assert rel_err(m.total_params(), total) < tol, why
    assert rel_err(m.active_params_per_token(), active) < atol, why


def test_qwen3_non_embedding_count_matches_model_card():
    # Qwen3-30B-A3B model card: "Number of Parameters (Non-Embedding): 29.9B".
    m = get_model("qwen3-30b-a3b")
    assert round((m.total_params() - m.embedding_params()) / 1e9, 1) == 29.9


def test_kimi_k2_against_its_technical_report():
    # Kimi K2 technical report (arXiv:2507.20534): "1.04 trillion total parameters".
    # config.json (and the checkpoint: 1,026,408,235,864) gives 1.026T, so the report's
    # figure is 1.3 % above anything the published architecture yields; 2 % tolerance.
    assert rel_err(get_model("kimi-k2").total_params(), 1.04e12) < 0.02


def test_deepseek_mtp_module():
    # DeepSeek-V3 README: Hugging Face holds 685B = 671B main model + 14B MTP module
    # (the MTP layer stores its own copies of the embedding and output head, which a
    # server shares with the main model). The HF dtype breakdown gives the exact
    # non-F32 total: 3,918,786,560 (BF16) + 680,571,043,840 (F8_E4M3).
    for name in ("deepseek-v3", "deepseek-v3.2"):
        m = get_model(name)
        copies = 2 * 129280 * 7168
        with_mtp = m.total_params(include_mtp=True) + copies
        assert rel_err(with_mtp, 685e9) < 0.005
        assert m.mtp_params() == m.total_params(include_mtp=True) - m.total_params()
    m = get_model("deepseek-v3")
    exact = 3_918_786_560 + 680_571_043_840
    # labkit leaves out norms only (about 1.04M elements).
    assert 0 < exact - (m.total_params(include_mtp=True) + 2 * 129280 * 7168) < 1.1e6
    # README_WEIGHTS.md: "11.5B unique parameters" in the MTP module: the MoE layer
    # alone is 11.51B, eh_proj (2 x 7168 x 7168) adds 0.10B.
    assert rel_err(m.mtp_params(), 11.5e9 + 2 * 7168 * 7168) < 0.005
    assert get_model("kimi-k2").mtp_params() == 0


def test_weight_bytes():
    # Dense bf16: two bytes per parameter.
    llama = get_model("llama-3.1-8b")
    assert llama.weight_bytes() == 2 * llama.total_params()
    assert llama.weight_bytes("fp8") == 2 * llama.embedding_params() + (
        llama.total_params() - llama.embedding_params())
    # DeepSeek-V3 as served in fp8: the checkpoint's bytes are BF16 x 2 + F8 x 1 + F32 x 4
    # = 3,918,786,560 x 2 + 680,571,043,840 + 41,555,600 x 4 = 688,574,839,360.
    # labkit shares the MTP's embedding/head copies, counts routers and eh_proj as fp8
    # and omits the fp8 scales: within 1 % of the checkpoint.
    ds = get_model("deepseek-v3")
    checkpoint_bytes = 3_918_786_560 * 2 + 680_571_043_840 + 41_555_600 * 4
    wb = ds.weight_bytes(include_mtp=True)
    assert wb < checkpoint_bytes
    assert rel_err(wb, checkpoint_bytes) < 0.01
    assert ds.weight_bytes("bf16") == 2 * ds.total_params()
