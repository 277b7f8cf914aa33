"""An AgentX-like trace generator: closed-loop coding-agent sessions.

A coding agent (Claude Code and the like) works in *sessions*. Each main-agent
call sends the whole conversation so far and gets back a short answer, mostly
tool calls; the tools run (the session idles for seconds), and their results are
appended for the next call::

    prompt[k+1] = prompt[k] + output[k] + tool results (+ a little user text)

so prompts are long, outputs short, and almost every prompt token was in the
previous prompt (prefix reuse > 96 %). Around this core the generator models:

* a system prompt + tool definitions shared by *all* sessions (same block ids),
  then a per-session initial context (CLAUDE.md, the task, ...);
* per-turn growth that is usually small (command output, diffs) and sometimes
  large (reading a file), truncated at a cap;
* compaction: when the prompt passes a threshold below the context window, one
  call summarises the conversation, and the next prompt restarts from the shared
  prefix + the summary + re-read files (a rare prefix-cache miss);
* subagents: a main call may spawn a few in parallel. Each forks the main agent's
  current context (prompt = parent input + output + task), runs its own growing
  turns, and returns its last output as a report inside the next main call's
  tool result -- so in the file all its calls precede that next main call;
* idle gaps: a lognormal tool-run time, or a longer user think time on turns where
  the user types; 0 before a session's first call.

Session-level draws (calls per session, who spawns, how many subagents) use
*stratified* sampling -- one uniform per equal-probability stratum, shuffled --
so that even a few hundred sessions reproduce the target medians and shares
instead of scattering around them. Everything else is i.i.d. per session from
``numpy.random.default_rng(seed)``; the same arguments give the same trace.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from labkit import checks
from labkit.traces.agentx_params import AgentXParams
from labkit.traces.agentx_session import SessionBuilder
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.streams import IdMinter


def _stratified_uniform(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniforms in (0, 1), exactly one in each interval [i/n, (i+1)/n), shuffled."""
    u = (rng.permutation(n) + rng.random(n)) / n
    return np.clip(u, 1e-12, 1 - 1e-12)


@dataclass(slots=True)
class SessionPlan:
    main_calls: int
    subagents: int


def plan_sessions(num_sessions: int, p: AgentXParams,
                  rng: np.random.Generator) -> list[SessionPlan]:
    """Calls and subagent counts per session (stratified, see module doc)."""
    z = np.array([NormalDist().inv_cdf(u) for u in _stratified_uniform(rng, num_sessions)])
    calls = np.clip(np.rint(p.main_calls_median * np.exp(p.main_calls_sigma * z)),
                    p.main_calls_min, p.main_calls_max).astype(int)
    subagents = np.zeros(num_sessions, dtype=int)
    n_spawning = round(p.subagent_session_share * num_sessions)
    spawning = rng.permutation(num_sessions)[:n_spawning]
    # 1 + a geometric number of extra subagents, mean subagents_per_spawning_mean.
    extra_mean = p.subagents_per_spawning_mean - 1.0
    if extra_mean > 0:
        q = extra_mean / (1.0 + extra_mean)        # P(extra >= x) = q**x
        u = _stratified_uniform(rng, n_spawning)
        extra = np.floor(np.log1p(-u) / np.log(q)).astype(int)
    else:
        extra = np.zeros(n_spawning, dtype=int)
    subagents[spawning] = np.minimum(1 + extra, p.subagents_max)
    return [SessionPlan(int(c), int(s)) for c, s in zip(calls, subagents, strict=True)]


def generate_agentx_trace(num_sessions: int, seed: int = 0, block_size: int = 64,
                          **knobs) -> Trace:
    """A closed-loop agentic trace of ``num_sessions`` sessions.

    ``knobs`` override ``AgentXParams`` fields (documented there); an unknown
    knob raises TypeError. Deterministic in (num_sessions, seed, block_size, knobs).
    """
    checks.integer("num_sessions", num_sessions, low=1, high=10**6)
    checks.integer("block_size", block_size, low=1)
    p = AgentXParams(**knobs)
    rng = np.random.default_rng(seed)
    plans = plan_sessions(num_sessions, p, rng)
    n_shared = p.shared_prefix_tokens // block_size
    minter = IdMinter()
    shared_ids = minter.take(n_shared)  # ids 0..n_shared-1: the common prefix
    requests: list[TraceRequest] = []
    builder = SessionBuilder(p, block_size, minter, shared_ids, requests)
    for index, (plan, session_rng) in enumerate(zip(plans, rng.spawn(num_sessions), strict=True)):
        builder.build(index, plan.main_calls, plan.subagents, session_rng)
    knob_text = "".join(f", {k}={v!r}" for k, v in sorted(knobs.items()))
    source = (f"generated(agentx, num_sessions={num_sessions}, seed={seed}, "
              f"block_size={block_size}{knob_text})")
    return Trace(block_size, requests, source=source, format="labkit")
