"""Prefill chunks inside fast-forwarded runs (`chunk_run.py`): a replay whose prompts
are computed over several steps, fast-forwarded, equals the same replay step by step,
bit for bit (tables, summary, the per-step RequestTokens and FirstToken events) —
under a small token budget, several ranks with prefixes fetched across them, the
prefill_schedule_interval throttle, long_prefill_token_threshold, speculative decoding
and lockstep ranks; and those steps are really run steps now."""

import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine
from labkit.engine.events import FirstToken, RequestTokens
from labkit.engine.instance import Instance

CONFIGS = {
    "small budget": dict(model="tiny-llama", layout="tp1", max_num_batched_tokens=256),
    "dp3 round-robin, fetched prefixes, interval 3": dict(
        model="tiny-llama", layout="dp3", router="round_robin", max_num_batched_tokens=384,
        prefill_schedule_interval=3),
    "interval 2, tiny budget": dict(model="tiny-llama", layout="dp2", max_num_batched_tokens=128,
                                    prefill_schedule_interval=2),
    "threshold, spec decode": dict(model="tiny-llama", layout="tp1", num_speculative_tokens=2,
                                   acceptance_length=2.5, long_prefill_token_threshold=96,
                                   max_num_batched_tokens=512),
    "dep4 lockstep, interval 2": dict(model="tiny-qwen3-moe", layout="dep4",
                                      max_num_batched_tokens=256, prefill_schedule_interval=2),
    "sync scheduling, tight KV": dict(model="tiny-llama", layout="dp2", router="least_kv",
                                      async_scheduling=False, max_num_batched_tokens=200,
                                      num_gpu_blocks_override=1400),
}


def replay(ff: bool, cfg: dict, singles: list | None = None):
    engine = Engine(hardware="h100", block_size=16, sim_fast_forward=ff, **cfg)
    log = []

    def per_step(e):
        for j, step in enumerate(e.step_index.tolist()):
            log.append(("tokens", e.instance, step, tuple(e.request_ids), tuple(e.ranks.tolist()),
                        tuple(e.context[j].tolist()), tuple(e.num_new[j].tolist()),
                        tuple(e.decode[j].tolist()), tuple(e.held[j].tolist())))

    engine.events.subscribe(per_step, RequestTokens)
    engine.events.subscribe(lambda e: log.append(("first", e.t, e.request_id, e.rank)),
                            FirstToken)
    result = engine.replay(small_agentx(6, seed=3), concurrency=4, duration_s=60,
                           max_idle_s=2.0, start_part_way=True)
    return result, log


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunk_runs_are_exact(name):
    fast, fast_log = replay(True, CONFIGS[name])
    slow, slow_log = replay(False, CONFIGS[name])
    assert slow.summary["requests_completed"] > 10
    assert (slow.steps["prefill_tokens"] > 0).sum() > 20
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, slow.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert {k: v for k, v in fast.summary.items() if k not in drop} == \
        {k: v for k, v in slow.summary.items() if k not in drop}
    assert sorted(fast_log) == sorted(slow_log)


def test_prefill_continuations_are_run_steps(monkeypatch):
    """A step that continues a prompt (or takes in its landed prefix KV) while nobody
    waits was a single step; it is now part of a run."""
    single = Instance._plan_step
    counts = {}

    def counting(self, now, *rest):
        s = self.schedulers[0]
        if not len(s.waiting) and any(not r.is_decoding for r in s.running):
            counts[self.config.sim_fast_forward] += 1
        return single(self, now, *rest)

    monkeypatch.setattr(Instance, "_plan_step", counting)
    for ff in (True, False):
        counts[ff] = 0
        replay(ff, CONFIGS["small budget"])
    assert counts[False] > 50
    assert counts[True] < counts[False] / 5


def test_a_last_one_token_chunk_is_not_deferred_off_the_beat():
    """`Scheduler.schedule` defers, off the prefill_schedule_interval beat, only a
    request with more than one token to compute: a prompt's last single token runs
    in the next step, as a decode would (a run planned it deferred to the beat)."""
    from labkit.engine.chunk_run import _chunk_sizes

    # steps 1..5 with interval 3: 1 and 2 off the beat, 3 on it, 4 and 5 off
    sizes, before, last = _chunk_sizes(1, 5, 3, True, 382, 383)
    assert sizes.tolist() == [0, 0, 382, 1, 0] and last == 3
    assert before.tolist() == [0, 0, 0, 382, 383, 383]
    sizes, _, last = _chunk_sizes(1, 5, 3, True, 382, 766)  # two left: deferred
    assert sizes.tolist() == [0, 0, 382, 0, 0] and last == 5
    sizes, _, last = _chunk_sizes(1, 5, 3, False, 382, 383)  # nobody decodes: no throttle
    assert sizes.tolist() == [382, 1, 0, 0, 0] and last == 1


def test_the_token_kernels_fill_rows_as_the_array_formulas_do():
    """`_as_decodes`, `_prompt_row` and `_sit_out` (numba loops) against the array
    formulas they replace: decodes gain cum[j] up to their remaining tokens; a prompt's
    row sits out until `at`, runs its chunks, then decodes from a full prompt; a
    request that has left computes nothing."""
    import numpy as np

    from labkit.engine.chunk_run import _as_decodes, _chunk_sizes, _prompt_row, _sit_out

    rng = np.random.default_rng(0)
    for _ in range(200):
        n, k = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        cum = np.concatenate([[0], np.cumsum(rng.integers(0, 4, k))])
        computed, remaining = rng.integers(0, 500, n), rng.integers(1, 3 * k, n)
        held, new, prefill, done = _as_decodes(computed, remaining, cum, 3)
        assert (held == computed[:, None] + np.minimum(cum[None, :], remaining[:, None])).all()
        assert (new == 3).all() and not prefill.any() and new.shape == (n, k)
        assert (done == cum.searchsorted(remaining, side="left")).all()

        # one row as a prompt joining at `at`, the reference filled as before
        at = int(rng.integers(0, k))
        pending, c0, left_out = int(rng.integers(1, 300)), int(computed[0]), int(remaining[0])
        sizes, before, last = _chunk_sizes(int(rng.integers(0, 9)), k - at, 2, True,
                                           int(rng.integers(1, 100)), pending)
        h, w, p = held[0].copy(), new[0].copy(), prefill[0].copy()
        end = at + last
        w[:at] = 0
        h[at : end + 1] = c0 + before[: last + 1]
        w[at : end + 1] = sizes[: last + 1]
        p[at : end + 1] = sizes[: last + 1] > 0
        if end < k:
            left = cum[end + 1:] - cum[end + 1]
            h[end + 1:] = c0 + pending + np.minimum(left, left_out - 1)
            expected = end + 1 + int(np.searchsorted(left, left_out - 1, side="left"))
        else:
            expected = k + 1
        got = _prompt_row(held[0], new[0], prefill[0], cum, at, sizes, before, last, c0,
                          pending, left_out)
        assert got == expected
        assert (held[0] == h).all() and (new[0] == w).all() and (prefill[0] == p).all()

        leaving = rng.integers(0, k + 2, n)
        ref = new.copy()
        ref[np.arange(k)[None, :] >= leaving[:, None]] = 0
        assert (_sit_out(new[:, :k], leaving) == ref).all()
