"""Test helpers shared by several folders: small traces, where reference data lives."""

import heapq
from pathlib import Path

import numpy as np
import pandas as pd

from labkit.engine.kv.block_pool import NO_KEY

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = next((p for p in (REPO.parent / "shared" / "data", Path("/work/shared/data"))
                    if p.is_dir()), REPO.parent / "shared" / "data")
MOONCAKE = SHARED_DATA / "traces" / "mooncake_synthetic_trace.jsonl"

# AgentX-shaped sessions scaled down so a replay takes milliseconds.
SMALL_AGENTX = dict(
    shared_prefix_tokens=512, initial_context_median=600, initial_context_max=4000,
    output_median=40, output_max=400, tool_result_median=120, tool_result_max=3000,
    file_read_median=1500, main_calls_median=10, subagent_task_median=100,
    subagent_calls_median=3, summary_median=200, restored_context_median=800,
    compact_threshold_tokens=20_000, context_window_tokens=40_000,
)


def small_agentx(sessions: int = 6, seed: int = 0, block_size: int = 16):
    from labkit import generate_agentx_trace

    return generate_agentx_trace(sessions, seed=seed, block_size=block_size, **SMALL_AGENTX)


class FixedStepCost:
    """Every step takes the same time (10 ms), whatever the layout: runs of different
    layouts of one DP rank then schedule identically (same batches, same preemptions),
    and a fuzzed run costs only the control plane's work."""

    min_step_s = 0.01

    def step_timing(self, work, lockstep):
        import numpy as np

        from labkit.engine.step_work import StepTiming

        steps, ranks = work.idle.shape
        busy = np.full((steps, ranks), self.min_step_s)
        zero = np.zeros((steps, ranks))
        return StepTiming(busy, busy.copy(), zero, np.full(steps, self.min_step_s), zero)


# ------------------------------------------------------------- a JupyterLab server
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc, url: str, token: str, log: Path, name: str) -> None:
    """Wait (up to 2 min) until the Jupyter server `proc` answers at `url`; a server
    that exits or never answers fails the test with the end of its log."""
    import time
    import urllib.request

    import pytest

    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
    proc.terminate()
    pytest.fail(f"{name} did not start:\n{log.read_text()[-3000:]}")


# ---- fast-forwarded replays against step by step (tests/engine)
def kv_state(engine, t: float) -> list:
    """Every rank's blocks as step-by-step simulation has them at t (a run under way is
    played up to t): the blocks in use or cached with their references, keys,
    generations and pending marks, the next blocks to be evicted, the block tables."""
    for instance in engine.instances:
        instance.sync(t, cut=False)
    state = []
    for s in engine.schedulers:
        pool = s.kv.pool
        held = np.nonzero((pool.ref_count > 0) | (pool.block_key != NO_KEY))[0]
        state.append([held, pool.ref_count[held], pool.block_key[held],
                      pool.generation[held], pool.pending[held],
                      pool.next_to_evict(min(pool.num_free, 5000))])
        state[-1] += [(rid, table.view(), table.num_keyed, table.num_written)
                      for rid, table in sorted(s.kv.tables.items())]
    return state


def assert_same_kv(a: list, b: list, t: float) -> None:
    """Two `kv_state`s at t are equal."""
    assert len(a) == len(b)
    for rank_a, rank_b in zip(a, b):
        assert len(rank_a) == len(rank_b), t
        for x, y in zip(rank_a, rank_b):
            if isinstance(x, tuple):  # a block table
                assert x[0] == y[0] and np.array_equal(x[1], y[1]) and x[2:] == y[2:], t
            else:
                assert np.array_equal(x, y), t


def assert_same_replay(a, b) -> None:
    """Two replays' requests, steps and summaries are equal, bit for bit."""
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.steps, b.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert a.summary.keys() == b.summary.keys()
    for key in a.summary.keys() - drop:  # (NaN: a figure with no samples, in both)
        x, y = a.summary[key], b.summary[key]
        assert x == y or (x != x and y != y), key


def step_middles(run, step: int) -> list:
    """The middle of a fast-forwarded run's step before `step` and of `step`: times to
    look at the KV (`assert_kv_as_step_by_step`) around something that happens there."""
    return ((run.start[step - 1 : step + 1] + run.ends[step - 1 : step + 1]) / 2).tolist()


def assert_kv_as_step_by_step(cfg: dict, trace, looks: list, **options) -> int:
    """Replay `trace` fast-forwarded and step by step side by side: at every time in
    `looks` (a heap; hooks may push more while it runs) each rank's KV must be the same
    (`kv_state`), and so must the results. Returns how many times it looked."""
    from labkit import Engine

    engines = [Engine(sim_fast_forward=ff, **cfg) for ff in (True, False)]
    runs = [engine.start_replay(trace, **options) for engine in engines]
    heapq.heapify(looks)
    seen = 0
    while looks:
        t = float(heapq.heappop(looks))
        states = []
        for engine in engines:
            while engine.next_event_time() < t:  # (`run_until` would end runs at t)
                engine.process_event()
            states.append(kv_state(engine, t))
        assert_same_kv(*states, t)
        seen += 1
    assert_same_replay(*(run.finish() for run in runs))
    return seen
