"""What a model is, as far as serving is concerned.

A serving engine does not need a model's weights to plan its work; it needs the
*shape* of the model: how many layers of which kind, how many bytes of KV cache one
token costs in each, how many parameters a token touches (MoE activates only a few
experts), and what a step must read from memory. `ModelSpec` holds those published
architecture numbers and derives the quantities the rest of labkit uses:

- KV bytes per token, per layer kind and dtype. GQA layers store a key and a value per
  KV head; MLA layers (DeepSeek-V3, Kimi-K2) store one compressed latent vector
  (`kv_lora_rank + qk_rope_head_dim` elements) shared by all heads; a DSA indexer
  (DeepSeek-V3.2) adds its own small key cache; linear-attention layers (Kimi-Linear's
  KDA) keep a fixed-size state per sequence instead of per-token KV; sliding-window
  layers (gpt-oss, Gemma) store per-token KV like full attention but only the last
  `sliding_window` tokens are ever read, so a request holds at most a window of it.
- Parameter counts: total, per layer, per expert, and *active* per token.

The presets themselves live in `model_presets.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.specs.dtypes import dtype_bytes
from labkit.specs.family import FamilyConfig

# DeepSeek-V3.2 keeps its indexer keys in fp8 with one fp32 scale per 128 elements.
INDEXER_SCALE_BYTES = 4


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    family: str  # llama, qwen3_moe, deepseek_v3, deepseek_v32, kimi_k2, kimi_linear
    num_layers: int  # decoder layers, MTP modules excluded
    hidden_size: int
    vocab_size: int
    num_heads: int
    attention: str = "gqa"  # kind of the full-attention layers: "gqa" | "mla"
    # GQA
    num_kv_heads: int = 0
    head_dim: int = 0
    # MLA
    q_lora_rank: int = 0  # 0: queries are projected directly from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MLP / MoE
    intermediate_size: int = 0  # dense MLP (and the dense layers of MoE models)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0  # leading layers with a dense MLP instead of MoE
    # Linear attention (KDA) layers of a hybrid model, by 0-based layer index
    linear_layers: tuple[int, ...] = ()
    linear_num_heads: int = 0
    linear_head_dim: int = 0
    linear_conv_kernel: int = 0
    # Sliding-window attention layers (same projections as the full-attention ones;
    # a query attends only the last `sliding_window` positions, itself included)
    sliding_window: int = 0
    sliding_window_layers: tuple[int, ...] = ()
    # DSA sparse indexer (DeepSeek-V3.2)
    index_num_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # Compressed attention (DeepSeek-V4), per layer: one KV entry (and index key) is
    # kept per `ratio` tokens (0 or 1: every token); () = no compression
    kv_compress_ratios: tuple[int, ...] = ()
    num_mtp_modules: int = 0  # multi-token-prediction modules (speculative drafts)
    weight_dtype: str = "bf16"  # dtype of the linear layers as served
    tie_word_embeddings: bool = False
    max_model_len: int = 131072
    block_size: int = 16  # the KV block size engines use for this family by default
    source: str = ""  # where the numbers come from
    # RoPE, norms, router, activations (`family.py`); None: the family's defaults
    constants: FamilyConfig | None = None

    def __post_init__(self) -> None:
        swa, linear = set(self.sliding_window_layers), set(self.linear_layers)
        if swa and self.sliding_window < 1:
            raise ValueError(f"model {self.name}: sliding_window_layers need sliding_window >= 1")
        if swa & linear:
            raise ValueError(f"model {self.name}: layers {sorted(swa & linear)} are both "
                             "sliding-window and linear-attention layers")
        if any(not 0 <= i < self.num_layers for i in swa | linear):
            raise ValueError(f"model {self.name}: a layer index is outside "
                             f"0..{self.num_layers - 1}")
        if self.kv_compress_ratios and len(self.kv_compress_ratios) != self.num_layers:
            raise ValueError(f"model {self.name}: kv_compress_ratios needs one ratio per "
                             f"layer ({self.num_layers}), got {len(self.kv_compress_ratios)}")
        if swa and self.num_full_attention_layers < 1:
            # KV pages are sized by the full-attention layers (see engine/kv/sliding_window.py)
            raise ValueError(f"model {self.name}: a sliding-window model needs at least one "
                             "full-attention layer")

    @classmethod
    def from_hf_config(cls, config, name: str | None = None) -> ModelSpec:
        """The spec of a Hugging Face model: `config` is a `config.json` path, an HF
        folder or the parsed dict (see `hf_config.py`)."""
        from labkit.specs.hf_config import from_hf_config
        return from_hf_config(config, name)

    # ------------------------------------------------------------------ layers
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def has_indexer(self) -> bool:
        return self.index_topk > 0

    def is_linear_layer(self, layer: int) -> bool:
        return layer in self.linear_layers

    def is_sliding_layer(self, layer: int) -> bool:
        return layer in self.sliding_window_layers

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense

    @property
    def num_linear_layers(self) -> int:
        return len(self.linear_layers)

    @property
    def num_sliding_layers(self) -> int:
        return len(self.sliding_window_layers)

    @property
    def num_full_attention_layers(self) -> int:
        """Layers whose KV grows with the whole context (sliding-window ones excluded)."""
        return self.num_layers - self.num_linear_layers - self.num_sliding_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def num_dense_mlp_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query/key: head_dim (GQA) or nope + rope (MLA)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    # ---------------------------------------------------------------- KV bytes
    def kv_elements_per_token_per_layer(self) -> int:
        """Elements one token stores in one full-attention layer (all heads)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_keep_fraction(self) -> float:
        """The share of tokens whose KV a layer keeps, averaged over the layers (1 but
        for compressed attention)."""
        if not self.kv_compress_ratios:
            return 1.0
        return sum(1 / max(r, 1) for r in self.kv_compress_ratios) / len(self.kv_compress_ratios)

    def kv_bytes_per_token_per_layer(self, dtype: str = "bf16") -> float:
        """Bytes one token costs in one attention layer (full or sliding window), indexer
        keys included (a layer average under compressed attention)."""
        nbytes = self.kv_elements_per_token_per_layer() * dtype_bytes(dtype)
        if self.has_indexer:
            nbytes += self.index_head_dim + INDEXER_SCALE_BYTES
        return nbytes * self.kv_keep_fraction if self.kv_compress_ratios else nbytes

    def kv_bytes_per_token(self, dtype: str = "bf16", include_mtp: bool = False) -> int:
        """Bytes one token costs over all full-attention layers (one copy of the model)."""
        layers = self.num_full_attention_layers + (self.num_mtp_modules if include_mtp else 0)
        return layers * self.kv_bytes_per_token_per_layer(dtype)

    def sliding_kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        """Bytes one token costs over all sliding-window layers (while in the window)."""
        return self.num_sliding_layers * self.kv_bytes_per_token_per_layer(dtype)

    def linear_state_bytes_per_sequence(self, state_dtype: str = "fp32") -> int:
        """Fixed state of all linear-attention layers for one sequence.

        Per layer: a (head_dim x head_dim) recurrent matrix per head, plus the
        short-convolution history of q, k and v (kernel - 1 positions each).
        """
        if not self.linear_layers:
            return 0
        heads, dim = self.linear_num_heads, self.linear_head_dim
        recurrent = heads * dim * dim * dtype_bytes(state_dtype)
        conv = 3 * (self.linear_conv_kernel - 1) * heads * dim * dtype_bytes("bf16")
        return self.num_linear_layers * (recurrent + conv)

    # -------------------------------------------------------------- parameters
    def attention_params(self, layer: int) -> int:
        """Weights of one layer's attention block (norms ignored)."""
        h = self.hidden_size
        if self.is_linear_layer(layer):
            heads, dim = self.linear_num_heads, self.linear_head_dim
            qkvo = 4 * h * heads * dim
            # KDA's low-rank decay gate and output gate, and the per-head beta.
            gates = 2 * (h * dim + dim * heads * dim) + h * heads
            return qkvo + gates
        if self.is_mla:
            q_dim = self.num_heads * self.qk_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * q_dim if self.q_lora_rank else h * q_dim
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.num_heads * self.v_head_dim * h
            return q + kv_a + kv_b + o + self.indexer_params()
        q = h * self.num_heads * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * h
        return q + kv + o

    def indexer_params(self) -> int:
        """The DSA indexer: its query up-projection, key projection and head weights."""
        if not self.has_indexer:
            return 0
        q_in = self.q_lora_rank or self.hidden_size
        wq = q_in * self.index_num_heads * self.index_head_dim
        wk = self.hidden_size * self.index_head_dim
        head_weights = self.hidden_size * self.index_num_heads
        return wq + wk + head_weights

    def expert_params(self) -> int:
        """One routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def mlp_params(self, layer: int) -> int:
        """All weights of one layer's MLP; for MoE: every expert, shared ones, router."""
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.intermediate_size
        routed = self.num_experts * self.expert_params()
        shared = self.num_shared_experts * self.expert_params()
        return routed + shared + h * self.num_experts

    def embedding_params(self) -> int:
        """Input embedding plus the LM head (unless tied)."""
        emb = self.vocab_size * self.hidden_size
        return emb if self.tie_word_embeddings else 2 * emb

    def layer_params(self, layer: int) -> int:
        return self.attention_params(layer) + self.mlp_params(layer)

    def mtp_params(self) -> int:
        """MTP modules: a projection of [embedding; hidden] plus one MoE decoder layer each.

        They share the embedding and LM head with the main model.
        """
        last = self.num_layers - 1
        per_module = 2 * self.hidden_size * self.hidden_size + self.layer_params(last)
        return self.num_mtp_modules * per_module

    def total_params(self, include_mtp: bool = False) -> int:
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return self.embedding_params() + layers + (self.mtp_params() if include_mtp else 0)

    def active_params_per_token(self) -> int:
        """All parameters but the routed experts a token skips — the published
        "activated parameters" convention (it counts the embedding table)."""
        skipped = (self.num_experts - self.num_experts_per_tok) * self.expert_params()
        return self.total_params() - self.num_moe_layers * skipped

    def weight_bytes(self, dtype: str | None = None, include_mtp: bool = False) -> int:
        """Bytes of all weights, linear layers in `dtype` (default: the served dtype).

        Embeddings and the LM head stay in bf16, as they do in fp8 checkpoints.
        """
        dtype = dtype or self.weight_dtype
        emb = self.embedding_params()
        rest = self.total_params(include_mtp) - emb
        return emb * dtype_bytes("bf16") + rest * dtype_bytes(dtype)
