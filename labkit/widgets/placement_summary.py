"""Per-GPU sums of a placement: how much KV each GPU keeps, and what share of a copy.

`placement()` rows say which positions, layers and heads a GPU holds; summed per GPU
they answer the capacity questions of `engine/layouts.py` from what actually ran:
the tokens each GPU keeps (exactly, with the DCP formula), the tokens it gathers while
a layer runs, and `kv_share` — the fraction of one full copy of its DP rank's KV (all
layers, all KV heads, every request) it keeps. Summed over a replica's GPUs, `kv_share`
is the number of copies of the KV the layout keeps (TP8 on MLA: 8; DCP8, DEP: 1),
which `Placement.kv_replication()` computes from the layout alone.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from labkit.engine.layouts import dcp_shard_tokens
from labkit.widgets.gpu_kv import kv_fraction


def held_tokens(frame: pd.DataFrame, kind: str = "persistent") -> dict[int, int]:
    """Positions of KV each GPU holds (rows of that kind), over all its requests;
    temporary rows of several layers (KVPP) count their positions once."""
    rows = frame[frame["kind"] == kind].drop_duplicates(["gpu", "request_id", "start", "end"])
    if rows.empty:
        return {}
    args = [rows[c].to_numpy(np.int64) for c in ("shards", "interleave", "shard")]
    counts = dcp_shard_tokens(rows["end"].to_numpy(np.int64), *args) - \
        dcp_shard_tokens(rows["start"].to_numpy(np.int64), *args)
    return pd.Series(counts, index=rows["gpu"]).groupby(level=0).sum().to_dict()


def per_gpu(frame: pd.DataFrame, gpus: list, model) -> pd.DataFrame:
    """One row per GPU (see the module docstring)."""
    out = pd.DataFrame({"gpu": [g.gpu for g in gpus], "dp_rank": [g.dp_rank for g in gpus],
                        "holds": [g.holds for g in gpus]})
    out["requests"] = out.gpu.map(frame.groupby("gpu").request_id.nunique())
    for kind in ("persistent", "temporary"):
        out[f"{kind}_tokens"] = out.gpu.map(held_tokens(frame, kind))
    out = out.fillna(0).astype({"requests": int, "persistent_tokens": int,
                                "temporary_tokens": int})
    persistent = frame[frame.kind == "persistent"]
    per_rank = persistent.groupby(["dp_rank", "request_id"]).end.max().groupby(level=0).sum()
    fraction = [kv_fraction(model, g.heads, g.layers) for g in gpus]
    tokens = out.dp_rank.map(per_rank).fillna(0).to_numpy()
    out["kv_share"] = np.divide(out.persistent_tokens.to_numpy() * fraction, tokens,
                                out=np.zeros(len(out)), where=tokens > 0)
    return out
