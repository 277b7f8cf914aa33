"""A measured run's workload as a trace: inference-perf's `shared_prefix`, in distribution.

The runs used inference-perf's shared-prefix generator at a constant rate: 10 system
prompts, each shared by 10 questions — 100 distinct prompts, cycled in order — sent at
each stage's rate for its duration, every request generating exactly the nominal output
(`ignore_eos`). As a canonical trace (block ids, `labkit.traces`): the system prompt's
full blocks carry its group's ids, so all 10 questions of a group share them in the
prefix cache; the rest of a prompt carries ids of its own, so a prompt seen again (every
100 requests) hits its whole cached prefix. Request k of a stage arrives at
stage start + k / rate (inference-perf's small timing jitter is left out).

`duration_scale` shortens every stage by the same factor: the mix of stages, the
rates, hence the steady state of each stage, stay; only the number of requests
shrinks (0.1: 600-s stages run 60 s). The measured aggregates pool all requests of a
run, so a uniform scale keeps each stage's weight in them.
"""

from __future__ import annotations

import numpy as np

from labkit.traces.schema import Trace, TraceRequest
from labkit.validate.runs import GROUPS, PROMPTS_PER_GROUP

BLOCK_SIZE = 16
_PROMPT_ID_BASE = 1 << 20  # ids of prompt-specific blocks, apart from the groups'


def shared_prefix_trace(stages, prompt_len: int, system_len: int, output_len: int,
                        duration_scale: float = 1.0, block_size: int = BLOCK_SIZE) -> Trace:
    """Open-loop trace of constant-rate `stages` ((rate, seconds), ...) of shared-prefix
    prompts of `prompt_len` tokens whose first `system_len` are their group's."""
    if not 0 < duration_scale <= 1:
        raise ValueError(f"duration_scale={duration_scale} must be in (0, 1]")
    distinct = GROUPS * PROMPTS_PER_GROUP
    n_blocks = -(-prompt_len // block_size)
    shared = min(system_len // block_size, n_blocks - 1)
    ids = []
    for p in range(distinct):
        group = p // PROMPTS_PER_GROUP
        own = _PROMPT_ID_BASE + p * n_blocks + np.arange(n_blocks - shared)
        ids.append(np.concatenate([group * n_blocks + np.arange(shared), own]))
    requests, start, i = [], 0.0, 0
    for rate, seconds in stages:
        seconds *= duration_scale
        for k in range(int(round(rate * seconds))):
            requests.append(TraceRequest(
                session_id=f"s{i}", request_id=f"r{i}", parent_id=None, kind="main",
                delay_s=0.0, input_length=prompt_len, output_length=output_len,
                hash_ids=ids[i % distinct], timestamp=start + k / rate))
            i += 1
        start += seconds
    return Trace(block_size, requests, source="shared_prefix(inference-perf)")
