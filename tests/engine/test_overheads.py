"""Step overheads as vLLM pays them: capture sizes, graph dispatch and padding, the CPU
and the GPU overlapped (or not), DP coordination — closed forms, worked by hand from
vLLM's rules (vllm/config/vllm.py `_set_cudagraph_sizes`, vllm/v1/cudagraph_dispatcher.py,
vllm/v1/worker/dp_utils.py)."""

import numpy as np
import pytest

from labkit import Engine
from labkit.costmodel import CostModel
from labkit.engine.request import Request
from labkit.engine.sim.overheads import (FITTED, FULL, NONE, PIECEWISE, StepOverheads,
                                         capture_sizes)
from labkit.engine.sim.sampler_cost import SamplerCost
from labkit.engine.step_work import StepWork
from labkit.errors import ConfigError
from labkit.specs import EngineConfig


def test_default_capture_sizes_follow_vllm():
    # max_num_seqs 128 -> max size min(2 * 128, 512) = 256
    expected = [1, 2, 4] + list(range(8, 256, 8)) + [256]
    assert capture_sizes(128, 2048).tolist() == expected
    # 512 cap, every 16 beyond 256, and the token budget captured when it fits
    big = capture_sizes(1024, 8192)
    assert big[-1] == 512 and big.tolist()[-3:] == [480, 496, 512]
    assert capture_sizes(128, 100).tolist() == [1, 2, 4] + list(range(8, 100, 8)) + [100]


def test_spec_decode_rounds_sizes_to_multiples_of_the_query_length():
    sizes = capture_sizes(64, 8192, decode_query_len=4)  # max min(64 * 4 * 2, 512) = 512
    assert (sizes % 4 == 0).all() and sizes[0] == 4 and sizes[-1] == 512


def test_user_sizes_and_their_maximum_must_agree():
    assert capture_sizes(128, 2048, sizes=(4, 1, 64, 4096)).tolist() == [1, 4, 64]
    with pytest.raises(ConfigError, match="max_cudagraph_capture_size"):
        capture_sizes(128, 2048, sizes=(1, 8), max_size=16)
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
        EngineConfig(cudagraph_capture_sizes="1,x")


def overheads(mode="FULL_AND_PIECEWISE", **kw):
    return StepOverheads(FITTED, mode=mode, sizes=capture_sizes(128, 2048), max_num_seqs=128,
                         **kw)


def test_batches_pad_to_the_next_capture_size():
    o = overheads()
    tokens = np.array([1, 3, 9, 250, 256, 257, 2048])
    decode = np.ones(7, dtype=bool)
    mode, padded = o.dispatch(tokens, decode)
    assert padded.tolist() == [1, 4, 16, 256, 256, 257, 2048]  # eager beyond 256: no padding
    # FULL decode graphs exist up to max_num_seqs (128) requests; beyond, piecewise
    assert mode.tolist() == [FULL] * 3 + [PIECEWISE] * 2 + [NONE] * 2
    # a mixed batch (a prefill in it) replays the piecewise graphs, padded the same way
    mode, padded = o.dispatch(tokens, ~decode)
    assert padded.tolist() == [1, 4, 16, 256, 256, 257, 2048]
    assert mode.tolist() == [PIECEWISE] * 5 + [NONE] * 2


def test_full_decode_graphs_stop_at_max_num_seqs_requests():
    o = StepOverheads(FITTED, sizes=capture_sizes(16, 2048), max_num_seqs=16)
    mode, padded = o.dispatch(np.array([16, 24]), np.array([True, True]))
    assert mode.tolist() == [FULL, PIECEWISE]  # 24 decodes > 16 requests: a mixed graph
    assert padded.tolist() == [16, 24]


@pytest.mark.parametrize("name, decode_mode, mixed_mode", [
    ("FULL_AND_PIECEWISE", FULL, PIECEWISE), ("FULL_DECODE_ONLY", FULL, NONE),
    ("FULL", FULL, FULL), ("PIECEWISE", PIECEWISE, PIECEWISE), ("NONE", NONE, NONE)])
def test_each_cudagraph_mode_dispatches_as_vllm(name, decode_mode, mixed_mode):
    o = overheads(name)
    mode, padded = o.dispatch(np.array([9, 9]), np.array([True, False]))
    assert mode.tolist() == [decode_mode, mixed_mode]
    assert padded.tolist() == [9 if m == NONE else 16 for m in (decode_mode, mixed_mode)]


def test_launch_costs_per_mode():
    o = overheads(layers=32)
    p = FITTED
    assert o.launch_s(np.array([FULL, PIECEWISE, NONE])).tolist() == pytest.approx(
        [0.0, 32 * p.piecewise_layer_s, 32 * p.eager_layer_s])


def test_async_overlaps_cpu_and_gpu_sync_adds_them():
    p = FITTED
    gpu, cpu, launch = np.array([5e-3, 1e-4]), np.array([1e-3, 1e-3]), np.array([0.0, 2e-4])
    on = overheads(async_scheduling=True).step_s(gpu, cpu, launch)
    off = overheads(async_scheduling=False).step_s(gpu, cpu, launch)
    assert on.tolist() == pytest.approx([5e-3 + p.step_gap_s, 1.2e-3 + p.step_gap_s])
    assert off.tolist() == pytest.approx([6e-3 + p.step_gap_s, 1.2e-3 + p.step_gap_s])


def test_cpu_grows_with_requests_tokens_and_dp_ranks():
    o, p = overheads(), FITTED
    assert o.cpu_s(np.array(10), np.array(300)) == pytest.approx(
        p.cpu_step_s + 10 * p.cpu_per_request_s + 300 * p.cpu_per_token_s)
    # DP coordination: a recursive-doubling all-reduce, 2 ceil(log2 R) hops
    assert o.cpu_s(0, 0, dp_ranks=16) - o.cpu_s(0, 0) == pytest.approx(8 * p.dp_sync_hop_s)
    assert o.cpu_s(0, 0, dp_ranks=5) - o.cpu_s(0, 0) == pytest.approx(6 * p.dp_sync_hop_s)


def test_lockstep_ranks_agree_on_mode_and_padding():
    o = overheads()
    mode, padded = o.dispatch(np.array([[3, 9]]), np.array([[True, True]]))
    mode, padded = o.sync_ranks(mode, padded, np.array([[3, 9]]))
    assert padded.tolist() == [[16, 16]] and mode.tolist() == [[FULL, FULL]]
    # one rank must run eagerly: everyone does, nobody pads
    tokens = np.array([[3, 4000]])
    mode, padded = o.dispatch(tokens, np.array([[True, False]]))
    mode, padded = o.sync_ranks(mode, padded, tokens)
    assert mode.tolist() == [[NONE, NONE]] and padded.tolist() == [[3, 4000]]


def test_gemms_run_the_padded_batch():
    """Decode batches of 9..16 requests replay the 16-token graph: the same GEMM time;
    only attention, the LM head and the sampler (which see the real requests: logits are
    computed for the sampled rows only) differ. 17 starts the next size."""
    cm = CostModel("h100")
    ctx = 1000
    sampler = SamplerCost(128256, cm.hardware.hbm_bandwidth, "top_p")

    def attn(b):
        return 32 * cm.attention_decode(b, ctx, 32, 8, 128) + cm.gemm(b, 128256, 4096) + \
            sampler(b)

    rest = [cm.step_time("llama-3.1-8b", "tp1", [{"new_tokens": 1, "context": ctx}] * b)
            ["compute_s"] - attn(b) for b in range(9, 18)]
    assert np.allclose(rest[:8], rest[0], rtol=1e-12)
    assert rest[8] > rest[0]
    eager = cm.step_time("llama-3.1-8b", "tp1", [{"new_tokens": 1, "context": ctx}] * 9,
                         cudagraph_mode="NONE")["compute_s"] - attn(9)
    assert eager < rest[0]  # no padding eagerly


def test_step_time_composes_the_overheads():
    cm = CostModel("h100")
    batch = [{"new_tokens": 1, "context": 1000}] * 10
    p = FITTED
    cpu = p.cpu_step_s + 10 * p.cpu_per_request_s + 10 * p.cpu_per_token_s
    on = cm.step_time("llama-3.1-8b", "tp1", batch)
    off = cm.step_time("llama-3.1-8b", "tp1", batch, async_scheduling=False)
    gpu = on["compute_s"] + on["comm_s"]
    assert on["seconds"] == pytest.approx(max(gpu, cpu) + p.step_gap_s, rel=1e-12)
    assert off["seconds"] == pytest.approx(gpu + cpu + p.step_gap_s, rel=1e-12)


def test_async_scheduling_delays_a_newcomer_by_one_step():
    """A request arriving while a step runs misses the step already scheduled."""
    first = {}
    for flag in (True, False):
        def run(with_b_at=None, flag=flag):
            engine = Engine("tiny-llama", "tp1", "h100", async_scheduling=flag,
                            sim_fast_forward=False)
            engine.submit(Request("a", "a", 64, 50, 0.0), at=0.0)
            if with_b_at is not None:
                engine.submit(Request("b", "b", 64, 5, 0.0), at=with_b_at)
            engine.run_until()
            return engine, engine.step_recorder.frame()["start_s"].tolist()
        _, starts = run()
        engine, starts_b = run((starts[2] + starts[3]) / 2)  # b arrives during step 2
        assert starts_b[:4] == starts[:4]
        first[flag] = starts_b.index(engine.requests["b"].first_scheduled_s)
    assert first[False] == 3  # scheduled in the step right after the one in flight
    assert first[True] == 4  # step 3 was already scheduled when b arrived


def test_dummy_and_padding_under_dep():
    """DEP: an idle rank's dummy batch and a 3-token rank both run the largest padded
    batch of the step (16 tokens for a 9-token rank); a rank that must run eagerly takes
    every rank out of the graphs, unpadded."""
    from labkit.engine.capacity import placement_for
    from labkit.engine.sim.layer_model import LayerStepModel
    from labkit.specs import Layout, get_model

    config = EngineConfig(max_num_seqs=128, max_num_batched_tokens=2048)
    m = LayerStepModel.from_config(placement_for(get_model("tiny-qwen3-moe"),
                                                 Layout.parse("dep4"), config),
                                   CostModel("h100"), config)
    z = np.zeros((1, 4), dtype=np.int64)
    decode = np.array([[3, 9, 0, 1]])
    work = StepWork(prefill_tokens=z, decode_tokens=decode, num_prefill_reqs=z,
                    num_decode_reqs=decode, kv_read_tokens=z, prefill_pairs=z,
                    decode_pairs=z, idle=decode == 0)
    mode, padded = m._graphs(work, lockstep=True)
    assert padded.tolist() == [[16] * 4] and mode.tolist() == [[FULL] * 4]
    prefill = np.array([[0, 0, 0, 3000]])
    work = StepWork(prefill_tokens=prefill, decode_tokens=decode, num_prefill_reqs=prefill // 3000,
                    num_decode_reqs=decode, kv_read_tokens=z, prefill_pairs=z,
                    decode_pairs=z, idle=(decode + prefill) == 0)
    mode, padded = m._graphs(work, lockstep=True)
    assert mode.tolist() == [[NONE] * 4] and padded.tolist() == [[3, 9, 1, 3001]]
