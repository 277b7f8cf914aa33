"""`CostModel`: seconds per op on a GPU, from its datasheet and the fitted constants.

    cm = CostModel("h200")
    cm.gemm(4096, 7168, 2048)                      # one GEMM, a float
    cm.attention_decode(batch=np.array([1, 64]), context=32768, num_heads=64,
                        num_kv_heads=8, head_dim=128)  # an array, one entry per element

Every method takes scalars or numpy arrays for its shape arguments (broadcast together,
elementwise, with no branching on values) and returns seconds: a float for scalars, an
array otherwise; element i of an array call equals the scalar call on element i, bit
for bit. String arguments (dtypes, op names) choose the formula and must be scalars.
Ops are kernels as vLLM 0.24 runs them under CUDA graphs; what an engine step costs
beyond its kernels (graph launches, the CPU's scheduling, input preparation and
sampling) is the step model's business (`engine/sim/overheads.py`), which composes
these ops (`step_time`).
"""

from __future__ import annotations

from labkit.costmodel import attention, comm, gemm, mla, moe, sparse
from labkit.costmodel.curves import as_array, as_float, result
from labkit.costmodel.device import Device, make_device
from labkit.costmodel.params import CALIBRATED, CostModelParams
from labkit.errors import unknown_choice
from labkit.specs.dtypes import dtype_bytes
from labkit.specs.hardware import HardwareSpec

KV_DTYPES = ("bf16", "fp8")
DEEPSEEK_V3_MLA = mla.MlaDims()


def _kv(kv_dtype: str) -> float:
    if kv_dtype not in KV_DTYPES:
        raise unknown_choice("KV-cache dtype", kv_dtype, KV_DTYPES)
    return float(dtype_bytes(kv_dtype))


class CostModel:
    """Op-level cost model of one GPU; see the module docstring."""

    def __init__(self, hardware: str | HardwareSpec = "h200", *, sm_count: int | None = None,
                 params: CostModelParams = CALIBRATED, check_sizes: bool = True) -> None:
        """`check_sizes` False: a trusted caller's model (`trusted`)."""
        self.device: Device = make_device(hardware, sm_count)
        self.params = params
        self.check_sizes = check_sizes
        self._a = as_array if check_sizes else as_float  # shape arguments as float64

    def trusted(self) -> CostModel:
        """The same model without the size checks, for a caller that builds its sizes
        itself (the engine's step model): checking an array (two reductions) costs
        more than pricing a few steps' worth of it. Same results, bit for bit."""
        return CostModel(self.hardware, sm_count=self.device.sms, params=self.params,
                         check_sizes=False)

    @property
    def hardware(self) -> HardwareSpec:
        return self.device.spec

    def __repr__(self) -> str:
        return f"CostModel({self.hardware.name!r}, sms={self.device.sms})"

    # ---- dense compute --------------------------------------------------------------
    def gemm(self, m, n, k, dtype: str = "bf16"):
        """[m, k] x [k, n]; dtype "bf16", "fp8" (per-token activations) or "fp8_block"."""
        a = self._a
        gemm.check_gemm_dtype(dtype)
        return result(gemm.gemm_seconds(self.device, self.params.gemm[dtype], a(m), a(n), a(k),
                                        dtype))

    def moe(self, num_tokens, hidden, inter, topk, num_experts, ep_size=1, tp_size=1,
            dtype: str = "bf16", distribution: str = "balanced", load_factor=None):
        """A fused MoE layer on the busiest GPU of its expert group (router excluded);
        dtype "bf16", "fp8" (per-tensor) or "fp8_block". `distribution`: "balanced" or
        "power_law_<alpha>" routing (see `routing.py`); `load_factor` overrides the
        busiest rank's share of rows over the balanced one (default: what the
        distribution's calibration draws give)."""
        a = self._a
        routing = moe.check_moe_args(dtype, distribution)
        if load_factor is None:
            load_factor = moe.default_load_factor(num_tokens, num_experts, topk, ep_size,
                                                  routing)
        return result(moe.moe_seconds(self.device, self.params.moe[dtype], a(num_tokens),
                                      a(hidden), a(inter), a(topk), a(num_experts), a(ep_size),
                                      a(tp_size), dtype, routing, a(load_factor)))

    # ---- attention ------------------------------------------------------------------
    def attention_decode(self, batch, context, num_heads, num_kv_heads, head_dim,
                         kv_dtype: str = "bf16"):
        """One new token per sequence over `context` cached tokens (GQA, FA3)."""
        a = self._a
        return result(attention.attention_decode_seconds(
            self.device, self.params.decode_attention, a(batch), a(context), a(num_heads),
            a(num_kv_heads), a(head_dim), _kv(kv_dtype), kv_dtype))

    def attention_prefill(self, batch, new_tokens, prefix, num_heads, num_kv_heads, head_dim,
                          kv_dtype: str = "bf16"):
        """`new_tokens` per sequence after `prefix` cached ones, causal (GQA, FA3)."""
        a = self._a
        return result(attention.attention_prefill_seconds(
            self.device, self.params.prefill_attention, a(batch), a(new_tokens), a(prefix),
            a(num_heads), a(num_kv_heads), a(head_dim), _kv(kv_dtype), kv_dtype))

    def mla_decode(self, batch, context, num_heads, kv_lora_rank=512, qk_rope_head_dim=64,
                   kv_dtype: str = "bf16", query_len=1):
        """MLA attention core over the latent cache (absorbed; no projections).
        `query_len` > 1 prices speculative verification (1 + draft tokens)."""
        a = self._a
        return result(mla.absorbed_core_seconds(
            self.device, self.params.mla, a(batch), a(query_len), a(context), a(num_heads),
            a(kv_lora_rank), a(qk_rope_head_dim), _kv(kv_dtype), kv_dtype))

    def mla_prefill(self, batch, new_tokens, prefix, num_heads, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, kv_dtype: str = "bf16"):
        """MLA prefill core: MHA over up-projected K/V (no projections). The up-projected
        K/V are bf16 whatever the cache dtype, so `kv_dtype` does not change the time."""
        a = self._a
        _kv(kv_dtype)
        return result(mla.mla_prefill_core_seconds(
            self.device, self.params, a(batch), a(new_tokens), a(prefix), a(num_heads),
            a(qk_nope_head_dim), a(qk_rope_head_dim), a(v_head_dim)))

    def mla_decode_module(self, batch, context, num_heads, kv_dtype: str = "bf16",
                          gemm_dtype: str = "bf16", query_len=1,
                          dims: mla.MlaDims = DEEPSEEK_V3_MLA):
        """DeepSeek-V3's whole MLA attention module in decode (projections + core)."""
        a = self._a
        gemm.check_gemm_dtype(gemm_dtype)
        return result(mla.mla_decode_module_seconds(
            self.device, self.params, a(batch), a(context), a(num_heads), a(query_len), dims,
            _kv(kv_dtype), kv_dtype, gemm_dtype))

    def mla_prefill_module(self, batch, new_tokens, prefix, num_heads, kv_dtype: str = "bf16",
                           gemm_dtype: str = "bf16", dims: mla.MlaDims = DEEPSEEK_V3_MLA):
        """The whole MLA module in prefill; short prefills take the absorbed path as in vLLM."""
        a = self._a
        gemm.check_gemm_dtype(gemm_dtype)
        return result(mla.mla_prefill_module_seconds(
            self.device, self.params, a(batch), a(new_tokens), a(prefix), a(num_heads), dims,
            _kv(kv_dtype), kv_dtype, gemm_dtype))

    def sparse_attention(self, batch, new_tokens, topk, num_heads, kv_lora_rank=512,
                         qk_rope_head_dim=64, kv_dtype: str = "bf16"):
        """DSA: each query attends `topk` gathered latent entries (derived, not fitted)."""
        a = self._a
        return result(sparse.sparse_attention_seconds(
            self.device, self.params, a(batch), a(new_tokens), a(topk), a(num_heads),
            a(kv_lora_rank), a(qk_rope_head_dim), _kv(kv_dtype), kv_dtype))

    def indexer(self, batch, new_tokens, context, index_num_heads=64, index_head_dim=128):
        """DSA indexer: fp8 scores of every new token against the whole context + top-k."""
        a = self._a
        return result(sparse.indexer_seconds(self.device, self.params, a(batch), a(new_tokens),
                                             a(context), a(index_num_heads), a(index_head_dim)))

    # ---- communication --------------------------------------------------------------
    def collective(self, op: str, message_bytes, num_gpus):
        """all_reduce | all_gather | reduce_scatter | all_to_all over `num_gpus` GPUs."""
        a = self._a
        comm.check_collective(op)
        return result(comm.collective_seconds(self.device, self.params.comm, op,
                                              a(message_bytes), a(num_gpus)))

    def p2p(self, nbytes, link: str = "nvlink"):
        """One point-to-point transfer over "nvlink", "ib" or "pcie"."""
        a = self._a
        return result(comm.p2p_seconds(self.device, self.params.comm, a(nbytes), link))

    def host_transfer(self, nbytes, direction: str = "h2d"):
        """Copy between host memory and the GPU over PCIe ("h2d" or "d2h")."""
        a = self._a
        return result(comm.host_transfer_seconds(self.device, a(nbytes), direction))

    # ---- one engine step ------------------------------------------------------------
    def step_time(self, model, layout, batch, *, kv_dtype: str = "bf16",
                  num_speculative_tokens: int = 0, dcp_kv_cache_interleave_size: int = 1,
                  lockstep: bool | None = None, **knobs) -> dict:
        """One engine step of `batch` under `layout`, composed from the ops above.

        `batch`: entries {"new_tokens": n, "context": c} (tokens already cached before
        the step); a decode entry has n = 1 + draft tokens (say "decode": True/False to
        override the guess). A flat list is one DP rank's batch; a list of lists gives
        one batch per DP rank (DEP ranks run in lockstep). `knobs`: engine knobs of the
        step's overheads and routing (`cudagraph_mode`, `async_scheduling`, `moe_routing`,
        `enable_eplb`, ...). Returns seconds of the step, its compute_s and comm_s
        (slowest rank), and per_rank dicts with stall_s.
        """
        from labkit.engine.sim.step_time import step_time

        return step_time(self, model, layout, batch, kv_dtype=kv_dtype,
                         num_speculative_tokens=num_speculative_tokens,
                         dcp_kv_cache_interleave_size=dcp_kv_cache_interleave_size,
                         lockstep=lockstep, **knobs)
