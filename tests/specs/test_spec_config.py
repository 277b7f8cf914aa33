"""EngineConfig: vLLM knob names and defaults (DESIGN.md §4), validation that names the
knob (and the allowed values of closed sets), and the exact acceptance fraction."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.errors import ConfigError
from labkit.specs import EngineConfig, knob_fields, knob_names

# DESIGN.md §4: "Knob names follow vLLM where vLLM has one".
DESIGN_KNOBS = ["block_size", "max_num_batched_tokens", "max_num_seqs",
                "enable_prefix_caching", "long_prefill_token_threshold",
                "prefill_schedule_interval", "num_gpu_blocks_override",
                "dcp_kv_cache_interleave_size", "num_speculative_tokens"]


@pytest.mark.parametrize("name", DESIGN_KNOBS)
def test_design_knob_names_exist(name):
    assert name in knob_names()


def test_decode_context_parallel_size_knob():
    assert "decode_context_parallel_size" in knob_names()


def test_defaults_follow_vllm():
    cfg = EngineConfig()
    # vLLM EngineArgs defaults of the same names.
    assert cfg.gpu_memory_utilization == 0.9
    assert cfg.enable_prefix_caching is True  # on by default since vLLM V1
    assert cfg.enable_chunked_prefill is True  # always on in vLLM V1
    assert cfg.long_prefill_token_threshold == 0  # 0: no per-request cap
    assert cfg.scheduling_policy == "fcfs"
    assert cfg.kv_cache_dtype == "auto"
    assert cfg.num_gpu_blocks_override is None
    assert cfg.max_model_len is None  # derived from the model
    assert cfg.block_size is None  # derived from the model / backend
    assert cfg.dcp_kv_cache_interleave_size == 1
    assert cfg.num_speculative_tokens == 0  # no speculative decoding
    # vLLM's defaults depend on usage context and GPU: 2048/8192/16384 tokens and
    # 256/1024 sequences.
    assert cfg.max_num_batched_tokens in (2048, 8192, 16384)
    assert cfg.max_num_seqs in (256, 1024)
    # Every step may admit prefills: plain continuous batching.
    assert cfg.prefill_schedule_interval == 1


def test_knob_metadata_for_the_cli():
    fields = list(knob_fields())
    assert [f[0] for f in fields] == knob_names()
    defaults = EngineConfig()
    for name, _type, default, help_text, choices in fields:
        assert help_text, name
        assert getattr(defaults, name) == default
        if choices:
            assert default in choices
    closed = {f[0]: f[4] for f in fields if f[4]}
    assert set(closed) == {"scheduling_policy", "kv_cache_dtype", "router", "session_kv_migration",
                           "kv_offload_eviction", "linear_state_retention",
                           "kv_layout", "cudagraph_mode", "moe_routing", "sampling"}


# ------------------------------------------------------------------ validation
INVALID = [
    ("max_num_batched_tokens", dict(max_num_batched_tokens=-1)),  # negative budget
    ("max_num_batched_tokens", dict(max_num_batched_tokens=0)),
    ("max_num_seqs", dict(max_num_seqs=0)),
    ("prefill_schedule_interval", dict(prefill_schedule_interval=0)),
    ("dcp_kv_cache_interleave_size", dict(dcp_kv_cache_interleave_size=0)),
    ("block_size", dict(block_size=0)),
    ("num_gpu_blocks_override", dict(num_gpu_blocks_override=-5)),
    ("max_model_len", dict(max_model_len=0)),
    ("long_prefill_token_threshold", dict(long_prefill_token_threshold=-1)),
    ("num_speculative_tokens", dict(num_speculative_tokens=-1)),
    ("gpu_memory_utilization", dict(gpu_memory_utilization=0)),
    ("gpu_memory_utilization", dict(gpu_memory_utilization=1.5)),
    ("gpu_memory_utilization", dict(gpu_memory_utilization=-0.1)),
    ("gpu_memory_utilization", dict(gpu_memory_utilization=math.nan)),
    ("acceptance_length", dict(num_speculative_tokens=3, acceptance_length=0.99)),
    ("acceptance_length", dict(num_speculative_tokens=3, acceptance_length=4.01)),
    ("acceptance_length", dict(num_speculative_tokens=0, acceptance_length=1.5)),
    ("acceptance_length", dict(num_speculative_tokens=3, acceptance_length=math.nan)),
    # one verify step (1 + drafts tokens) must fit in the step budget
    ("max_num_batched_tokens", dict(num_speculative_tokens=3, max_num_batched_tokens=3)),
    ("max_num_batched_tokens", dict(num_speculative_tokens=8, max_num_batched_tokens=1)),
]


@pytest.mark.parametrize("knob,kwargs", INVALID, ids=[f"{k}-{v}" for k, v in INVALID])
def test_invalid_values_name_the_knob(knob, kwargs):
    with pytest.raises(ConfigError) as err:
        EngineConfig(**kwargs)
    assert knob in str(err.value)
    with pytest.raises(ConfigError):
        EngineConfig.from_knobs(**kwargs)


@pytest.mark.parametrize("knob,value,allowed", [
    ("scheduling_policy", "lifo", ["fcfs", "priority"]),
    ("router", "random", ["round_robin", "least_loaded", "least_kv", "session_sticky",
                          "prefix_aware"]),
    ("kv_cache_dtype", "fp4", ["auto", "bf16", "fp8"]),
    ("kv_cache_dtype", "BF16", ["auto", "bf16", "fp8"]),
])
def test_closed_sets_list_allowed_values(knob, value, allowed):
    with pytest.raises(ConfigError) as err:
        EngineConfig(**{knob: value})
    msg = str(err.value)
    assert knob in msg and repr(value) in msg
    for choice in allowed:
        assert choice in msg


@pytest.mark.parametrize("kwargs", [
    dict(gpu_memory_utilization=1.0), dict(gpu_memory_utilization=0.01),
    dict(num_speculative_tokens=3, acceptance_length=1.0),
    dict(num_speculative_tokens=3, acceptance_length=4.0),
    dict(num_speculative_tokens=3, max_num_batched_tokens=4),
    dict(long_prefill_token_threshold=0), dict(block_size=1),
    dict(scheduling_policy="priority", router="session_sticky", kv_cache_dtype="fp8"),
])
def test_boundary_values_accepted(kwargs):
    cfg = EngineConfig(**kwargs)
    for knob, value in kwargs.items():
        assert getattr(cfg, knob) == value


def test_from_knobs_unknown_names_it_and_lists_allowed():
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_knobs(bogus=1)
    msg = str(err.value)
    assert "'bogus'" in msg
    for name in knob_names():
        assert name in msg
    # A near-miss of a real knob gets the same treatment.
    with pytest.raises(ConfigError, match="max_num_batched_token'"):
        EngineConfig.from_knobs(max_num_batched_token=4096)


def test_from_knobs_builds_the_same_config():
    knobs = dict(max_num_batched_tokens=4096, num_speculative_tokens=3,
                 acceptance_length=2.99, router="session_sticky")
    assert EngineConfig.from_knobs(**knobs) == EngineConfig(**knobs)


# ------------------------------------------------------------------- acceptance
def test_acceptance_is_an_exact_fraction():
    # AgentX runs: MTP with 3 draft tokens, 2.99 tokens accepted per verify step.
    cfg = EngineConfig(num_speculative_tokens=3, acceptance_length=2.99)
    assert isinstance(cfg.acceptance, Fraction)
    assert cfg.acceptance == Fraction(299, 100)
    assert cfg.tokens_per_decode_step == 4


@given(k=st.integers(0, 7), data=st.data())
def test_acceptance_exact_for_four_decimals(k, data):
    n = data.draw(st.integers(10_000, 10_000 * (1 + k)))
    value = n / 10_000  # a float such as 2.99, 1.2345
    cfg = EngineConfig(num_speculative_tokens=k, acceptance_length=value)
    assert cfg.acceptance == Fraction(n, 10_000)
    assert cfg.tokens_per_decode_step == 1 + k


def test_acceptance_exact_beyond_four_decimals():
    cfg = EngineConfig(num_speculative_tokens=3, acceptance_length=2.99999)
    assert cfg.acceptance == Fraction(299_999, 100_000)


@pytest.mark.parametrize("k", range(8))
def test_default_acceptance(k):
    cfg = EngineConfig(num_speculative_tokens=k)
    assert isinstance(cfg.acceptance, Fraction)
    assert 1 <= cfg.acceptance <= 1 + k
    if k == 0:
        assert cfg.acceptance == 1  # no drafts: one token per step, exactly


def test_kv_dtype():
    assert EngineConfig().kv_dtype() == "bf16"  # auto: the model's bf16
    assert EngineConfig(kv_cache_dtype="fp8").kv_dtype() == "fp8"


# ---------------------------------------------------------- wrong types
@pytest.mark.parametrize("knob,value", [
    ("max_num_batched_tokens", "8192"),
    ("gpu_memory_utilization", "0.9"),
    ("max_num_seqs", 2.5),
])
def test_wrong_types_name_the_knob(knob, value):
    with pytest.raises(ConfigError, match=knob):
        EngineConfig(**{knob: value})


def test_decode_context_parallel_size_joins_the_layout():
    from labkit import Engine

    engine = Engine("tiny-deepseek-v3", "tp4", "h100", decode_context_parallel_size=4)
    assert engine.layout.dcp == 4 and engine.layout.gpus == 4
    with pytest.raises(ConfigError, match="decode_context_parallel_size"):
        Engine("tiny-deepseek-v3", "tp4xdcp2", "h100", decode_context_parallel_size=4)
