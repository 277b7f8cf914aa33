"""How wrong is the cost model on the H100 measurements it was fitted on?

`bench_costmodel(data_dir)` prices every calibration row with `CostModel("h100")` and
reports, per op family, the number of rows and the median and 90th-percentile absolute
percentage error |predicted / measured - 1|. It also runs a *held-out shapes* check,
the closest this data allows to "a GPU it was not fitted on": refit every constant
without a slice of each family that a deployment would meet on another setup, and
report the error on that slice only:

    gemm                n or k >= 10240 (the largest weight matrices)
    attention           head_dim != 128 (fit on 128-dim heads only)
    mla modules         128 heads per GPU (fit on 1..64, i.e. TP-sharded heads)
    moe                 hidden_size >= 6144 (the largest models)
    nccl                8 GPUs (fit on 2 and 4)

A lookup table fails that; physics that transfers passes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from labkit.costmodel.data import Family, load_families
from labkit.costmodel.model import CostModel
from labkit.costmodel.params import CALIBRATED, CostModelParams


def ape(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Absolute percentage error, in percent."""
    return np.abs(predicted / measured - 1.0) * 100.0


def family_errors(families: dict[str, Family], params: CostModelParams = CALIBRATED,
                  rows: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
    cm = CostModel("h100", params=params)
    out = []
    for name, fam in families.items():
        err = ape(fam.predict(cm), fam.measured)
        if rows is not None:
            err = err[rows[name]]
        out.append({"family": name, "points": int(err.size),
                    "median_ape_%": float(np.median(err)),
                    "p90_ape_%": float(np.percentile(err, 90))})
    return pd.DataFrame(out)


def bench_costmodel(data_dir: str | Path, held_out: bool = True,
                    show: bool = True) -> pd.DataFrame:
    """Per family: points, median and P90 APE on the H100 data (and, if `held_out`,
    the errors on held-out shapes of a fit without them). Prints a table; returns it."""
    families = load_families(data_dir)
    table = family_errors(families)
    if held_out:
        table = table.merge(_heldout_errors(families), on="family", how="left")
    if show:
        from labkit.costmodel.fit import fitted_constant_count

        print("labkit bench costmodel — H100 SXM calibration data, "
              f"{fitted_constant_count()} fitted constants in all")
        print(table.to_string(index=False, float_format=lambda x: f"{x:6.1f}"))
    return table


def _held_out(fam: Family) -> np.ndarray:
    """The slice of a family the held-out check refits without (see the docstring)."""
    f = fam.frame
    if fam.name.startswith("gemm"):
        held = (f["n"] >= 10240) | (f["k"] >= 10240)
    elif fam.name.startswith("attention"):
        held = f["head_dim"] != 128
    elif fam.name.startswith("mla"):
        held = f["num_heads"] == 128
    elif fam.name.startswith("moe"):
        held = f["hidden_size"] >= 6144
    else:
        held = f["num_gpus"] == 8
    return held.to_numpy()


def _heldout_errors(families: dict[str, Family]) -> pd.DataFrame:
    from labkit.costmodel.fit import INITIAL, STAGES, TIES, fit_stage, get, put

    held = {n: _held_out(f) for n, f in families.items()}
    kept = {n: Family(n, f.frame[~held[n]].reset_index(drop=True),
                      (lambda fam, mask: lambda cm: fam.predict(cm)[mask])(f, ~held[n]))
            for n, f in families.items()}
    params = INITIAL
    for names, ks in STAGES:
        for tied, source in TIES:
            params = put(params, tied, get(params, source))
        params = fit_stage(params, [kept[n] for n in names], ks)
    t = family_errors(families, params, rows=held)
    return t.rename(columns={"points": "held_out", "median_ape_%": "held_median_%",
                             "p90_ape_%": "held_p90_%"})
