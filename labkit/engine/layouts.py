"""Who holds what: a model's weights and KV over the GPUs of a layout.

A layout string says how many GPUs do what (`labkit.specs.Layout`); this module says
what each GPU then *holds*, which is where layouts differ most for agentic traffic:

**Weights.** TP splits attention heads and MLP columns (and vocab-parallel embeddings);
projections that are not per head — MLA's down-projections q_a / kv_a, a DSA indexer,
the router — are replicated on every TP rank. Routed experts are spread over an
*expert group*: the EP ranks when EP is on (whole experts each), otherwise the TP ranks
(a slice of every expert). PP gives each stage its layers (embedding on the first, LM
head and MTP on the last). PCP and DCP add no weight split: PCP ranks each hold a full
TP slice; DCP reuses the TP GPUs.

**Persistent KV** (per request, kept for its whole life):
- GQA under TP: each GPU keeps `max(1, kv_heads / tp)` KV heads — beyond tp = kv_heads
  the heads are *replicated*; MLA's single latent is replicated on every TP rank.
- DCP shards tokens over `dcp` GPUs of the tp*pcp group, interleaved by
  `dcp_kv_cache_interleave_size` I: token i lives on rank (i // I) % dcp. vLLM allows
  dcp up to the replication it removes: dcp <= pcp * max(1, tp / kv_heads) (MLA: 1 head).
- PCP splits a prompt's *queries*; the new KV is all-gathered, so without DCP every
  PCP rank ends with a full copy. With DCP (PCPxDCP) each keeps its 1/dcp shard.
- KVPP gives each layer's KV to one of `kvpp` TP ranks (by layer index).
- PP: a GPU keeps its stage's layers only.
Linear-attention layers keep a fixed state per sequence, split by heads under TP.

**Temporary KV** (per request, during a layer): PCPxDCP all-gathers the full KV of the
layer being computed for its queries — the chunk's new KV over the PCP ranks and the
cached prefix's DCP shards over the DCP group, so its cost grows with the context; KVPP
broadcasts the owner's layer to the others;
DCP on MLA gathers a prefill's prefix latents.

**Communication per step** (per layer): TP all-reduces after attention and MLP; EP
all-to-all (dispatch, combine) per MoE layer; DCP all-gathers queries and
reduce-scatters partial outputs with their log-sum-exp; PCP all-gathers new KV (and,
with DCP, each prefill layer gathers the prefix's shards: `gathers_shards_for_prefill`); KVPP
broadcasts a layer's KV; PP sends activations between stages. DCP alone on an MLA
model also all-gathers a prefill chunk's cached prefix (see
`gathers_prefix_for_prefill`), so its cost grows with the context. Message sizes follow
nccl-tests: the all-reduce buffer, the all-gather *output*, the reduce-scatter *input*,
the all-to-all send buffer — each as one GPU sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.errors import ConfigError
from labkit.specs.dtypes import dtype_bytes
from labkit.specs.layout import Layout
from labkit.specs.models import ModelSpec

ACT_BYTES = 2  # activations travel in bf16
DISPATCH_BYTES = 1  # MoE dispatch in fp8 (DeepEP-style), combine in bf16


def dcp_shard_tokens(num_tokens, dcp: int, interleave: int, rank: int = 0):
    """Tokens of a num_tokens context that DCP rank `rank` keeps (exact): the positions
    p < num_tokens with (p // interleave) % dcp == rank. An int, or an array of them
    for an array of contexts."""
    full, rest = np.divmod(num_tokens, interleave * dcp)
    kept = full * interleave + np.clip(rest - rank * interleave, 0, interleave)
    return int(kept) if np.ndim(kept) == 0 else kept


@dataclass(frozen=True, slots=True)
class Placement:
    model: ModelSpec
    layout: Layout
    kv_dtype: str = "bf16"
    dcp_interleave: int = 1
    include_mtp: bool = False
    redundant_experts: int = 0  # EPLB replicas per MoE layer, spread over the EP ranks

    def __post_init__(self) -> None:
        check_layout(self.model, self.layout)
        if self.redundant_experts:
            check_redundant_experts(self.model, self.layout, self.redundant_experts)

    # ------------------------------------------------------------ structure
    @property
    def gpus(self) -> int:
        return self.layout.gpus

    @property
    def kv_heads(self) -> int:
        """KV heads of a full-attention layer (MLA: one latent shared by all heads)."""
        return 1 if self.model.is_mla else self.model.num_kv_heads

    @property
    def kv_heads_per_gpu(self) -> float:
        """Heads of KV a TP rank holds before DCP/KVPP (>= 1: replication past kv_heads)."""
        return max(1, self.kv_heads // self.layout.tp) if not self.model.is_mla else 1

    @property
    def dcp_heads_per_gpu(self) -> float:
        """Query heads a GPU attends for under DCP: its own TP heads and those of the
        TP ranks sharing its KV shard group (all heads when the group is PCP ranks)."""
        lay = self.layout
        return self.model.num_heads / lay.tp * min(lay.dcp, lay.tp)

    @property
    def layers_per_stage(self) -> int:
        return -(-self.model.num_layers // self.layout.pp)

    @property
    def expert_group(self) -> int:
        """GPUs over which one copy of the routed experts is spread."""
        lay = self.layout
        return lay.ep if lay.ep > 1 else lay.tp

    # -------------------------------------------------------------- weights
    def weights_bytes_per_gpu(self) -> float:
        """Weight bytes on the most loaded GPU (the last PP stage, with the LM head)."""
        m, lay = self.model, self.layout
        w = dtype_bytes(m.weight_dtype)
        stage = self.layers_per_stage
        first_layer = m.num_layers - stage  # the last stage's layers
        layer_bytes = sum(self._layer_weight_params(i) for i in range(first_layer, m.num_layers))
        vocab = m.vocab_size * m.hidden_size * dtype_bytes("bf16") / lay.tp
        # one stage holds both the embedding and the LM head only without PP
        embeddings = vocab * (2 if lay.pp == 1 and not m.tie_word_embeddings else 1)
        mtp = 0.0
        if self.include_mtp and m.num_mtp_modules:
            mtp = m.num_mtp_modules * (2 * m.hidden_size ** 2 / lay.tp
                                       + self._layer_weight_params(m.num_layers - 1))
        return (layer_bytes + mtp) * w + embeddings

    def _layer_weight_params(self, layer: int) -> float:
        """Parameters of one layer that one GPU of its stage holds."""
        m, tp = self.model, self.layout.tp
        h = m.hidden_size
        if m.is_linear_layer(layer):
            heads, dim = m.linear_num_heads, m.linear_head_dim
            attn = 4 * h * heads * dim / tp + 2 * h * dim + 2 * dim * heads * dim / tp \
                + h * heads / tp
        elif m.is_mla:
            q_dim = m.num_heads * m.qk_head_dim
            replicated = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.indexer_params()
            if m.q_lora_rank:
                replicated += h * m.q_lora_rank
                per_head = m.q_lora_rank * q_dim
            else:
                per_head = h * q_dim
            per_head += m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            per_head += m.num_heads * m.v_head_dim * h
            attn = replicated + per_head / tp
        else:
            q_o = 2 * h * m.num_heads * m.head_dim / tp
            kv = 2 * h * m.head_dim * max(1, m.num_kv_heads // tp)
            attn = q_o + kv
        if not m.is_moe_layer(layer):
            return attn + 3 * h * m.intermediate_size / tp
        routed = (m.num_experts + self.redundant_experts) * m.expert_params() / self.expert_group
        shared = m.num_shared_experts * m.expert_params() / tp
        return attn + routed + shared + h * m.num_experts

    # ------------------------------------------------------------------- KV
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over the whole model, one copy (capacity's unit)."""
        return self.model.kv_bytes_per_token(self.kv_dtype, self.include_mtp)

    def _kv_layers_per_gpu(self) -> int:
        layers = -(-self._full_attention_layers() // self.layout.pp)
        return -(-layers // self.layout.kvpp)

    def _full_attention_layers(self) -> int:
        m = self.model
        return m.num_full_attention_layers + (m.num_mtp_modules if self.include_mtp else 0)

    def kv_bytes_per_token_per_layer_per_gpu(self) -> float:
        """One token, one layer, on a GPU that holds it (heads split, not DCP)."""
        m = self.model
        per_layer = m.kv_bytes_per_token_per_layer(self.kv_dtype)
        if m.is_mla:
            return per_layer
        return per_layer * self.kv_heads_per_gpu / m.num_kv_heads

    def persistent_kv_bytes_per_gpu(self, num_tokens: int) -> float:
        """KV of one request of num_tokens on the GPU holding the most of it (its
        sliding-window layers hold the last `sliding_window` tokens only)."""
        tokens = (dcp_shard_tokens(num_tokens, self.layout.dcp, self.dcp_interleave)
                  if self.layout.dcp > 1 else num_tokens)
        kv = tokens * self._kv_layers_per_gpu() * self.kv_bytes_per_token_per_layer_per_gpu()
        window = min(num_tokens, self.model.sliding_window) * self.window_pages_per_block()
        return kv + window * self.kv_bytes_per_token_per_gpu() + self.state_bytes_per_gpu()

    def window_pages_per_block(self) -> int:
        """Pool pages (sized for the full-attention layers) the sliding-window layers
        of one logical block take (0 without them; see kv/sliding_window.py)."""
        m = self.model
        return -(-m.num_sliding_layers // self._full_attention_layers())

    def kv_bytes_per_token_per_gpu(self) -> float:
        """Average persistent KV bytes a token costs on a GPU of its replica (capacity)."""
        return (self._kv_layers_per_gpu() * self.kv_bytes_per_token_per_layer_per_gpu()
                / self.layout.dcp)

    def state_bytes_per_gpu(self) -> float:
        """Fixed linear-attention state of one sequence on one GPU."""
        m = self.model
        if not m.linear_layers:
            return 0.0
        stages = self.layout.pp
        return m.linear_state_bytes_per_sequence() / self.layout.tp / stages

    def temporary_kv_bytes_per_gpu(self, num_tokens: int) -> float:
        """KV a GPU must hold only while one layer runs (for one request)."""
        lay = self.layout
        one_layer = num_tokens * self.kv_bytes_per_token_per_layer_per_gpu()
        if lay.pcp > 1 and lay.dcp > 1:
            return one_layer  # the layer's full KV, gathered for this rank's queries
        if self.gathers_prefix_for_prefill():
            return one_layer  # a prefill's prefix latents, gathered for this layer
        if lay.kvpp > 1:
            return one_layer  # the owner's layer, broadcast to this rank
        return 0.0

    def kv_replication(self) -> float:
        """Copies of each token's KV across one replica's GPUs (1 = no duplication)."""
        lay = self.layout
        held = self.kv_bytes_per_token_per_gpu() * lay.tp * lay.pcp * lay.pp
        return held / self.kv_bytes_per_token()

    # -------------------------------------------------------- communication
    def gathers_prefix_for_prefill(self) -> bool:
        """DCP alone on an MLA model: a prefill chunk runs as multi-head attention over
        up-projected keys and values, but each rank's up-projection holds only its own
        heads — so every rank all-gathers the cached prefix's latents, layer by layer
        (vLLM's MLA prefill under DCP). DSA's sparse path stays absorbed and does not."""
        m, lay = self.model, self.layout
        return lay.dcp > 1 and lay.pcp == 1 and m.is_mla and not m.has_indexer

    def gathers_shards_for_prefill(self) -> bool:
        """PCPxDCP: a rank keeps 1/dcp of every request's KV, but its prefill queries
        attend the whole context, so each layer all-gathers the cached prefix's shards
        over the DCP group into a temporary full copy (freed after the layer)."""
        return self.layout.pcp > 1 and self.layout.dcp > 1

    def comm_per_layer(self, tokens: int, new_kv_tokens: int = 0,
                       kv_tokens_read: int = 0, prefill_prefix_tokens: int = 0,
                       sharded_query_tokens=None) -> dict[str, tuple[str, float, int]]:
        """Collectives one GPU takes part in for one layer of a step:
        name -> (op, message bytes, group size). `tokens` are the tokens through
        the layer on one GPU (PCP has already split prefill tokens), `new_kv_tokens` the
        prefill tokens whose KV PCP gathers, `kv_tokens_read` the context KVPP must
        broadcast, `prefill_prefix_tokens` the cached context of the step's prefill
        chunks and `sharded_query_tokens` the tokens whose attention runs over DCP
        shards (default: all of them)."""
        m, lay = self.model, self.layout
        h = m.hidden_size
        out: dict[str, tuple[str, float, int]] = {}
        if lay.tp > 1:
            out["tp_allreduce"] = ("all_reduce", tokens * h * ACT_BYTES, lay.tp)
        queries = tokens if sharded_query_tokens is None else sharded_query_tokens
        if lay.dcp > 1 and np.any(queries):
            q_dim = (m.kv_lora_rank + m.qk_rope_head_dim) if m.is_mla else m.head_dim
            v_dim = m.kv_lora_rank if m.is_mla else m.head_dim
            served = self.dcp_heads_per_gpu
            # partial outputs of every head served, plus one fp32 log-sum-exp per head
            partial = queries * served * (v_dim * ACT_BYTES + 4)
            tp_in_group = min(lay.dcp, lay.tp)
            if tp_in_group > 1:  # gather the queries of the TP ranks sharing this KV
                out["dcp_gather_q"] = ("all_gather", queries * served * q_dim * ACT_BYTES,
                                       tp_in_group)
                out["dcp_merge"] = ("reduce_scatter", partial, lay.dcp)
            else:  # PCP ranks already hold every head: merge, everyone keeps the result
                out["dcp_merge"] = ("all_reduce", partial, lay.dcp)
        if (self.gathers_prefix_for_prefill() or self.gathers_shards_for_prefill()) \
                and np.any(prefill_prefix_tokens):
            per_layer = self.kv_bytes_per_token_per_layer_per_gpu()
            out["dcp_gather_prefix"] = ("all_gather", prefill_prefix_tokens * per_layer, lay.dcp)
        if lay.pcp > 1 and np.any(new_kv_tokens):
            per_layer = self.kv_bytes_per_token_per_layer_per_gpu()
            out["pcp_gather_kv"] = ("all_gather", new_kv_tokens * per_layer, lay.pcp)
        if lay.kvpp > 1 and np.any(kv_tokens_read):
            per_layer = self.kv_bytes_per_token_per_layer_per_gpu()
            out["kvpp_broadcast"] = ("all_gather", kv_tokens_read * per_layer, lay.kvpp)
        return out

    def moe_comm(self, tokens: int) -> dict[str, tuple[str, float, int]]:
        """Per MoE layer (tokens on one GPU): EP all-to-all, or TP all-reduce."""
        m, lay = self.model, self.layout
        if lay.ep > 1:
            per_token = m.num_experts_per_tok * m.hidden_size
            return {"ep_dispatch": ("all_to_all", tokens * per_token * DISPATCH_BYTES, lay.ep),
                    "ep_combine": ("all_to_all", tokens * per_token * ACT_BYTES, lay.ep)}
        if lay.tp > 1:
            return {"tp_allreduce": ("all_reduce", tokens * m.hidden_size * ACT_BYTES, lay.tp)}
        return {}

    def pp_p2p_bytes(self, tokens: int) -> float:
        """Activations one stage sends the next for a step's tokens."""
        return tokens * self.model.hidden_size * ACT_BYTES

    def summary(self, context: int) -> dict:
        return {
            "gpus": self.gpus,
            "weights_bytes_per_gpu": self.weights_bytes_per_gpu(),
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu(),
            "persistent_kv_bytes_per_gpu": self.persistent_kv_bytes_per_gpu(context),
            "temporary_kv_bytes_per_gpu": self.temporary_kv_bytes_per_gpu(context),
        }


def check_redundant_experts(model: ModelSpec, layout: Layout, redundant: int) -> None:
    """EPLB's replicas need experts spread by EP, in equal slots per rank."""
    if not model.is_moe or layout.ep == 1:
        raise ConfigError(f"EPLB (num_redundant_experts={redundant}) needs a MoE model with "
                          f"expert parallelism; {model.name} under {layout.text!r} has none")
    if (model.num_experts + redundant) % layout.ep:
        raise ConfigError(
            f"num_redundant_experts={redundant}: {model.name}'s {model.num_experts} experts "
            f"plus the redundant ones must split evenly over ep{layout.ep} ranks")


def check_layout(model: ModelSpec, layout: Layout) -> None:
    """Everything the model imposes on the layout; ConfigError naming the problem."""
    layout.check_model(model)
    heads = 1 if model.is_mla else model.num_kv_heads
    if layout.dcp > 1:
        # each KV head sits on max(1, tp / heads) GPUs of a TP group, on every PCP rank
        limit = layout.pcp * max(1, layout.tp // heads)
        if layout.dcp > limit:
            raise ConfigError(
                f"layout {layout.text!r}: dcp{layout.dcp} cannot shard {model.name}'s KV: "
                f"with {heads} KV head(s) over tp*pcp = {layout.tp * layout.pcp} GPUs only "
                f"{limit}x replication exists to remove (dcp <= pcp * max(1, tp/kv_heads))"
            )
    if layout.kvpp > 1:
        limit = max(1, layout.tp // heads)
        if layout.kvpp > limit:
            raise ConfigError(
                f"layout {layout.text!r}: kvpp{layout.kvpp} needs KV replicated across "
                f"the TP group, but {model.name}'s {heads} KV head(s) over tp{layout.tp} "
                f"leave only {limit}x (kvpp <= tp/kv_heads)"
            )
    if layout.kvpp > 1 and layout.dcp > 1:
        raise ConfigError(f"layout {layout.text!r}: kvpp{layout.kvpp} and dcp{layout.dcp} "
                          f"both spread the KV copies of the TP group (by layer, by token); "
                          f"use one of them")
    if layout.kvpp > 1 and layout.kvpp > model.num_full_attention_layers:
        raise ConfigError(f"layout {layout.text!r}: kvpp{layout.kvpp} exceeds "
                          f"{model.name}'s {model.num_full_attention_layers} attention layers")
