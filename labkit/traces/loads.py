"""Benchmark loads: the synthetic request streams serving benchmarks send.

Three kinds, named as ``vllm bench serve`` and inference-perf name them:

* **random** (vLLM ``--dataset-name random``): ``num_prompts`` independent requests,
  input ``input_len`` and output ``output_len`` tokens (integer-uniform within
  ``range_ratio``), optionally after a ``prefix_len``-token prefix every request
  shares;
* **shared-prefix** (inference-perf ``shared_prefix``, SGLang
  ``generated-shared-prefix``): ``num_groups`` system prompts of
  ``system_prompt_len`` tokens, each followed by ``prompts_per_group`` different
  questions of ``question_len`` tokens -- the prompts are shuffled, so groups
  interleave as they would from many users;
* **multi-turn**: ``num_sessions`` chat sessions of ``turns`` turns; each turn sends
  the conversation so far (a shared system prompt, earlier questions and answers)
  plus ``input_len`` new tokens and gets ``output_len`` back; the user thinks
  ``think_time_s`` on average (exponential) before the next turn.

Requests (for multi-turn, sessions' first turns) arrive at the ``request_rate`` /
``burstiness`` arrival times of ``arrivals.py``, as their ``timestamp``: replay them
open loop to get a request rate, or closed loop (``concurrency``, vLLM's
``--max-concurrency``) to ignore it. Block ids follow content through
``streams.TokenStream``, so what two prompts share -- the prefix, the system prompt,
a conversation's history -- is exactly what their ids share.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from labkit import checks
from labkit.errors import ConfigError
from labkit.traces.arrivals import arrival_times, uniform_lengths
from labkit.traces.schema import Trace, TraceRequest
from labkit.traces.streams import IdMinter, TokenStream
from labkit.traces.validate import MAX_PROMPT_TOKENS

LOAD_KINDS = ("random", "shared-prefix", "multi-turn")


def generate_random_trace(num_prompts: int = 1000, input_len: int = 1024,
                          output_len: int = 128, range_ratio: float = 0.0,
                          prefix_len: int = 0, request_rate: float = math.inf,
                          burstiness: float = 1.0, seed: int = 0,
                          block_size: int = 64) -> Trace:
    """vLLM's random dataset: independent requests around fixed lengths."""
    knobs = dict(locals())
    _check_knobs(knobs, calls=num_prompts, tokens=lambda: num_prompts * (
        prefix_len + input_len * (1 + range_ratio)))
    rng = np.random.default_rng(seed)
    inputs = uniform_lengths(input_len, range_ratio, num_prompts, rng, name="input_len")
    outputs = uniform_lengths(output_len, range_ratio, num_prompts, rng, minimum=1,
                              name="output_len")
    if prefix_len + inputs.min() < 1:
        raise ConfigError(f"input_len={input_len} with range_ratio={range_ratio} and "
                          f"prefix_len={prefix_len} allows empty prompts")
    stamps = arrival_times(num_prompts, request_rate, burstiness, rng)
    minter = IdMinter()
    prefix = minter.take(prefix_len // block_size)
    requests = [_single(f"r{i:05d}", TokenStream(block_size, minter, prefix, prefix_len),
                        int(inputs[i]), int(outputs[i]), stamps[i])
                for i in range(num_prompts)]
    return Trace(block_size, requests, format="labkit", source=_source("random", knobs))


def generate_shared_prefix_trace(num_groups: int = 64, prompts_per_group: int = 16,
                                 system_prompt_len: int = 2048, question_len: int = 128,
                                 output_len: int = 256, range_ratio: float = 0.0,
                                 request_rate: float = math.inf, burstiness: float = 1.0,
                                 seed: int = 0, block_size: int = 64) -> Trace:
    """Groups of prompts sharing a system prompt, shuffled (inference-perf)."""
    knobs = dict(locals())
    _check_knobs(knobs, calls=lambda: num_groups * prompts_per_group,
                 tokens=lambda: num_groups * prompts_per_group * (
                     system_prompt_len + question_len * (1 + range_ratio)))
    n = num_groups * prompts_per_group
    rng = np.random.default_rng(seed)
    questions = uniform_lengths(question_len, range_ratio, n, rng,
                                minimum=0 if system_prompt_len else 1, name="question_len")
    outputs = uniform_lengths(output_len, range_ratio, n, rng, minimum=1, name="output_len")
    order = rng.permutation(n)
    stamps = arrival_times(n, request_rate, burstiness, rng)
    minter = IdMinter()
    systems = [minter.take(system_prompt_len // block_size) for _ in range(num_groups)]
    requests = []
    for slot, k in enumerate(order):
        group, member = divmod(int(k), prompts_per_group)
        stream = TokenStream(block_size, minter, systems[group], system_prompt_len)
        requests.append(_single(f"g{group:03d}.p{member:04d}", stream, int(questions[k]),
                                int(outputs[k]), stamps[slot]))
    return Trace(block_size, requests, format="labkit",
                 source=_source("shared-prefix", knobs))


def generate_multi_turn_trace(num_sessions: int = 100, turns: int = 5,
                              system_prompt_len: int = 0, input_len: int = 256,
                              output_len: int = 128, range_ratio: float = 0.0,
                              think_time_s: float = 0.0, request_rate: float = math.inf,
                              burstiness: float = 1.0, seed: int = 0,
                              block_size: int = 64) -> Trace:
    """Chat sessions whose every turn re-sends the conversation so far."""
    knobs = dict(locals())
    most = lambda: math.ceil(turns * (1 + range_ratio))  # noqa: E731 - turns a session may have
    _check_knobs(knobs, calls=lambda: num_sessions * most(), tokens=lambda: num_sessions * (
        most() * system_prompt_len
        + most() * (most() + 1) / 2 * (input_len + output_len) * (1 + range_ratio)))
    rng = np.random.default_rng(seed)
    turn_counts = uniform_lengths(turns, range_ratio, num_sessions, rng, minimum=1,
                                  name="turns")
    starts = arrival_times(num_sessions, request_rate, burstiness, rng)
    minter = IdMinter()
    system = minter.take(system_prompt_len // block_size)
    requests: list[TraceRequest] = []
    for s, n_turns in enumerate(turn_counts):
        asks = uniform_lengths(input_len, range_ratio, n_turns, rng, minimum=1,
                               name="input_len")
        answers = uniform_lengths(output_len, range_ratio, n_turns, rng, minimum=1,
                                  name="output_len")
        thinks = rng.exponential(think_time_s, n_turns) if think_time_s else np.zeros(n_turns)
        stream = TokenStream(block_size, minter, system, system_prompt_len)
        parent = None
        for k in range(n_turns):
            stream.append(int(asks[k]))
            rid = f"c{s:05d}.t{k:03d}"
            requests.append(TraceRequest(
                f"c{s:05d}", rid, parent, "main", float(thinks[k]) if k else 0.0,
                stream.tokens, int(answers[k]), stream.prompt_ids(),
                timestamp=float(starts[s]) if k == 0 else None))
            stream.append(int(answers[k]))  # the answer is in the next turn's prompt
            parent = rid
    return Trace(block_size, requests, format="labkit", source=_source("multi-turn", knobs))


def _single(rid: str, stream: TokenStream, new_tokens: int, output: int,
            stamp: float) -> TraceRequest:
    """A one-call session: the stream's prefix plus ``new_tokens`` of its own."""
    stream.append(new_tokens)
    return TraceRequest(rid, rid, None, "main", 0.0, stream.tokens, output,
                        stream.prompt_ids(), timestamp=float(stamp))


COUNTS = ("num_prompts", "num_groups", "prompts_per_group", "num_sessions", "turns")
LENGTHS = ("input_len", "output_len", "prefix_len", "system_prompt_len", "question_len")
# A bigger load than this is a file to write once, not a draw to make in memory.
MAX_LOAD_CALLS = 10**7
MAX_LOAD_IDS = 2**30  # 8 GiB of block ids


def _check_knobs(knobs: dict, calls, tokens) -> None:
    """Every knob of a generator, typed and bounded, before anything is drawn: a
    ConfigError naming the first bad one (lengths also meet `uniform_lengths`' own
    minimums). Then the load's size from the knobs: `calls`, how many requests it may
    hold, and `tokens`, how many prompt tokens all of them may hold (block ids: each
    prompt's own, a conversation's history again in every turn), ints or callables."""
    for name, value in knobs.items():
        if name in COUNTS or name in LENGTHS or name in ("block_size", "seed"):
            low = 1 if name in COUNTS or name == "block_size" else 0
            high = MAX_LOAD_CALLS if name in COUNTS else None if name == "seed" \
                else MAX_PROMPT_TOKENS
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or value < low or (high is not None and value > high):
                raise ConfigError(f"{name}={value!r} must be an integer >= {low}"
                                  + (f" and <= {high:,}" if high is not None else ""))
        elif name in ("request_rate", "burstiness"):  # inf allowed: all at once, even gaps
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not value > 0:
                raise ConfigError(f"{name}={value!r} must be a number > 0 (inf allowed)")
        elif name == "range_ratio":
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not 0.0 <= value < 1.0:
                raise ConfigError(f"range_ratio={value!r} must be in [0, 1)")
        elif name == "think_time_s":
            checks.number(name, value, low=0.0)
    calls = calls() if callable(calls) else calls
    if calls > MAX_LOAD_CALLS:
        raise ConfigError(f"this load holds up to {calls:,} calls; at most "
                          f"{MAX_LOAD_CALLS:,} are drawn at once")
    ids = tokens() / knobs["block_size"]
    if ids > MAX_LOAD_IDS:
        raise ConfigError(f"this load's prompts hold up to {ids:,.0f} block ids "
                          f"({ids * 8 / 2**30:,.0f} GiB); at most {MAX_LOAD_IDS:,} are drawn "
                          f"at once: fewer or shorter calls, or a larger block_size")


def _source(kind: str, knobs: dict) -> str:
    return f"generated({kind}, {', '.join(f'{k}={v!r}' for k, v in knobs.items())})"
