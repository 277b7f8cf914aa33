"""P/D disaggregation on the compute plane: KV computed under one layout, decoded
under another, gives the tokens of a co-located run."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from compute_cases import (
    SHORT, FixedStepCost, agentic_trace, compute_engine, outputs, shared_prefix_prompts,
    submit_prompts)

from labkit.engine.disagg import PDEngine
from labkit.errors import ConfigError


def pd_replay(model: str, prefill: str, decode: str, sessions: int = 4,
              **knobs) -> PDEngine:
    """The shorter agentic trace (`SHORT`: ~40 % fewer steps than the full one) through
    a P/D pair of 60-block groups."""
    engine = PDEngine(model, prefill, decode, backend="compute", cost_model=FixedStepCost(),
                      clock="predicted", num_gpu_blocks_override=60, **knobs)
    engine.replay(agentic_trace(sessions, **SHORT), concurrency=4, loop_trace=False,
                  max_idle_s=1.0, start_part_way=False)
    return engine


_colocated: dict = {}


def colocated_outputs(model: str) -> dict:
    """What one GPU (a 60-block pool) generates for `pd_replay`'s trace: one replay per
    model, shared by the tests below."""
    if model not in _colocated:
        eng = compute_engine(model, "tp1", num_gpu_blocks_override=60)
        eng.replay(agentic_trace(**SHORT), concurrency=4, loop_trace=False, max_idle_s=1.0,
                   start_part_way=False)
        _colocated[model] = outputs(eng)
    return _colocated[model]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_pcp_dcp_prefill_then_dp_decode_gives_the_colocated_tokens(model):
    pd_engine = pd_replay(model, "pcp2xdcp2", "dp2")
    got, want = outputs(pd_engine), colocated_outputs(model)
    assert len(got) == len(want) >= 10
    assert got == want
    moved = pd_engine.transfers
    assert len(moved) == len(got)
    # prefix reuse survives the conversion: later calls of a session send only what
    # the decode group does not already cache
    assert sum(t["decode_cached_tokens"] > 0 for t in moved) >= len(moved) // 3
    requests = pd_engine.requests.values()
    assert sum(r.num_transferred_tokens for r in requests) < \
        sum(r.num_prompt_tokens for r in requests)


def test_two_prefill_groups_and_tp_decode():
    engine = pd_replay("tiny-llama", "pcp2", "tp2", num_prefill=2)
    got = outputs(engine)
    assert len(got) >= 10 and got == colocated_outputs("tiny-llama")


@pytest.mark.parametrize("prefill, decode", [("tp2", "dp2"), ("pcp2", "tp2")])
def test_a_hybrid_models_state_crosses_with_its_kv(prefill, decode):
    """Kimi-Linear: the prompt's linear-attention state crosses whole (joined from the
    prefill's TP ranks, cut again for the decode's) and decoding continues exactly."""
    engine = pd_replay("tiny-kimi-linear", prefill, decode)
    got = outputs(engine)
    assert len(got) >= 10 and got == colocated_outputs("tiny-kimi-linear")
    # nothing of a handed-over call stays behind on the prefill side
    assert all(len(r.linear) == 0 for e in engine.prefill for r in e.data_plane.ranks)


def test_a_sliding_window_models_window_crosses_with_its_kv():
    """gpt-oss: the full layers' KV crosses as usual, the sliding layer's only for the
    window the decode side still reads (its other pages were never allocated there)."""
    engine = pd_replay("tiny-gpt-oss", "tp2", "dp2")
    got = outputs(engine)
    assert len(got) >= 10 and got == colocated_outputs("tiny-gpt-oss")
    decode = engine.decode[0]
    assert sum(s.kv.window.pages_slid for s in decode.schedulers) > 0


def pd_small(model: str, prefill: str, decode: str, **knobs) -> PDEngine:
    engine = pd_replay(model, prefill, decode, sessions=2, **knobs)
    for e in (*engine.prefill, *engine.decode):
        e.data_plane.close()
    return engine


@pytest.mark.parametrize("model, prefill, decode", [
    ("tiny-llama", "tp1", "tp2"),  # the ImportKV's bytes cross into GPU 1's process
    ("tiny-kimi-linear", "tp2", "tp1"),  # GPU 1's KV and state heads come back in a report
])
def test_pd_with_ranks_as_processes_gives_the_threads_tokens(model, prefill, decode):
    """executor='mp': the hand-over's export and import run on the ranks where they
    live (rank operations through the executor), so a worker process's share of the KV
    travels in the KVExported report or the ImportKV command; the tokens are those of
    threads, and no worker outlives the planes."""
    threads = pd_small(model, prefill, decode)
    procs = pd_small(model, prefill, decode, executor="mp")
    workers = [p for e in (*procs.prefill, *procs.decode)
               for p in e.data_plane.executor.procs]
    assert len(workers) == 2  # the two-GPU side's (the one-GPU side's GPU is the driver's)
    assert all(p.exitcode is not None for p in workers)  # closed: none left behind
    assert not dist.is_initialized()
    got = outputs(procs)
    assert len(got) >= 3 and got == outputs(threads)
    assert len(procs.transfers) == len(threads.transfers) == len(got)


def pd_prompts(**knobs) -> PDEngine:
    """1 x tp2 prefill + 2 x tp2 decode on three prompts 50 ms apart (the second
    arrives while the first decodes, so both decode groups get calls)."""
    engine = PDEngine("tiny-llama", "tp2", "tp2", backend="compute", num_decode=2,
                      cost_model=FixedStepCost(), clock="predicted",
                      num_gpu_blocks_override=60, **knobs)
    try:
        submit_prompts(engine, shared_prefix_prompts(engine.model.vocab_size), max_tokens=8)
        while engine.step():
            pass
    finally:
        for e in (*engine.prefill, *engine.decode):
            e.data_plane.close()
    return engine


def test_pd_with_several_multi_gpu_groups_as_processes():
    """Every group as processes: each group's workers form a torch.distributed world of
    their own and the driver joins none, so the three worlds live side by side; same
    tokens and transfers as threads."""
    threads, procs = pd_prompts(), pd_prompts(executor="mp")
    groups = [e.data_plane.executor.procs for e in (*procs.prefill, *procs.decode)]
    assert [len(g) for g in groups] == [2, 2, 2]
    assert all(p.exitcode == 0 for g in groups for p in g)  # closed: stopped, reaped
    assert not dist.is_initialized()
    got = outputs(procs)
    assert len(got) == 3 and got == outputs(threads)
    assert len(procs.transfers) == len(threads.transfers) == 3
    assert all(len(e.requests) > 0 for e in procs.decode)  # both decode groups worked


def test_a_killed_worker_stops_a_pd_run_with_processes():
    """A prefill worker killed when the first prompt is done: the run stops with a one-line
    error naming the GPU; that group's other worker is stopped at once, and after the
    planes close no process is left."""
    import os
    import signal
    import time

    from labkit.engine.compute.mp_executor import WorkerDied

    engine = PDEngine("tiny-llama", "tp2", "tp2", backend="compute",
                      cost_model=FixedStepCost(), clock="predicted",
                      num_gpu_blocks_override=60, num_decode=2, executor="mp")
    planes = [e.data_plane for e in (*engine.prefill, *engine.decode)]
    victim = planes[0].executor.procs[1]
    killed = []

    def kill(*_):
        if not killed:
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(time.monotonic())

    engine.prefill[0].finish_callbacks.append(kill)
    try:
        with pytest.raises(WorkerDied, match=r"GPU 1 \(pid \d+\) died \(killed by SIGKILL\)"):
            engine.replay(agentic_trace(2), concurrency=4, loop_trace=False, max_idle_s=1.0,
                          start_part_way=False)
        assert killed and time.monotonic() - killed[0] < 20
        assert all(p.exitcode is not None for p in planes[0].executor.procs)
    finally:
        for plane in planes:
            plane.close()
    assert all(p.exitcode is not None for plane in planes for p in plane.executor.procs)
    assert not dist.is_initialized()


def test_pd_under_torchrun_refuses_two_process_groups_before_starting_any(monkeypatch):
    """Under torchrun the launched world is one engine's: a second group of several GPUs
    as processes is refused before anything starts."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"executor='mp' under torchrun: 1 x tp2 \+ 1 x dp2 "
                                          r"groups of several GPUs .* at most one"):
        PDEngine("tiny-llama", "tp2", "dp2", backend="compute", executor="mp")
    assert not dist.is_initialized()
