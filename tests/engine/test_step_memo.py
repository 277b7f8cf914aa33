"""The step model's exact memo (`engine/sim/memo.py`) must change nothing: a replay with
`sim_step_cache` on equals the same replay with it off, bit for bit, and the memo keys
on exact inputs (dtype, shape and every value), never on something coarser."""

import numpy as np
import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine
from labkit.engine.sim.memo import ExactMemo, no_memo

CONFIGS = {
    "dp2 least-loaded": dict(model="tiny-llama", layout="dp2"),
    "dep4 lockstep, spec decode": dict(model="tiny-qwen3-moe", layout="dep4",
                                       num_speculative_tokens=2, acceptance_length=2.5),
    "sliding window": dict(model="tiny-gpt-oss", layout="tp1"),
    "pipeline": dict(model="tiny-llama", layout="tp2xpp2"),
    "mla dcp": dict(model="tiny-deepseek-v3", layout="dcp2"),
}


def replay(cache: bool, cfg: dict):
    engine = Engine(hardware="h100", block_size=16, sim_step_cache=cache, **cfg)
    result = engine.replay(small_agentx(4, seed=5), concurrency=3, duration_s=30,
                           max_idle_s=2.0, start_part_way=True)
    return engine, result


@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_cache_is_exact(name):
    engine, cached = replay(True, CONFIGS[name])
    _, plain = replay(False, CONFIGS[name])
    assert plain.summary["steps"] > 20
    assert engine.cost_model.memo.hits > 0  # the memo was really used
    pd.testing.assert_frame_equal(cached.requests, plain.requests, check_exact=True)
    pd.testing.assert_frame_equal(cached.steps, plain.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert {k: v for k, v in cached.summary.items() if k not in drop} == \
        {k: v for k, v in plain.summary.items() if k not in drop}


def test_memo_keys_on_exact_inputs():
    memo, calls = ExactMemo(), []

    def priced(x):
        calls.append(x)
        return x * 2.0

    a = np.array([[3]], dtype=np.int64)
    first = memo("f", priced, (a,))
    assert memo("f", priced, (a.copy(),)) is first  # same value: a hit
    for other in (np.array([[3.0]]), np.array([3]), np.array([[4]])):  # dtype, shape, value
        memo("f", priced, (other,))
    memo("g", priced, (a,))  # another piece of the step
    memo("f", lambda x, flag: priced(x), (a, True))  # another non-array argument
    assert (memo.hits, memo.misses, len(calls)) == (1, 6, 6)
    assert no_memo("f", priced, (a,)) == 6.0 and len(calls) == 7


def test_memo_is_bounded():
    memo = ExactMemo(max_entries=4)
    for i in range(10):
        assert memo("f", lambda i: i * i, (i,)) == i * i
    assert len(memo._store) <= 4
