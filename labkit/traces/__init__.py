"""Traces: what a serving engine replays.

A trace is a block size plus requests whose prompts are lists of block ids (equal
ids = equal content). Load one from a file in any published format (``FORMATS``:
labkit, Mooncake, Qwen-Bailian, Azure, AgentX / Weka, BurstGPT, Splitwise), generate
an AgentX-like agentic one or a benchmark load (random, shared-prefix, multi-turn),
write it back as labkit JSONL, and summarise it::

    from labkit.traces import generate_agentx_trace, trace_stats, write_trace
    trace = generate_agentx_trace(num_sessions=8, seed=0)
    trace_stats(trace)["prefix_reuse"]
    load_trace("qwen_traceA_blksz_16.jsonl")              # format auto-detected
    generate_random_trace(num_prompts=500, request_rate=4.0, burstiness=0.5)
    select(load_trace("BurstGPT_1.csv"), window=(86400, 90000), speedup=2)  # a part
    load_trace("BurstGPT_1.csv", where=["Model=GPT-4", "Response tokens>0"])  # rows
"""
from labkit.traces.agentx import generate_agentx_trace
from labkit.traces.agentx_params import TINY_AGENTX, AgentXParams
from labkit.traces.formats import FORMATS
from labkit.traces.io import load_trace, write_trace
from labkit.traces.loads import (
    LOAD_KINDS, generate_multi_turn_trace, generate_random_trace, generate_shared_prefix_trace)
from labkit.traces.parts import select
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.stats import prefix_reuse, trace_stats
from labkit.traces.validate import TraceError

__all__ = [
    "AgentXParams", "FORMATS", "LOAD_KINDS", "TINY_AGENTX", "Trace", "TraceError",
    "TraceRequest", "generate_agentx_trace", "generate_multi_turn_trace",
    "generate_random_trace", "generate_shared_prefix_trace", "load_trace", "prefix_reuse",
    "select", "trace_stats", "write_trace",
]
