"""Re-fit the cost model's constants on the H100 data and print them.

    python -m labkit.costmodel.fit [DATA_DIR]     # default: ../shared/data

Stages run in order, each fitting a few constants of one op family with everything
fitted before it held fixed (the MLA module reuses the GEMM and FA3 constants; only
its core, its overheads and FA3's efficiency on MLA's wider heads are fitted on the
module data). MoE constants come from balanced routing only; the power-law rows are
not fitted at all: the busiest rank's load comes from the routing distribution
(`routing.py`), so they check that derivation. Starting points are neutral guesses, not the
published values, and the procedure is deterministic, so the printed constants are the
ones in `params.CALIBRATED` (which stores them to 4 digits; a test checks they agree).

Ties, because the data cannot tell the constants apart:
- DeepGEMM (fp8_block) was timed standalone with ~80 us of host overhead that the
  same kernels do not show inside the MLA module measurements (which run them under
  CUDA graphs). Its kernel launch is taken equal to the CUTLASS fp8 one, and the rest of
  the constant term is `harness_s`, a property of the measurement that the serving
  model leaves out and the bench adds back. That floor also hides the memory-bound
  regime, so its HBM efficiency is cuBLAS's (bf16) and its activation quantization has
  no per-row cost (DeepGEMM quantizes in 1x128 groups with a vectorized kernel).
- The MLA core's launch latency is FA3 decode's; the module's other small kernels are
  the fitted `decode_overhead_s` / `prefill_overhead_s`.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import numpy as np

from labkit.costmodel.data import Family, load_families
from labkit.costmodel.lsq import fit_log_params
from labkit.costmodel.model import CostModel
from labkit.costmodel.params import (
    CommParams,
    CostModelParams,
    DecodeAttentionParams,
    GemmParams,
    MlaParams,
    MoeParams,
    PrefillAttentionParams,
)

# Neutral starting points: round numbers of the right order, not fitted values.
INITIAL = CostModelParams(
    gemm={d: GemmParams(launch_s=5e-6, compute_eff=0.7, memory_eff=0.8,
                        tile_overhead_k=32.0 if d == "bf16" else 0.0,
                        quant_row_s=1e-6 if d == "fp8" else 0.0,
                        harness_s=50e-6 if d == "fp8_block" else 0.0)
          for d in ("bf16", "fp8", "fp8_block")},
    decode_attention=DecodeAttentionParams(launch_s=10e-6, memory_eff=0.8, unit_s=3e-6,
                                           fp8_kv_factor=1.2),
    prefill_attention=PrefillAttentionParams(launch_s=10e-6, compute_eff=0.7, softmax_dims=30.0,
                                             memory_eff=0.8, unit_s=1e-6, fp8_kv_factor=1.1),
    mla=MlaParams(launch_s=10e-6, memory_eff=0.8, compute_eff=0.5, unit_s=3e-6,
                  fp8_kv_factor=1.2, prefill_compute_eff=0.7, decode_overhead_s=30e-6,
                  prefill_overhead_s=30e-6, token_bytes=1e4),
    moe={d: MoeParams(launch_s=30e-6, compute_eff=0.6, memory_eff=0.8, grid_s=1e-10)
         for d in ("bf16", "fp8", "fp8_block")},
    comm=CommParams(base_s=5e-6, hop_s=1e-6, ll_eff=0.3, bulk_base_s=20e-6,
                    bus_eff={op: 0.7 for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                "all_to_all")}),
)


@dataclass(frozen=True, slots=True)
class Knob:
    """One constant: `group` is a CostModelParams field, `key` a dict key within it."""

    group: str
    key: str | None
    field: str


def get(params: CostModelParams, knob: Knob) -> float:
    obj = getattr(params, knob.group)
    obj = obj[knob.key] if knob.key is not None and knob.group != "comm" else obj
    if knob.group == "comm" and knob.key is not None:
        return obj.bus_eff[knob.key]
    return getattr(obj, knob.field)


def put(params: CostModelParams, knob: Knob, value: float) -> CostModelParams:
    obj = getattr(params, knob.group)
    if knob.group == "comm" and knob.key is not None:
        new = dataclasses.replace(obj, bus_eff={**obj.bus_eff, knob.key: float(value)})
    elif knob.key is not None:
        new = {**obj, knob.key: dataclasses.replace(obj[knob.key], **{knob.field: float(value)})}
    else:
        new = dataclasses.replace(obj, **{knob.field: float(value)})
    return dataclasses.replace(params, **{knob.group: new})


def knobs(group: str, key: str | None, *fields: str) -> list[Knob]:
    return [Knob(group, key, f) for f in fields]


# (families fitted together, constants fitted) in order.
STAGES: list[tuple[list[str], list[Knob]]] = [
    (["gemm bf16"], knobs("gemm", "bf16", "launch_s", "compute_eff", "memory_eff",
                          "tile_overhead_k")),
    (["gemm fp8"], knobs("gemm", "fp8", "launch_s", "compute_eff", "memory_eff",
                         "quant_row_s")),
    (["gemm fp8_block"], knobs("gemm", "fp8_block", "harness_s", "compute_eff")),
    (["attention decode"], knobs("decode_attention", None, "launch_s", "memory_eff", "unit_s",
                                 "fp8_kv_factor")),
    (["attention prefill"], knobs("prefill_attention", None, "launch_s", "compute_eff",
                                  "softmax_dims", "memory_eff", "unit_s", "fp8_kv_factor")),
    (["mla decode module", "mla prefill module"],
     knobs("mla", None, "memory_eff", "compute_eff", "unit_s", "fp8_kv_factor",
           "prefill_compute_eff", "decode_overhead_s", "prefill_overhead_s", "token_bytes")),
    (["moe bf16 balanced"], knobs("moe", "bf16", "launch_s", "compute_eff", "memory_eff",
                                  "grid_s")),
    (["moe fp8_block balanced"], knobs("moe", "fp8_block", "launch_s", "compute_eff",
                                       "memory_eff", "grid_s")),
    (["moe fp8 balanced"], knobs("moe", "fp8", "launch_s", "compute_eff", "memory_eff",
                                 "grid_s")),
    (["nccl all_reduce", "nccl all_gather", "nccl reduce_scatter", "nccl all_to_all"],
     [*knobs("comm", None, "base_s", "hop_s", "ll_eff", "bulk_base_s"),
      *(Knob("comm", op, "bus_eff") for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                 "all_to_all"))]),
]

# Constants the data cannot separate, copied from the one they are tied to (see above).
TIES = [(Knob("gemm", "fp8_block", "launch_s"), Knob("gemm", "fp8", "launch_s")),
        (Knob("gemm", "fp8_block", "memory_eff"), Knob("gemm", "bf16", "memory_eff")),
        (Knob("mla", None, "launch_s"), Knob("decode_attention", None, "launch_s"))]


def _apply(params: CostModelParams, ks: list[Knob], values) -> CostModelParams:
    for k, v in zip(ks, values):
        params = put(params, k, v)
    return params


def fit_stage(params: CostModelParams, families: list[Family], ks: list[Knob]) -> CostModelParams:
    measured = np.log(np.concatenate([f.measured for f in families]))

    def residuals(values: np.ndarray) -> np.ndarray:
        cm = CostModel("h100", params=_apply(params, ks, values))
        return np.log(np.concatenate([f.predict(cm) for f in families])) - measured

    # efficiencies are fractions of a peak: bounded by 1, except a collective's bus
    # efficiency, which NVLink SHARP (in-switch reduction) can take past the link rate
    upper = [1.0 if k.field.endswith("_eff") else np.inf for k in ks]
    values = fit_log_params(residuals, np.array([get(params, k) for k in ks]), np.array(upper))
    return _apply(params, ks, values)


def fit_all(data_dir, verbose: bool = False) -> CostModelParams:
    families = load_families(data_dir)
    params = INITIAL
    for names, ks in STAGES:
        for tied, source in TIES:
            params = put(params, tied, get(params, source))
        params = fit_stage(params, [families[n] for n in names], ks)
        if verbose:
            print(f"  fitted {', '.join(names)}", file=sys.stderr)
    return params


def fitted_constant_count() -> int:
    """How many constants the fit chooses (tied copies and fixed zeros not counted)."""
    return sum(len(ks) for _, ks in STAGES)


def format_params(p: CostModelParams) -> str:
    """The constants as Python source, 4 significant digits (what params.py stores)."""
    def call(o, indent: int) -> str:
        parts = []
        for f in dataclasses.fields(o):
            v = getattr(o, f.name)
            if isinstance(v, dict):
                inner = ", ".join(f"{k!r}: {x:.4g}" for k, x in v.items())
                parts.append(f"{f.name}={{{inner}}}")
            else:
                parts.append(f"{f.name}={v:.4g}")
        lines, line = [], f"{type(o).__name__}("
        for part in parts:
            if len(line) + len(part) + 2 > 95 - indent:
                lines.append(line.rstrip())
                line = " " * (indent + 4)
            line += part + ", "
        lines.append(line.rstrip(", ") + ")")
        return "\n".join(lines)
    out = ["CostModelParams(", "    gemm={"]
    out += [f"        {k!r}: {call(v, 8)}," for k, v in p.gemm.items()]
    out += ["    },", f"    decode_attention={call(p.decode_attention, 4)},",
            f"    prefill_attention={call(p.prefill_attention, 4)},",
            f"    mla={call(p.mla, 4)},", "    moe={"]
    out += [f"        {k!r}: {call(v, 8)}," for k, v in p.moe.items()]
    out += ["    },", f"    comm={call(p.comm, 4)},", ")"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from labkit.bench import shared_data_dir

    argv = sys.argv[1:] if argv is None else argv
    data_dir = argv[0] if argv else shared_data_dir()
    if data_dir is None:
        print("no calibration data: pass DATA_DIR or put ../shared/data next to the repo",
              file=sys.stderr)
        return 2
    try:
        params = fit_all(data_dir, verbose=True)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    print(format_params(params))
    print(f"# {fitted_constant_count()} fitted constants", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
