"""Seeded random weights for any `ModelSpec`, named like Hugging Face checkpoints.

Naming scheme (every matrix stored `[out, in]`, like `nn.Linear.weight`):

    model.embed_tokens.weight                       [V, H]
    model.norm.weight                               [H]
    lm_head.weight                                  [V, H]   (absent if tied)
    model.layers.{i}.input_layernorm.weight         [H]
    model.layers.{i}.post_attention_layernorm.weight [H]
  GQA (llama, qwen3_moe, gpt_oss), heads Hq / Hkv of head_dim D:
    self_attn.{q,k,v}_proj.weight  [Hq*D | Hkv*D, H]   self_attn.o_proj.weight [H, Hq*D]
    self_attn.{q,k}_norm.weight    [D]                 (qwen3_moe only)
    self_attn.{q,k,v,o}_proj.bias  [Hq*D | Hkv*D | H]  (attention_bias: gpt_oss)
    self_attn.sinks                [Hq]                (attention_sinks: gpt_oss)
  MLA (deepseek_v3/_v32, kimi_k2, kimi_linear's full layers), n heads, r = kv_lora_rank:
    self_attn.q_a_proj.weight [q_lora, H], self_attn.q_a_layernorm.weight [q_lora],
    self_attn.q_b_proj.weight [n*(nope+rope), q_lora]   (or q_proj [n*(nope+rope), H]
                                                         when q_lora_rank == 0)
    self_attn.kv_a_proj_with_mqa.weight [r+rope, H], self_attn.kv_a_layernorm.weight [r]
    self_attn.kv_b_proj.weight [n*(nope+v), r]          self_attn.o_proj.weight [H, n*v]
  DSA indexer (deepseek_v32), Hi heads of Di:
    self_attn.indexer.wq_b.weight [Hi*Di, q_lora or H], self_attn.indexer.wk.weight [Di, H],
    self_attn.indexer.k_norm.{weight,bias} [Di], self_attn.indexer.weights_proj.weight [Hi, H]
  KDA (kimi_linear's linear layers), h heads of d:
    self_attn.{q,k,v}_proj.weight [h*d, H], self_attn.{q,k,v}_conv1d.weight [h*d, 1, K],
    self_attn.A_log [h], self_attn.dt_bias [h*d], self_attn.f_a_proj.weight [d, H],
    self_attn.f_b_proj.weight [h*d, d], self_attn.b_proj.weight [h, H],
    self_attn.g_a_proj.weight [d, H], self_attn.g_b_proj.weight [h*d, d],
    self_attn.o_norm.weight [d], self_attn.o_proj.weight [H, h*d]
  MLP: dense  mlp.{gate,up}_proj.weight [I, H], mlp.down_proj.weight [H, I]
       MoE    mlp.gate.weight [E, H] (router), mlp.gate.e_score_correction_bias [E]
              (sigmoid routers), mlp.experts.{e}.{gate,up,down}_proj.weight,
              mlp.shared_experts.{gate,up,down}_proj.weight (intermediate
              moe_intermediate_size * num_shared_experts, as DeepSeek stores it);
              with moe_bias (gpt_oss) also mlp.gate.bias [E] and the experts'
              {gate,up}_proj.bias [I], down_proj.bias [H]
  MTP module j (DeepSeek), prefix model.layers.{num_layers + j}.:
    enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H], shared_head.norm.weight [H],
    plus one decoder layer shaped like the last main layer; embedding and LM head are
    shared with the main model (not stored again).

Checkpoints that name things otherwise (Kimi's `block_sparse_moe` with experts
`w1/w2/w3`, gpt-oss's fused `gate_up_proj`) are renamed on loading (`checkpoint.py`);
here every family uses the DeepSeek/Qwen names above.

Initialisation: linear weights ~ N(0, 1/fan_in) (fan_in = the `in` dim; K for the
depthwise convs); embeddings ~ N(0, 1); norm weights 1; norm biases and the router
correction bias 0; projection and router biases ~ N(0, 0.01), sinks ~ N(0, 1); KDA
`A_log = log U(1, 16)` and `dt_bias = softplus^-1(dt)`, dt log-uniform in
[1e-3, 1e-1] (Mamba/KDA's own init, so decays are slow). Each tensor
is drawn on the CPU in float32 from its own `torch.Generator`, seeded by
`blake2b(f"{seed}:{name}")`, then cast: a tensor depends only on (seed, name, shape),
so a rank can build just the tensors it needs, and float64 weights are exactly the
float32 ones widened.
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

from labkit.engine.compute.models.family import family_config
from labkit.specs.models import ModelSpec


def _linear_attn_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    H, h, d, K = spec.hidden_size, spec.linear_num_heads, spec.linear_head_dim, \
        spec.linear_conv_kernel
    s = {f"self_attn.{p}_proj.weight": (h * d, H) for p in "qkv"}
    if K:
        s.update({f"self_attn.{p}_conv1d.weight": (h * d, 1, K) for p in "qkv"})
    s.update({
        "self_attn.A_log": (h,), "self_attn.dt_bias": (h * d,),
        "self_attn.f_a_proj.weight": (d, H), "self_attn.f_b_proj.weight": (h * d, d),
        "self_attn.b_proj.weight": (h, H),
        "self_attn.g_a_proj.weight": (d, H), "self_attn.g_b_proj.weight": (h * d, d),
        "self_attn.o_norm.weight": (d,), "self_attn.o_proj.weight": (H, h * d),
    })
    return s


def _mla_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    H, n, r = spec.hidden_size, spec.num_heads, spec.kv_lora_rank
    nope, rope_d, v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    s: dict[str, tuple[int, ...]] = {}
    if spec.q_lora_rank:
        s["self_attn.q_a_proj.weight"] = (spec.q_lora_rank, H)
        s["self_attn.q_a_layernorm.weight"] = (spec.q_lora_rank,)
        s["self_attn.q_b_proj.weight"] = (n * (nope + rope_d), spec.q_lora_rank)
    else:
        s["self_attn.q_proj.weight"] = (n * (nope + rope_d), H)
    s["self_attn.kv_a_proj_with_mqa.weight"] = (r + rope_d, H)
    s["self_attn.kv_a_layernorm.weight"] = (r,)
    s["self_attn.kv_b_proj.weight"] = (n * (nope + v), r)
    s["self_attn.o_proj.weight"] = (H, n * v)
    if spec.has_indexer:
        hi, di = spec.index_num_heads, spec.index_head_dim
        s["self_attn.indexer.wq_b.weight"] = (hi * di, spec.q_lora_rank or H)
        s["self_attn.indexer.wk.weight"] = (di, H)
        s["self_attn.indexer.k_norm.weight"] = (di,)
        s["self_attn.indexer.k_norm.bias"] = (di,)
        s["self_attn.indexer.weights_proj.weight"] = (hi, H)
    return s


def _gqa_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    H, D, cfg = spec.hidden_size, spec.head_dim, family_config(spec)
    outs = {"q": spec.num_heads * D, "k": spec.num_kv_heads * D, "v": spec.num_kv_heads * D,
            "o": H}
    s: dict[str, tuple[int, ...]] = {
        f"self_attn.{p}_proj.weight": (n, spec.num_heads * D if p == "o" else H)
        for p, n in outs.items()}
    if cfg.attention_bias:
        s.update({f"self_attn.{p}_proj.bias": (n,) for p, n in outs.items()})
    if cfg.attention_sinks:
        s["self_attn.sinks"] = (spec.num_heads,)
    if cfg.qk_norm:
        s["self_attn.q_norm.weight"] = (D,)
        s["self_attn.k_norm.weight"] = (D,)
    return s


def _mlp_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    H, cfg = spec.hidden_size, family_config(spec)

    def ffn(prefix: str, inter: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
        s = {f"{prefix}gate_proj.weight": (inter, H), f"{prefix}up_proj.weight": (inter, H),
             f"{prefix}down_proj.weight": (H, inter)}
        if bias:
            s.update({f"{prefix}gate_proj.bias": (inter,), f"{prefix}up_proj.bias": (inter,),
                      f"{prefix}down_proj.bias": (H,)})
        return s

    if not spec.is_moe_layer(layer):
        return ffn("mlp.", spec.intermediate_size)
    s = {"mlp.gate.weight": (spec.num_experts, H)}
    if cfg.router_bias:
        s["mlp.gate.e_score_correction_bias"] = (spec.num_experts,)
    if cfg.moe_bias:
        s["mlp.gate.bias"] = (spec.num_experts,)
    for e in range(spec.num_experts):
        s.update(ffn(f"mlp.experts.{e}.", spec.moe_intermediate_size, cfg.moe_bias))
    if spec.num_shared_experts:
        s.update(ffn("mlp.shared_experts.",
                     spec.moe_intermediate_size * spec.num_shared_experts))
    return s


def layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's tensors, names relative to `model.layers.{i}.`.

    `layer` decides the structure (linear vs full attention, dense vs MoE MLP)."""
    H = spec.hidden_size
    s = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    if spec.is_linear_layer(layer):
        s.update(_linear_attn_shapes(spec))
    elif spec.is_mla:
        s.update(_mla_shapes(spec))
    else:
        s.update(_gqa_shapes(spec))
    s.update(_mlp_shapes(spec, layer))
    return s


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the full, unsharded model (MTP modules included), by name.

    Cheap for any spec (no tensor is allocated)."""
    family_config(spec)  # an unknown family fails here, clearly
    V, H, L = spec.vocab_size, spec.hidden_size, spec.num_layers
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(L):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer_shapes(spec, i).items()})
    shapes["model.norm.weight"] = (H,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for j in range(spec.num_mtp_modules):
        p = f"model.layers.{L + j}."
        shapes.update({p + "enorm.weight": (H,), p + "hnorm.weight": (H,),
                       p + "eh_proj.weight": (H, 2 * H)})
        shapes.update({p + k: v for k, v in layer_shapes(spec, L - 1).items()})
        shapes[p + "shared_head.norm.weight"] = (H,)
    return shapes


def name_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: stable across processes and platforms."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


_ONES = re.compile(r"(norm|layernorm)\.weight$")
_SMALL = re.compile(r"(_proj|mlp\.gate)\.bias$")
_ZEROS = re.compile(r"(\.bias|e_score_correction_bias)$")


def init_tensor(name: str, shape: tuple[int, ...], seed: int = 0,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One tensor of the scheme above, deterministic in (seed, name, shape)."""
    if _ONES.search(name):
        return torch.ones(shape, dtype=dtype)
    if _SMALL.search(name) or name.endswith("sinks"):
        g = torch.Generator().manual_seed(name_seed(seed, name))
        return (torch.randn(shape, generator=g) * (1.0 if name.endswith("sinks") else 0.1)
                ).to(dtype)
    if _ZEROS.search(name):
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(name_seed(seed, name))
    if name.endswith("A_log"):
        t = torch.log(torch.rand(shape, generator=g) * 15 + 1)
    elif name.endswith("dt_bias"):
        dt = torch.exp(torch.rand(shape, generator=g) * (math.log(0.1) - math.log(1e-3))
                       + math.log(1e-3))
        t = dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    else:
        t = torch.randn(shape, generator=g)
        if "embed_tokens" not in name:
            fan_in = shape[-1] if len(shape) == 2 else shape[-1] * shape[-2]
            t = t / math.sqrt(fan_in)
    return t.to(dtype)


def init_weights(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The full, unsharded weights of `spec`, bit-for-bit deterministic in `seed`."""
    return {n: init_tensor(n, s, seed, dtype).to(device)
            for n, s in weight_shapes(spec).items()}


def layer_weights(weights: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """One decoder layer's (or MTP module's) tensors, `model.layers.{i}.` stripped."""
    p = f"model.layers.{layer}."
    return {k[len(p):]: v for k, v in weights.items() if k.startswith(p)}
