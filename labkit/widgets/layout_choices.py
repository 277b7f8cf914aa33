"""Which layouts a model allows: the dashboard's *layout* and *degree* choices.

A reader picks a kind of parallelism and a degree; the dashboard turns that into a
layout string the model accepts. That is not always the obvious string: DCP shards
KV that TP *replicates*, and a GQA model replicates its KV heads only beyond
tp = kv_heads (Qwen3-30B-A3B has 4: DCP2 needs tp8), while an MLA model's single
latent is replicated on every TP rank (DeepSeek-V3: tp8xdcp8 is fine). And the weights
must fit: DeepSeek-V3 needs 8 H200s before any KV fits.

So each (kind, degree) has candidates, fewest GPUs first, and the first one that the
engine's own checks accept is the choice — the same checks an `Engine` runs before
anything else: the layout's structure (`Layout.parse`), what the model imposes
(`check_layout`, via `Placement`), sliding-window refusals, and that the weights
leave room for KV (`kv_capacity`). A (kind, degree) with no accepted candidate is not
offered. Each check is arithmetic: a full table for one model takes milliseconds.

    options("qwen3-30b-a3b", "h200")["DCP"]   # {2: 'tp8xdcp2', 4: 'tp16xdcp4', ...}
    choice_of("tp8xdcp2", table)               # ('DCP', 2)
"""

from __future__ import annotations

from labkit.engine.capacity import kv_capacity
from labkit.engine.kv.sliding_window import check_sliding_window
from labkit.errors import ConfigError
from labkit.specs import EngineConfig, Layout, get_hardware, get_model

KINDS = ("TP", "DCP", "PCP", "DEP", "DP")
DEGREES = (1, 2, 4, 8, 16)
MAX_GPUS = 64
_TP = (1, 2, 4, 8, 16, 32, 64)


def candidates(kind: str, degree: int, moe: bool) -> list[str]:
    """Layout strings that mean `degree`-way `kind`, fewest GPUs first.

    TP: tp{d}. DCP rides on a TP group at least d wide: tp{t}xdcp{d}. PCP keeps DCP
    shards (each PCP rank keeps 1/d of the KV) on t-wide TP groups and, for MoE
    models, spreads the experts over all its GPUs. DEP: dep{d}. DP: d replicas of
    t-wide TP groups."""
    if degree == 1:
        return ["tp1"] if kind == "TP" else []
    if kind == "TP":
        return [f"tp{degree}"]
    if kind == "DEP":
        return [f"dep{degree}"] if moe else []
    out = []
    for t in _TP:
        if kind == "DCP" and degree <= t <= MAX_GPUS:
            out.append(f"tp{t}xdcp{degree}")
        elif kind == "PCP" and t * degree <= MAX_GPUS:
            tp = f"tp{t}x" if t > 1 else ""
            out.append(f"{tp}pcp{degree}xdcp{degree}" + (f"xep{t * degree}" if moe else ""))
        elif kind == "DP" and t * degree <= MAX_GPUS:
            out.append(f"dp{degree}" + (f"xtp{t}" if t > 1 else ""))
    return out


def refusal(model, layout: str, hardware, config: EngineConfig) -> str | None:
    """Why an engine would refuse this deployment (None if it would accept it)."""
    model, hardware = get_model(model), get_hardware(hardware)
    try:
        lay = Layout.parse(layout)
        check_sliding_window(model, lay, config)
        kv_capacity(model, hardware, lay, config, config.block_size or model.block_size,
                    config.max_model_len or model.max_model_len)
    except ConfigError as err:
        return str(err)
    return None


def options(model, hardware, **knobs) -> dict[str, dict[int, str]]:
    """kind -> {degree: layout string} of every legal choice (kinds with none: {})."""
    config = EngineConfig.from_knobs(**knobs)
    moe = get_model(model).is_moe
    table: dict[str, dict[int, str]] = {}
    for kind in KINDS:
        table[kind] = {}
        for degree in DEGREES:
            for layout in candidates(kind, degree, moe):
                if refusal(model, layout, hardware, config) is None:
                    table[kind][degree] = layout
                    break
    return table


def choice_of(layout: str, table: dict[str, dict[int, str]]) -> tuple[str, int] | None:
    """The (kind, degree) whose choice is this layout (same degrees, however written),
    or None when the dropdowns cannot express it."""
    try:
        wanted = _degrees(layout)
    except ConfigError:
        return None
    for kind, by_degree in table.items():
        for degree, text in by_degree.items():
            if _degrees(text) == wanted:
                return kind, degree
    return None


def _degrees(layout: str) -> tuple:
    lay = Layout.parse(layout)
    return (lay.dp, lay.tp, lay.pp, lay.ep, lay.dcp, lay.pcp, lay.kvpp)
