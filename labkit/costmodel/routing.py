"""How a MoE layer's tokens spread over expert-parallel ranks, and what the busiest carries.

Under expert parallelism every rank waits for the slowest at the combine all-to-all, so
a MoE layer takes as long as its *busiest* rank. How busy that rank is depends on the
router: balanced routing gives each rank T·topk/ep rows; real routers favour some
experts. This module turns a routing distribution into the busiest rank's load, as a
factor over the balanced share.

**The distribution** is the one the calibration data was measured with (aiconfigurator's
MoE collector, `distribution` = power_law_1.01 / power_law_1.2 in moe.parquet): each
expert's token count is drawn from a bounded power law p(x) ∝ x^-alpha on [1, 0.8·T]
(on [0.01, 2] when T·topk <= E, i.e. fewer rows than experts) and the draws are scaled
to sum to T·topk. The collector then measures the rank holding the heaviest contiguous
group of E/ep experts. `busiest_factor` reproduces that: E[max over ranks of the rank's
rows] / (T·topk/ep), by Monte Carlo over `layers` independent draws (seeded).

**Popularity is persistent.** Each layer keeps its draw of uniforms: the same experts are
hot at every load level (the bounds follow T, the ranking does not). That is what makes
**EPLB** meaningful (vLLM `enable_eplb`, `num_redundant_experts`): it sees a layer's
expert loads, gives `num_redundant_experts` extra replicas to the experts with the
highest load per replica, and packs the E + R physical experts onto the ep ranks, equal
slots per rank, heaviest first onto the lightest rank that has a free slot (DeepSeek's
EPLB as vLLM's default policy runs it, global variant); a replicated expert's tokens
split evenly over its replicas. The placement is the ideal one for the load level at
hand (vLLM rebalances every few thousand steps from a window of recent loads).

Tokens then pick experts: in a step, an expert's count scatters around its expected
load (Poisson-like, sqrt(load)), which no placement can balance — so EPLB helps most
where batches are large, little for a handful of decode tokens.

A step's MoE time sums its layers' busiest ranks, so the step sees the *mean over
layers* of the per-layer factor: with tens of MoE layers that mean varies little from
step to step, and the simulator uses it as is (deterministic; fast-forwarded decode
runs price every step with the same formula). The factor is tabulated on a grid of T
(half octaves) and interpolated in log T.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from labkit.errors import ConfigError, unknown_choice
from labkit.specs.config import MOE_ROUTINGS as ROUTINGS
LOG2_GRID_T = np.arange(0, 41) / 2.0
GRID_T = 2.0 ** LOG2_GRID_T  # 1 .. 2^20 tokens, half octaves
CALIBRATION_LAYERS = 64  # draws behind the calibration data's expectation


def routing_alpha(routing: str) -> float | None:
    """The power-law exponent of a routing name, None for balanced."""
    if routing not in ROUTINGS:
        raise unknown_choice("MoE routing", routing, ROUTINGS)
    return None if routing == "balanced" else float(routing.split("_")[-1])


def expert_loads(u: np.ndarray, tokens: float, topk: int, alpha: float) -> np.ndarray:
    """Rows per expert (last axis) for `tokens` tokens, from uniforms `u` in [0, 1):
    inverse CDF of the bounded power law, scaled to sum to tokens·topk."""
    num_experts = u.shape[-1]
    lo, hi = (1.0, 0.8 * tokens) if tokens * topk > num_experts else (0.01, 2.0)
    hi = max(hi, lo * (1 + 1e-9))
    a1 = 1.0 - alpha
    x = ((hi ** a1 - lo ** a1) * u + lo ** a1) ** (1.0 / a1)
    return x / x.sum(axis=-1, keepdims=True) * (tokens * topk)


def replicate(load: np.ndarray, num_physical: int) -> np.ndarray:
    """Replicas per expert (rows of `load` are independent layers): each extra slot goes
    to the expert with the highest load per replica, ties to the lowest index."""
    count = np.ones_like(load, dtype=np.int64)
    rows = np.arange(load.shape[0])
    for _ in range(num_physical - load.shape[1]):
        count[rows, np.argmax(load / count, axis=1)] += 1
    return count


def pack(weights: np.ndarray, num_ranks: int) -> np.ndarray:
    """Rank of every item (last axis) after balanced packing: heaviest first, each onto
    the lightest rank that still has a free slot; every rank gets the same number."""
    n_rows, n_items = weights.shape
    slots = n_items // num_ranks
    order = np.argsort(-weights, axis=1, kind="stable")
    loads = np.zeros((n_rows, num_ranks))
    filled = np.zeros((n_rows, num_ranks), dtype=np.int64)
    rank_of = np.empty((n_rows, n_items), dtype=np.int64)
    rows = np.arange(n_rows)
    for j in range(n_items):
        item = order[:, j]
        rank = np.argmin(np.where(filled < slots, loads, np.inf), axis=1)
        rank_of[rows, item] = rank
        loads[rows, rank] += weights[rows, item]
        filled[rows, rank] += 1
    return rank_of


def eplb_placement(expected: np.ndarray, ep: int, num_redundant: int):
    """EPLB's placement for each row (layer) of expected expert loads: (replicas per
    expert, logical expert of each physical slot, rank of each physical slot)."""
    n, num_experts = expected.shape
    count = replicate(expected, num_experts + num_redundant)
    phy2log = np.repeat(np.tile(np.arange(num_experts), n), count.reshape(-1)).reshape(n, -1)
    per_replica = np.take_along_axis(expected / count, phy2log, axis=1)
    return count, phy2log, pack(per_replica, ep)


def rank_loads(load: np.ndarray, ep: int, num_redundant: int = 0,
               expected: np.ndarray | None = None) -> np.ndarray:
    """Rows per EP rank (rows of `load`: layers). Without redundant experts a rank holds
    a contiguous group of about E/ep experts; with them, EPLB places replicas by the
    `expected` loads (default: `load` itself) and each replica gets an even share of
    its expert's actual rows."""
    n, num_experts = load.shape
    if num_redundant == 0:  # expert i on rank floor(i * ep / E): equal groups when E | ep
        group = np.arange(num_experts) * ep // num_experts
        out = np.zeros((n, ep))
        np.add.at(out, (slice(None), group), load)
        return out
    count, phy2log, rank_of = eplb_placement(load if expected is None else expected, ep,
                                             num_redundant)
    share = np.take_along_axis(load / count, phy2log, axis=1)
    out = np.zeros((n, ep))
    np.add.at(out, (np.arange(n)[:, None], rank_of), share)
    return out


def check_eplb(num_experts: int, ep: int, num_redundant: int) -> None:
    if num_redundant < 0:
        raise ConfigError(f"num_redundant_experts={num_redundant} must be >= 0")
    if (num_experts + num_redundant) % ep:
        raise ConfigError(
            f"num_redundant_experts={num_redundant}: {num_experts} experts + redundant "
            f"ones must split evenly over ep{ep} ranks (vLLM requires the same)")


@lru_cache(maxsize=64)
def _factor_table(num_experts: int, topk: int, ep: int, alpha: float, num_redundant: int,
                  layers: int, seed: int, sampled: bool) -> np.ndarray:
    rng = np.random.default_rng([seed, num_experts, topk, ep])
    u = rng.random((layers, num_experts))
    z = rng.standard_normal((layers, num_experts))
    # every grid point's layers in one batch of rows: (len(GRID_T) * layers, E)
    expected = np.concatenate([expert_loads(u, t, topk, alpha) for t in GRID_T])
    load = expected
    if sampled:  # tokens pick experts: counts scatter around the expected loads
        total = expected.sum(axis=1, keepdims=True)
        load = np.maximum(expected + np.sqrt(expected) * np.tile(z, (len(GRID_T), 1)), 0.0)
        load = load / load.sum(axis=1, keepdims=True) * total
    busiest = rank_loads(load, ep, num_redundant, expected).max(axis=1)
    factors = busiest.reshape(len(GRID_T), layers).mean(axis=1) / (GRID_T * topk / ep)
    factors.setflags(write=False)
    return factors


def factor_curve(num_experts: int, topk: int, ep: int, routing: str, num_redundant: int = 0,
                 layers: int = CALIBRATION_LAYERS, seed: int = 0,
                 sampled: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """(log2 tokens, factor) points `busiest_factor` interpolates; None when the factor
    is 1 everywhere (balanced routing, ep = 1)."""
    alpha = routing_alpha(routing)
    if alpha is None or ep <= 1:
        return None
    if num_redundant:
        check_eplb(num_experts, ep, num_redundant)
    return LOG2_GRID_T, _factor_table(int(num_experts), int(topk), int(ep), alpha,
                                      int(num_redundant), int(layers), int(seed), bool(sampled))


def busiest_factor(tokens, num_experts: int, topk: int, ep: int, routing: str,
                   num_redundant: int = 0, layers: int = CALIBRATION_LAYERS,
                   seed: int = 0, sampled: bool = False) -> np.ndarray:
    """E[busiest EP rank's rows] / (tokens·topk/ep) for `tokens` routed tokens (any
    shape), averaged over `layers` seeded layers; 1 for balanced routing or ep = 1.
    `sampled`: a step's actual counts scatter around the layer's expected loads (the
    engine); without it, rows follow the expected loads exactly (the calibration
    collector's synthetic routing)."""
    tokens = np.asarray(tokens, dtype=float)
    curve = factor_curve(num_experts, topk, ep, routing, num_redundant, layers, seed, sampled)
    if curve is None:
        return np.ones_like(tokens)
    return np.interp(np.log2(np.maximum(tokens, 1.0)), *curve)
