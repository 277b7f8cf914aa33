"""transformers as the oracle: tiny Hugging Face models, saved, and what they compute.

`hf_folder(family)` builds a model of one family with `AutoModelForCausalLM.from_config`
at labkit's tiny dimensions, with transformers' own defaults for every feature the
tiny config does not set (plus the RoPE scaling a real checkpoint of the family
sets), reseeds its weights (transformers' N(0, 0.02) init makes every logit nearly
equal, so greedy choices would hinge on rounding), saves it with `save_pretrained`
and returns the folder. `hf_logits` / `hf_greedy` run the saved model itself.
No hub: everything is built here, from configs.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

TINY = dict(hidden_size=64, num_attention_heads=4, vocab_size=512, intermediate_size=128)
_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            moe_intermediate_size=32, num_experts_per_tok=2, first_k_dense_replace=1)
# DSA: the indexer's score of a key is a weighted sum over heads of relu(q . k): with
# few heads, many keys score exactly 0 and top-k ties are common, where torch.topk's
# choice is unspecified (see models/dsa.py). 16 heads (V3.2 has 64) make exact zeros
# rare (2^-16 a key), so the comparison is of the function, not of tie-breaking.
# DeepSeek's own YaRN (config.json of DeepSeek-V3 / R1): it moves the frequencies and,
# through mscale_all_dim, MLA's softmax scale
_DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096)
CONFIGS = {
    "llama": ("llama", dict(TINY, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=131072,
                            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                                 factor=8.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0,
                                                 original_max_position_embeddings=8192))),
    "qwen3-moe": ("qwen3_moe", dict(TINY, num_hidden_layers=2, num_key_value_heads=2,
                                    head_dim=16, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32)),
    "deepseek-v3": ("deepseek_v3", dict(TINY, num_hidden_layers=3, q_lora_rank=32,
                                        n_routed_experts=8, n_group=2, topk_group=1,
                                        rope_parameters=_DEEPSEEK_YARN, **_MLA)),
    "deepseek-v3.2": ("deepseek_v32", dict(TINY, num_hidden_layers=3, q_lora_rank=32,
                                           n_routed_experts=8, n_group=2, topk_group=1,
                                           index_n_heads=16, index_head_dim=16, index_topk=16,
                                           **_MLA)),
    "kimi-linear": ("kimi_linear", dict(TINY, num_hidden_layers=4, num_experts=8,
                                        layer_types=["linear_attention"] * 3
                                        + ["full_attention"],
                                        linear_num_heads=4, linear_head_dim=16,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        **_MLA)),
    "gpt-oss": ("gpt_oss", dict(TINY, num_hidden_layers=2, num_key_value_heads=2,
                                head_dim=16, intermediate_size=32, num_local_experts=8,
                                num_experts_per_tok=2, sliding_window=24)),
}


def _reseed(model: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale activations: matrices ~ N(0, 1/fan_in), embeddings
    N(0, 1), norm weights 1 + N(0, 0.1), biases N(0, 0.1), sinks N(0, 1), KDA's decay
    parameters as Kimi initialises them, and DeepSeek's router correction bias
    N(0, 0.1) (a buffer, zero after from_config: it would not be exercised)."""
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g)

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(randn(p.shape) * 0.5 - 4)
            elif "embed_tokens" in name:
                p.copy_(randn(p.shape))
            elif name.endswith("sinks"):
                p.copy_(randn(p.shape))
            elif p.dim() >= 2:
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * randn(p.shape))
            else:
                p.copy_(0.1 * randn(p.shape))
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * randn(b.shape))


def build_hf(family: str, seed: int = 0):
    """The transformers model of `family`'s tiny config, reseeded (float32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, kwargs = CONFIGS[family]
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reseed(model, seed)
    return model.eval()


def save_hf(family: str, folder: Path, seed: int = 0) -> Path:
    build_hf(family, seed).save_pretrained(folder)
    return folder


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits `[T, vocab]` of one whole-sequence forward pass, as transformers runs it."""
    return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation, recomputing the whole sequence each token (no cache)."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]
