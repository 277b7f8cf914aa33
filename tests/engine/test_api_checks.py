"""The Python API refuses what the CLI refuses (issue 12, items 10-12).

Each call below was accepted on the old main and gave nonsense (a prompt past
max_model_len running anyway, an empty prompt producing tokens, max_output_tokens=0
producing one, negative token ids wrapping around the embedding table,
`concurrency=True`, a negative duration, a negative GEMM taking positive time). Each
must now raise a ConfigError naming the argument, before anything runs.
"""

from __future__ import annotations

import math

import pytest

from labkit import CostModel, Engine, generate_agentx_trace
from labkit.errors import ConfigError
from labkit.specs import EngineConfig, Layout

SMALL = dict(main_calls_median=3.0, main_calls_max=4, shared_prefix_tokens=64,
             initial_context_median=200.0, initial_context_max=400, output_median=20.0,
             output_max=40, tool_result_median=50.0, tool_result_max=200,
             file_read_median=100.0, context_window_tokens=4000,
             compact_threshold_tokens=3000)


@pytest.fixture(scope="module")
def trace():
    return generate_agentx_trace(2, seed=0, block_size=16, **SMALL)


@pytest.fixture(scope="module")
def compute_engine():
    return Engine("tiny-llama", "tp1", backend="compute", num_gpu_blocks_override=64)


@pytest.mark.parametrize("tokens, max_out, words", [
    ([], 4, ["token_ids", "empty"]),
    ([5, 6, 7], 0, ["max_output_tokens"]),
    ([5, 6, 7], True, ["max_output_tokens"]),
    ([5, -1, 7], 4, ["-1", "vocabulary"]),
    ([5, 10**9, 7], 4, ["1000000000", "vocabulary"]),
    ([5, 6.5, 7], 4, ["token_ids", "integers"]),
])
def test_submit_prompt_refuses_what_cannot_be_a_call(compute_engine, tokens, max_out, words):
    before = dict(compute_engine.requests)
    with pytest.raises(ConfigError) as err:
        compute_engine.submit_prompt(tokens, max_out)
    for word in words:
        assert word in str(err.value)
    assert compute_engine.requests == before  # nothing was submitted


def test_submit_prompt_checks_max_model_len():
    eng = Engine("tiny-llama", "tp1", backend="compute", num_gpu_blocks_override=256,
                 max_model_len=64)
    with pytest.raises(ConfigError, match="max_model_len=64"):
        eng.submit_prompt(list(range(4, 64)), 8)  # 60 + 8 tokens
    eng.submit_prompt(list(range(4, 60)), 8)  # 56 + 8 fit exactly
    while eng.step():
        pass
    assert len(eng.requests["prompt-0"].output_token_ids) == 8


@pytest.mark.parametrize("kwargs, words", [
    (dict(concurrency=True, duration_s=10), ["concurrency", "True"]),
    (dict(concurrency=2.0, duration_s=10), ["concurrency", "2.0"]),
    (dict(concurrency="2", duration_s=10), ["concurrency", "'2'"]),
    (dict(concurrency=2, duration_s=-1), ["duration_s=-1"]),
    (dict(concurrency=2, duration_s=0), ["duration_s=0"]),
    (dict(concurrency=2, duration_s=math.nan), ["duration_s=nan"]),
    (dict(concurrency=2, duration_s=math.inf), ["duration_s=inf"]),
    (dict(concurrency=2, duration_s=10, warmup_s=-1), ["warmup_s=-1"]),
    (dict(concurrency=2, duration_s=10, warmup_s=10), ["warmup_s=10", "duration_s=10"]),
    (dict(concurrency=2, duration_s=10, max_idle_s=math.nan), ["max_idle_s"]),
    (dict(concurrency=10**9, duration_s=10), ["concurrency", "16,384"]),
    (dict(open_loop=1), ["open_loop"]),
])
def test_replay_refuses_arguments_that_never_end_or_mean_nothing(trace, kwargs, words):
    eng = Engine("llama-3.1-8b", "tp1")
    with pytest.raises(ConfigError) as err:
        eng.replay(trace, **kwargs)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert not eng.requests  # refused before a single arrival


def test_the_session_bound_grows_with_the_running_slots(trace):
    """64 sessions per running slot: 2 DP ranks of max_num_seqs=4 take 512, not 513."""
    eng = Engine("llama-3.1-8b", "dp2", max_num_seqs=4)
    with pytest.raises(ConfigError, match="512"):
        eng.start_replay(trace, concurrency=513, duration_s=1)
    eng.start_replay(trace, concurrency=512, duration_s=1)


@pytest.mark.parametrize("args", [(-1, 4096, 4096), (4096, math.nan, 4096),
                                  (4096, 4096, math.inf)])
def test_cost_model_refuses_negative_or_undefined_sizes(args):
    cm = CostModel("h200")
    with pytest.raises(ConfigError, match="CostModel.gemm"):
        cm.gemm(*args)
    with pytest.raises(ConfigError, match="CostModel.attention_decode"):
        cm.attention_decode(batch=[1, -2], context=1024, num_heads=32, num_kv_heads=8,
                            head_dim=128)
    assert cm.gemm(0, 4096, 4096) >= 0  # an empty GEMM is fine


@pytest.mark.parametrize("knobs, word", [
    (dict(seed=-1), "seed=-1"),
    (dict(cpu_kv_gib=math.nan), "cpu_kv_gib=nan"),
    (dict(gpu_memory_utilization=math.nan), "gpu_memory_utilization=nan"),
    (dict(acceptance_length=math.inf, num_speculative_tokens=2), "acceptance_length=inf"),
])
def test_engine_config_refuses_negative_seeds_and_non_finite_floats(knobs, word):
    with pytest.raises(ConfigError, match=word):
        EngineConfig(**knobs)


def test_kv_offload_dir_is_refused_where_nothing_writes_there(tmp_path):
    with pytest.raises(ConfigError, match="kv_offload_dir only applies to backend='compute'"):
        Engine("llama-3.1-8b", "tp1", cpu_kv_gib=1, disk_kv_gib=2, kv_offload_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="disk_kv_gib"):
        Engine("tiny-llama", "tp1", backend="compute", cpu_kv_gib=0.001,
               kv_offload_dir=str(tmp_path))


def test_a_layout_larger_than_any_deployment_is_refused():
    with pytest.raises(ConfigError, match="dp100000"):
        Layout.parse("dp100000")
    assert Layout.parse("dep4096").gpus == 4096


@pytest.mark.parametrize("knobs, word", [
    (dict(main_calls_median=-3), "main_calls_median"),
    (dict(subagent_session_share=5), "subagent_session_share"),
    (dict(context_window_tokens=-5), "context_window_tokens"),
    (dict(output_median=math.nan), "output_median"),
    (dict(tool_gap_sigma=-1.0), "tool_gap_sigma"),
])
def test_generator_knobs_are_checked(knobs, word):
    with pytest.raises(ConfigError, match=word):
        generate_agentx_trace(2, seed=0, **knobs)
    with pytest.raises(ConfigError, match="block_size"):
        generate_agentx_trace(2, seed=0, block_size=0)


def test_a_prompt_over_the_budget_without_chunked_prefill_needs_the_threshold():
    """enable_chunked_prefill off: a prompt over max_num_batched_tokens can never be
    scheduled whole, but long_prefill_token_threshold still chunks it (vLLM caps a
    prompt by the threshold before the budget check)."""
    knobs = dict(enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises(ConfigError, match="long_prefill_token_threshold: unset"):
        Engine("tiny-llama", "tp1", **knobs).check_fits("r", 1000, 10)
    Engine("tiny-llama", "tp1", long_prefill_token_threshold=32, **knobs).check_fits("r", 1000, 10)
    with pytest.raises(ConfigError, match="max_num_batched_tokens=64"):
        Engine("tiny-llama", "tp1", long_prefill_token_threshold=128, **knobs).check_fits(
            "r", 1000, 10)
