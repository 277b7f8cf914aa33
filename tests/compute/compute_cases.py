"""Shared scenarios of the compute-plane tests: engines, requests, a tiny agentic trace."""

from __future__ import annotations

import numpy as np
import torch

from labkit.engine.compute.models import init_weights, reference_logits
from labkit.engine.engine import Engine
from labkit.engine.events import CopyOnWrite, Forked, RequestPreempted
from labkit.specs import get_model
from labkit.traces import TINY_AGENTX, generate_agentx_trace

from support import FixedStepCost  # noqa: F401 (test_pd_compute imports it from here)

REL_TOL = 1e-5  # the bar: logits within 1e-5 relative error in float32


def compute_engine(model: str, layout: str, **knobs) -> Engine:
    knobs.setdefault("cost_model", FixedStepCost())
    eng = Engine(model=model, layout=layout, backend="compute", clock="predicted", **knobs)
    eng.data_plane.record_logits = True
    return eng


def count_events(eng: Engine) -> dict:
    counts = {"forks": 0, "copies": 0, "preemptions": 0}
    for kind, key in ((Forked, "forks"), (CopyOnWrite, "copies"),
                      (RequestPreempted, "preemptions")):
        eng.events.subscribe(lambda e, k=key: counts.__setitem__(k, counts[k] + 1), kind)
    return counts


def submit_prompts(eng: Engine, prompts: dict[str, list[int]], max_tokens: int,
                   gap_s: float = 0.05) -> None:
    for i, (rid, tokens) in enumerate(prompts.items()):
        eng.submit_prompt(tokens, max_tokens, request_id=rid, at=i * gap_s)


def shared_prefix_prompts(vocab: int, seed: int = 0, prefix: int = 40,
                          lengths=(30, 9, 53)) -> dict[str, list[int]]:
    """Prompts that share a prefix (the later ones hit the prefix cache)."""
    rng = np.random.default_rng(seed)
    common = rng.integers(4, vocab, prefix).tolist()
    return {f"q{i}": common + rng.integers(4, vocab, n).tolist() for i, n in enumerate(lengths)}


def run_to_end(eng: Engine) -> Engine:
    while eng.step():
        pass
    return eng


# A shorter agentic trace (`agentic_trace(**SHORT)`, on `SHORT_POOL` blocks): outputs and
# contexts cut by ~40 %, the pool cut to match, so its ~39 calls take ~40 % fewer steps
# (tiny-llama tp1, speculative decoding: 471 against 742) and still preempt (3 times), fork
# subagents (7), copy on write (4) and hit the prefix cache; a hybrid model still restores
# snapshotted states (5 hits, 4 saved on second sight).
SHORT = dict(output_median=24.0, output_max=48, context_window_tokens=320,
             compact_threshold_tokens=220)
SHORT_POOL = 24


def agentic_trace(sessions: int = 4, **shape):
    """`sessions` sessions with subagent forks; long outputs so a small pool preempts.
    `shape` overrides the sizes (`SHORT`)."""
    knobs = dict(TINY_AGENTX, output_median=40.0, output_max=80, context_window_tokens=400,
                 compact_threshold_tokens=280)
    knobs.update(shape)
    return generate_agentx_trace(sessions, seed=3, block_size=16, **knobs)


def replay_agentic(model: str, layout: str, setup=None, sessions: int = 4, short: bool = False,
                   **knobs) -> tuple[Engine, dict]:
    """The agentic trace on a small pool (`short`: the shorter one on its pool);
    `setup(engine)` runs before the replay."""
    knobs.setdefault("num_gpu_blocks_override", SHORT_POOL if short else 30)
    eng = compute_engine(model, layout, **knobs)
    counts = count_events(eng)
    if setup is not None:
        setup(eng)
    eng.replay(agentic_trace(sessions, **(SHORT if short else {})), concurrency=4,
               loop_trace=False, max_idle_s=1.0, start_part_way=False)
    return eng, counts


def assert_greedy(model: str, eng: Engine) -> int:
    """Each finished request generated what greedy decoding of its prompt gives: one
    whole-sequence recomputation per request, teacher-forced on its own output, has
    every next token as its argmax. Returns how many requests were checked."""
    spec = get_model(model)
    weights = init_weights(spec, eng.config.seed)
    checked = 0
    for r in eng.requests.values():
        if r.finish_s is None:
            continue
        stream = r.token_ids
        best = reference_logits(spec, weights, torch.tensor(stream[:-1])).argmax(-1)
        n = r.num_prompt_tokens
        assert best[n - 1:].tolist() == r.output_token_ids, r.request_id
        checked += 1
    return checked


def outputs(eng: Engine) -> dict[str, list[int]]:
    return {rid: list(r.output_token_ids) for rid, r in eng.requests.items()
            if r.finish_s is not None}


def logits_by_row(eng: Engine) -> dict[tuple[str, int, int], torch.Tensor]:
    """Recorded logits keyed by (request, position, occurrence): a position is seen
    again when a request is recomputed after preemption or re-verifies a draft."""
    out, seen = {}, {}
    for rid, positions, logits in eng.data_plane.logits:
        for p, row in zip(positions.tolist(), logits):
            k = seen.get((rid, p), 0)
            seen[(rid, p)] = k + 1
            out[(rid, p, k)] = row
    return out


def max_rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def reference_rows(model: str, eng: Engine) -> dict[tuple[str, int], torch.Tensor]:
    """Whole-sequence recomputation of each finished request's final stream."""
    spec = get_model(model)
    weights = init_weights(spec, eng.config.seed)
    out = {}
    for rid, r in eng.requests.items():
        if r.finish_s is None:
            continue
        stream = r.token_ids
        logits = reference_logits(spec, weights, torch.tensor(stream[:-1]))
        for p in range(len(stream) - 1):
            out[(rid, p)] = logits[p]
    return out
