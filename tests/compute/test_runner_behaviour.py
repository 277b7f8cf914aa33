"""What the compute plane must keep true beyond layouts: prefix hits, preemption,
speculative decoding, KV fetched between DP ranks, checkpoints, the clock."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from compute_cases import (
    REL_TOL, assert_greedy, compute_engine, count_events, logits_by_row, max_rel_error, outputs,
    replay_agentic, run_to_end, shared_prefix_prompts, submit_prompts)

from labkit.engine.compute.models import init_weights, reference_greedy
from labkit.engine.engine import Engine
from labkit.errors import ConfigError
from labkit.specs import get_model


def _prompts(model="tiny-llama", **kw):
    return shared_prefix_prompts(get_model(model).vocab_size, **kw)


def _run(model="tiny-llama", layout="tp1", max_tokens=8, prompts=None, **knobs):
    eng = compute_engine(model, layout, **knobs)
    counts = count_events(eng)
    submit_prompts(eng, prompts or _prompts(model), max_tokens)
    return run_to_end(eng), counts


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3.2"])
def test_prefix_cache_hit_gives_the_logits_of_recomputing(model):
    hit, _ = _run(model, max_num_batched_tokens=32)
    cold, _ = _run(model, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert sum(r.num_cached_tokens for r in hit.requests.values()) >= 32
    assert sum(r.num_cached_tokens for r in cold.requests.values()) == 0
    a, b = logits_by_row(hit), logits_by_row(cold)
    assert a.keys() == b.keys()
    assert max(max_rel_error(a[k], b[k]) for k in a) < REL_TOL
    assert outputs(hit) == outputs(cold)


def test_preempted_and_recomputed_request_gives_the_same_tokens():
    prompts = _prompts(lengths=(20, 24, 28), prefix=8)
    small, counts = _run(max_tokens=40, prompts=prompts, num_gpu_blocks_override=8,
                         enable_prefix_caching=False)
    ample, _ = _run(max_tokens=40, prompts=prompts)
    assert counts["preemptions"] > 0
    assert outputs(small) == outputs(ample)
    spec = get_model("tiny-llama")
    w = init_weights(spec, 0)
    for rid, toks in prompts.items():
        assert outputs(small)[rid] == reference_greedy(spec, w, torch.tensor(toks), 40)


def test_speculative_decoding_changes_the_steps_not_the_tokens():
    prompts = _prompts(lengths=(12, 5, 30))
    plain, _ = _run(max_tokens=24, prompts=prompts)
    spec, _ = _run(max_tokens=24, prompts=prompts, num_speculative_tokens=3)
    assert outputs(spec) == outputs(plain)
    dp = spec.data_plane
    assert dp.proposed_drafts > 0 and 0 < dp.accepted_drafts <= dp.proposed_drafts
    assert dp.steps < plain.data_plane.steps


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt-oss", "tiny-kimi-linear"])
def test_session_kv_fetched_from_another_dp_rank_is_really_copied(model):
    """A sliding-window model's fetch brings the window's pages at the prefix's end, a
    linear-attention model's the state it ends with (the source's snapshot): without
    either the calls that fetched generate other tokens, or find no state."""
    knobs = dict(router="least_loaded", short=True)  # (the shorter trace, its pool)
    if model != "tiny-llama":
        knobs.update(num_gpu_blocks_override=60, sessions=3)
    fetch, _ = replay_agentic(model, "dp2", **knobs)
    recompute, _ = replay_agentic(model, "dp2", **knobs, session_kv_migration="recompute")
    assert sum(r.num_fetched_tokens for r in fetch.requests.values()) > 100
    assert sum(r.num_fetched_tokens for r in recompute.requests.values()) == 0
    assert outputs(fetch) == outputs(recompute)


def test_linear_state_snapshots_are_real_copies():
    """A hybrid model's snapshot is a copy of the state at a block boundary: a request
    resuming from it continues exactly as the one that saved it did."""
    eng = compute_engine("tiny-kimi-linear", "tp1")
    assert eng.config.enable_prefix_caching
    prompt = list(range(5, 5 + 40))  # 2 full blocks of 16, then 8 tokens
    eng.submit_prompt(prompt, 4, request_id="a")
    run_to_end(eng)
    rank = eng.data_plane.ranks[0]
    kv = eng.schedulers[0].kv
    boundary_key = eng.requests["a"].keys.key(1)  # after 32 tokens: the call-end boundary
    assert kv.snapshots.has(boundary_key) and boundary_key in rank.snapshots
    saved = rank.snapshots._store[boundary_key]
    assert sorted(saved) == [0, 1, 2]  # every linear layer
    # the same 32 tokens from scratch give the same state
    fresh = compute_engine("tiny-kimi-linear", "tp1", enable_prefix_caching=False)
    b = fresh.submit_prompt(prompt[:32], 8, request_id="b")
    while b.num_computed_tokens < 32:
        fresh.step()
    again = fresh.data_plane.ranks[0].linear.marked(0, "b", 32)
    assert again is not None
    for x, y in zip(saved[0], again):
        if x is not None:
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    # a continuation hits the prefix and resumes from the copy
    eng.submit_prompt(prompt + [7, 8, 9], 3, request_id="c")
    run_to_end(eng)
    assert eng.requests["c"].num_cached_tokens == 32
    assert assert_greedy("tiny-kimi-linear", eng) == 2


def test_checkpoint_weights_replace_the_seeded_ones(tmp_path):
    from safetensors.torch import save_file

    spec = get_model("tiny-llama")
    save_file(init_weights(spec, seed=7), str(tmp_path / "model.safetensors"))
    loaded, _ = _run(checkpoint=str(tmp_path / "model.safetensors"))
    seeded, _ = _run(seed=7)
    default, _ = _run()
    assert outputs(loaded) == outputs(seeded) != outputs(default)


def test_measured_clock_times_steps_and_their_collectives():
    eng = Engine(model="tiny-deepseek-v3", layout="dcp2", backend="compute",
                 max_num_batched_tokens=32)
    submit_prompts(eng, _prompts("tiny-deepseek-v3"), 6)
    steps = run_to_end(eng).result().steps
    assert (steps.duration_s > 0).all()
    assert (steps.comm_s > 0).any() and (steps.comm_s <= steps.duration_s + 1e-9).all()
    sec = eng.data_plane.seconds
    assert 0 < sec["collectives"] < sec["forward"]


def test_requests_table_carries_generated_tokens(tmp_path):
    eng, _ = _run(max_tokens=5)
    result = eng.result()
    assert list(result.requests.output_token_ids.map(len)) == [5, 5, 5]
    result.save(tmp_path)
    saved = pd.read_parquet(tmp_path / "requests.parquet")
    assert [list(x) for x in saved.output_token_ids] == \
        [list(x) for x in result.requests.output_token_ids]


def test_bfloat16_runs_and_mostly_agrees_with_float32():
    bf, _ = _run(dtype="bfloat16", max_tokens=4)
    fp, _ = _run(max_tokens=4)
    a, b = logits_by_row(bf), logits_by_row(fp)
    assert a.keys() == b.keys()
    errors = np.array([max_rel_error(a[k].float(), b[k]) for k in a])
    assert errors.max() < 0.1  # bf16 keeps ~3 significant digits


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="sim", device="cpu"), "device only apply to backend='compute'"),
    (dict(backend="compute", clock="wall"), "unknown clock 'wall'; allowed: measured, predicted"),
    (dict(backend="compute", device="tpu"), "unknown device 'tpu'; allowed: cpu, cuda"),
    (dict(backend="compute", dtype="int8"), "unknown dtype 'int8'; allowed: float32"),
    (dict(backend="compute", layout="tp2xkvpp2", model="tiny-deepseek-v3"), "does not run kvpp"),
    (dict(backend="compute", dcp_kv_cache_interleave_size=3, layout="tp2xdcp2",
          model="tiny-deepseek-v3"), "block_size=16 must be a multiple of dcp"),
])
def test_bad_compute_options_are_named(kwargs, match):
    kwargs.setdefault("model", "tiny-llama")
    with pytest.raises(ConfigError, match=match):
        Engine(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        Engine(model="tiny-llama", backend="compute", device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model,layout", [("tiny-llama", "tp2"), ("tiny-deepseek-v3", "dcp2"),
                                          ("tiny-deepseek-v3.2", "tp1")])
def test_cuda_runs_the_triton_kernels_and_agrees_with_the_cpu(model, layout):
    from labkit.kernels import dispatch_counts

    before = sum(n for (_, backend), n in dispatch_counts.items() if backend == "triton")
    gpu, _ = _run(model, layout, device="cuda", num_speculative_tokens=2,
                  max_num_batched_tokens=32)
    cpu, _ = _run(model, layout, num_speculative_tokens=2, max_num_batched_tokens=32)
    assert sum(n for (_, b), n in dispatch_counts.items() if b == "triton") > before
    a, b = logits_by_row(gpu), logits_by_row(cpu)
    assert a.keys() == b.keys()
    assert max(max_rel_error(a[k].float(), b[k]) for k in a) < 1e-4
    assert outputs(gpu) == outputs(cpu)
