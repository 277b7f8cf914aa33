"""Traces: what a serving engine replays.

A trace is a block size plus requests whose prompts are lists of block ids (equal
ids = equal content). Load one from a file (labkit or Mooncake JSONL), generate an
AgentX-like agentic one, write it back, and summarise it::

    from labkit.traces import generate_agentx_trace, trace_stats, write_trace
    trace = generate_agentx_trace(num_sessions=8, seed=0)
    trace_stats(trace)["prefix_reuse"]
"""
from labkit.traces.agentx import generate_agentx_trace
from labkit.traces.agentx_params import TINY_AGENTX, AgentXParams
from labkit.traces.io import load_trace, write_trace
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.stats import prefix_reuse, trace_stats
from labkit.traces.validate import TraceError

__all__ = [
    "AgentXParams", "TINY_AGENTX", "Trace", "TraceError", "TraceRequest", "generate_agentx_trace",
    "load_trace", "prefix_reuse", "trace_stats", "write_trace",
]
