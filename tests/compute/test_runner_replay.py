"""A multi-turn agentic replay gives the same tokens on every layout.

A miniature AgentX workload (sessions whose calls re-send their growing context,
subagents forked from a main agent's context, tool results; `compute_cases.SHORT`, the
shorter one: ~40 % fewer steps on every layout) replays on a KV pool
small enough that requests get preempted and recomputed, with speculative decoding
and prefix caching (for the hybrid model: linear-attention state snapshots, restored
on a hit).
The single-device run must generate exactly what greedy decoding of each call's
prompt gives (checked by one whole-sequence recomputation per call: teacher-forced
on its own output, every next token is the argmax), and every layout must generate
the same tokens as the single device.
"""

from __future__ import annotations

import pytest
from compute_cases import assert_greedy, outputs, replay_agentic

from labkit.specs import get_model

LAYOUTS = [  # one of each kind of layout, spread over the families
    ("tiny-llama", "tp2"), ("tiny-llama", "pcp2"), ("tiny-llama", "tp2xpp2"),
    ("tiny-llama", "dp2"), ("tiny-qwen3-moe", "tp2xep2"), ("tiny-qwen3-moe", "dep2"),
    ("tiny-deepseek-v3", "tp2xpcp2xdcp2"), ("tiny-deepseek-v3", "dep4"),
    ("tiny-deepseek-v3.2", "dcp2"), ("tiny-kimi-linear", "pcp2xdcp2"),
]
_single: dict = {}


def single_device(model: str):
    if model not in _single:
        _single[model] = replay_agentic(model, "tp1", short=True, num_speculative_tokens=2)
    return _single[model]


@pytest.mark.parametrize("model", sorted({m for m, _ in LAYOUTS}))
def test_single_device_replay_is_greedy(model):
    eng, counts = single_device(model)
    assert assert_greedy(model, eng) >= 30
    assert counts["preemptions"] > 0
    assert sum(r.num_cached_tokens for r in eng.requests.values()) > 0
    if not get_model(model).linear_layers:
        assert counts["forks"] > 0  # subagents adopted their parent's blocks
    else:  # prefix hits restored a snapshotted state, saved at call ends and forks
        summary = eng.extra_summary()
        assert summary["linear_state_hits"] > 0
        assert summary["linear_state_saved_on_second_sight"] > 0


@pytest.mark.parametrize("model,layout", LAYOUTS)
def test_layout_replay_gives_the_same_tokens(model, layout):
    base, _ = single_device(model)
    eng, counts = replay_agentic(model, layout, short=True, num_speculative_tokens=2)
    assert outputs(eng) == outputs(base)
    if eng.layout.dp == 1:  # one KV pool, scheduled as the single device's: it preempts
        assert counts["preemptions"] > 0
