"""The H100 calibration measurements, as op families the cost model can be compared to.

Reads ../shared/data/calibration/h100_sxm/*.parquet (never copied into the repository;
see that folder's README): per family the rows the model claims to describe and a
function that prices each row with a `CostModel`. `fit` minimises the error of these
predictions; `bench` reports it. Latencies are stored in milliseconds, returned in
seconds.

Which measured kernels a family keeps (the ones vLLM serves with on Hopper):
- gemm: cuBLAS bf16, CUTLASS fp8 (per-token), DeepGEMM fp8_block;
- attention: FlashAttention-3, full attention (window_size 0);
- MLA modules: every row (both attention backends, both cache and GEMM dtypes);
- MoE: bf16 Triton; fp8_block = the block-scaled kernels (Triton and FlashInfer
  CUTLASS); fp8 = the per-tensor ModelOpt kernel (FlashInfer CUTLASS);
- NCCL: every row, per op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from labkit.costmodel.model import CostModel

_DTYPE = {"bfloat16": "bf16", "fp8": "fp8"}


@dataclass(slots=True)
class Family:
    """Measured rows of one op family and how the model prices them."""

    name: str
    frame: pd.DataFrame  # the rows, with `seconds` (measured)
    predict: Callable[[CostModel], np.ndarray]  # model seconds, row by row

    @property
    def measured(self) -> np.ndarray:
        return self.frame["seconds"].to_numpy()


def calibration_dir(data_dir: str | Path) -> Path:
    """Accept the shared data root, its calibration folder, or the h100_sxm folder."""
    data_dir = Path(data_dir)
    for candidate in (data_dir / "calibration" / "h100_sxm", data_dir / "h100_sxm", data_dir):
        if (candidate / "gemm.parquet").is_file():
            return candidate
    raise FileNotFoundError(f"no H100 calibration data (gemm.parquet ...) under {data_dir}")


def _read(folder: Path, name: str, query: str | None = None) -> pd.DataFrame:
    frame = pd.read_parquet(folder / f"{name}.parquet")
    if query:
        frame = frame.query(query)
    frame = frame.reset_index(drop=True)
    frame["seconds"] = frame["latency"].to_numpy() * 1e-3
    return frame


def _col(frame: pd.DataFrame, name: str) -> np.ndarray:
    return frame[name].to_numpy(dtype=np.float64)


def _by_groups(frame: pd.DataFrame, keys: list[str], price) -> Callable[[CostModel], np.ndarray]:
    """Price rows group by group when a string argument (a dtype) varies between rows."""
    groups = [(k if isinstance(k, tuple) else (k,), idx)
              for k, idx in frame.groupby(keys, sort=True).indices.items()]

    def predict(cm: CostModel) -> np.ndarray:
        out = np.empty(len(frame))
        for key, idx in groups:
            out[idx] = price(cm, frame.iloc[idx], *key)
        return out
    return predict


def _gemm(folder: Path, source: str, dtype: str, harness: bool = False) -> Family:
    f = _read(folder, "gemm", f"kernel_source == '{source}'")
    m, n, k = _col(f, "m"), _col(f, "n"), _col(f, "k")

    def predict(cm: CostModel) -> np.ndarray:
        extra = cm.params.gemm[dtype].harness_s if harness else 0.0
        return cm.gemm(m, n, k, dtype) + extra
    return Family(f"gemm {dtype}", f, predict)


def _attention(folder: Path) -> list[Family]:
    fa3 = "kernel_source == 'vllm_flash_attn_fa3' and window_size == 0"
    dec = _read(folder, "attention_decode", fa3)
    pre = _read(folder, "attention_prefill", fa3)
    decode = _by_groups(dec, ["kv_cache_dtype"], lambda cm, g, kv: cm.attention_decode(
        _col(g, "batch_size"), _col(g, "step"), _col(g, "num_heads"),
        _col(g, "num_key_value_heads"), _col(g, "head_dim"), _DTYPE[kv]))
    prefill = _by_groups(pre, ["kv_cache_dtype"], lambda cm, g, kv: cm.attention_prefill(
        _col(g, "batch_size"), _col(g, "isl"), _col(g, "step"), _col(g, "num_heads"),
        _col(g, "num_key_value_heads"), _col(g, "head_dim"), _DTYPE[kv]))
    return [Family("attention decode", dec, decode), Family("attention prefill", pre, prefill)]


def _mla(folder: Path) -> list[Family]:
    gemm_dtype = {"bfloat16": "bf16", "fp8_block": "fp8_block"}
    dec = _read(folder, "mla_decode_module")
    pre = _read(folder, "mla_prefill_module")
    decode = _by_groups(dec, ["kv_cache_dtype", "gemm_type"], lambda cm, g, kv, gt:
                        cm.mla_decode_module(_col(g, "batch_size"), _col(g, "step"),
                                             _col(g, "num_heads"), _DTYPE[kv], gemm_dtype[gt]))
    prefill = _by_groups(pre, ["kv_cache_dtype", "gemm_type"], lambda cm, g, kv, gt:
                         cm.mla_prefill_module(_col(g, "batch_size"), _col(g, "isl"),
                                               _col(g, "step"), _col(g, "num_heads"),
                                               _DTYPE[kv], gemm_dtype[gt]))
    return [Family("mla decode module", dec, decode), Family("mla prefill module", pre, prefill)]


def _moe(folder: Path, moe_dtype: str, dtype: str, distribution: str) -> Family:
    dist = "distribution == 'balanced'" if distribution == "balanced" else \
        "distribution.str.startswith('power_law')"
    f = _read(folder, "moe", f"moe_dtype == '{moe_dtype}' and {dist}")
    # every power-law row priced with its own exponent (power_law_1.01, power_law_1.2)
    predict = _by_groups(f, ["distribution"], lambda cm, g, d: cm.moe(
        *(_col(g, c) for c in ("num_tokens", "hidden_size", "inter_size", "topk",
                               "num_experts", "moe_ep_size", "moe_tp_size")),
        dtype=dtype, distribution=d))
    return Family(f"moe {dtype} {distribution}", f, predict)


def _nccl(folder: Path, op: str) -> Family:
    f = _read(folder, "nccl", f"op_name == '{op}'")
    nbytes = _col(f, "message_size") * np.where(f["nccl_dtype"] == "half", 2.0, 1.0)
    gpus = _col(f, "num_gpus")
    name = "all_to_all" if op == "alltoall" else op

    def predict(cm: CostModel) -> np.ndarray:
        return cm.collective(name, nbytes, gpus)
    return Family(f"nccl {name}", f, predict)


def load_families(data_dir: str | Path) -> dict[str, Family]:
    folder = calibration_dir(data_dir)
    families = [
        _gemm(folder, "torch.nn.functional.linear", "bf16"),
        _gemm(folder, "CutlassFP8ScaledMMLinearKernel", "fp8"),
        _gemm(folder, "DeepGemmFp8BlockScaledMMKernel", "fp8_block", harness=True),
        *_attention(folder),
        *_mla(folder),
        _moe(folder, "bfloat16", "bf16", "balanced"),
        _moe(folder, "bfloat16", "bf16", "power_law"),
        _moe(folder, "fp8_block", "fp8_block", "balanced"),
        _moe(folder, "fp8_block", "fp8_block", "power_law"),
        _moe(folder, "fp8", "fp8", "balanced"),
        _moe(folder, "fp8", "fp8", "power_law"),
        *(_nccl(folder, op) for op in ("all_reduce", "all_gather", "reduce_scatter", "alltoall")),
    ]
    return {f.name: f for f in families}
