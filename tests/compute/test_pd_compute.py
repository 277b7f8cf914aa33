"""P/D disaggregation on the compute plane: KV computed under one layout, decoded
under another, gives the tokens of a co-located run."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from compute_cases import FixedStepCost, agentic_trace, compute_engine, outputs

from labkit.engine.disagg import PDEngine
from labkit.errors import ConfigError


def pd_replay(model: str, prefill: str, decode: str, **knobs) -> PDEngine:
    engine = PDEngine(model, prefill, decode, backend="compute", cost_model=FixedStepCost(),
                      clock="predicted", num_gpu_blocks_override=60, **knobs)
    engine.replay(agentic_trace(), concurrency=4, loop_trace=False, max_idle_s=1.0,
                  start_part_way=False)
    return engine


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_pcp_dcp_prefill_then_dp_decode_gives_the_colocated_tokens(model):
    pd_engine = pd_replay(model, "pcp2xdcp2", "dp2")
    colocated = compute_engine(model, "tp1", num_gpu_blocks_override=60)
    colocated.replay(agentic_trace(), concurrency=4, loop_trace=False, max_idle_s=1.0,
                     start_part_way=False)
    got, want = outputs(pd_engine), outputs(colocated)
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
    colocated = compute_engine("tiny-llama", "tp1", num_gpu_blocks_override=60)
    colocated.replay(agentic_trace(), concurrency=4, loop_trace=False, max_idle_s=1.0,
                     start_part_way=False)
    assert outputs(engine) == outputs(colocated)


_colocated: dict = {}


def colocated_outputs(model: str) -> dict:
    if model not in _colocated:
        eng = compute_engine(model, "tp1", num_gpu_blocks_override=60)
        eng.replay(agentic_trace(), concurrency=4, loop_trace=False, max_idle_s=1.0,
                   start_part_way=False)
        _colocated[model] = outputs(eng)
    return _colocated[model]


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
    engine = PDEngine(model, prefill, decode, backend="compute", cost_model=FixedStepCost(),
                      clock="predicted", num_gpu_blocks_override=60, **knobs)
    engine.replay(agentic_trace(2), concurrency=4, loop_trace=False, max_idle_s=1.0,
                  start_part_way=False)
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
    assert len(workers) == 1  # the two-GPU side's second GPU
    assert all(p.exitcode is not None for p in workers)  # closed: none left behind
    assert not dist.is_initialized()
    got = outputs(procs)
    assert len(got) >= 3 and got == outputs(threads)
    assert len(procs.transfers) == len(threads.transfers) == len(got)


def test_pd_refuses_two_process_groups_before_starting_any():
    with pytest.raises(ConfigError, match=r"executor='mp': 1 x tp2 \+ 1 x dp2 groups of "
                                          r"several GPUs .* at most one"):
        PDEngine("tiny-llama", "tp2", "dp2", backend="compute", executor="mp")
    assert not dist.is_initialized()
