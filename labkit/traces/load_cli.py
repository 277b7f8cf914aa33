"""`labkit trace gen`'s flags: `--kind random|shared-prefix|multi-turn` loads, and
the AgentX generator's `--param NAME=VALUE` knobs.

The load flags carry the generator arguments' names (``--num-prompts``,
``--request-rate``, ``--burstiness``, ``--input-len``, ``--output-len``,
``--range-ratio``, ...: ``vllm bench serve``'s, and inference-perf's for the shared
prefix). Each kind takes only its own: a flag another kind owns is an error naming
the kinds it belongs to, before anything is generated. Flags left out take the
generator's defaults (see ``loads.py``).
"""
from __future__ import annotations

import inspect

from labkit.errors import ConfigError
from labkit.traces.loads import (
    generate_multi_turn_trace, generate_random_trace, generate_shared_prefix_trace)
from labkit.traces.schema import Trace

GENERATORS = {"random": generate_random_trace, "shared-prefix": generate_shared_prefix_trace,
              "multi-turn": generate_multi_turn_trace}
# flag -> (generator argument, type, help); --sessions, --seed, --block-size exist already
LOAD_FLAGS = {
    "--num-prompts": ("num_prompts", int, "requests (random)"),
    "--request-rate": ("request_rate", float, "requests/s (sessions/s for multi-turn); "
                                              "default inf: all at t=0"),
    "--burstiness": ("burstiness", float, "gamma shape of the gaps: 1 Poisson, <1 burstier"),
    "--input-len": ("input_len", int, "prompt tokens (multi-turn: new tokens per turn)"),
    "--output-len": ("output_len", int, "output tokens"),
    "--range-ratio": ("range_ratio", float, "lengths uniform in [L(1-r), L(1+r)], r in [0,1)"),
    "--prefix-len": ("prefix_len", int, "tokens every prompt starts with (random)"),
    "--num-groups": ("num_groups", int, "system prompts (shared-prefix)"),
    "--prompts-per-group": ("prompts_per_group", int, "questions per system prompt"),
    "--system-prompt-len": ("system_prompt_len", int, "tokens of a system prompt"),
    "--question-len": ("question_len", int, "tokens of a question (shared-prefix)"),
    "--turns": ("turns", int, "turns per session (multi-turn)"),
    "--think-time-s": ("think_time_s", float, "mean user think time between turns"),
}


def add_load_flags(gen) -> None:
    group = gen.add_argument_group("benchmark loads (--kind random, shared-prefix, multi-turn)")
    for flag, (dest, kind, text) in LOAD_FLAGS.items():
        group.add_argument(flag, dest=dest, type=kind, default=None, help=text)


def given_load_flags(args) -> list[str]:
    return [flag for flag, (dest, _, _) in LOAD_FLAGS.items() if getattr(args, dest) is not None]


def generate_load(args) -> Trace:
    """The trace of ``--kind`` from the flags given (ConfigError for a foreign flag)."""
    make = GENERATORS[args.kind]
    accepted = set(inspect.signature(make).parameters)
    knobs = {"seed": args.seed}
    if args.block_size is not None:
        knobs["block_size"] = args.block_size
    if args.sessions is not None:
        if "num_sessions" not in accepted:
            raise ConfigError(f"--sessions is not a knob of --kind {args.kind}")
        knobs["num_sessions"] = args.sessions
    for flag, (dest, _, _) in LOAD_FLAGS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if dest not in accepted:
            owners = [k for k, g in GENERATORS.items()
                      if dest in inspect.signature(g).parameters]
            raise ConfigError(f"{flag} is not a knob of --kind {args.kind} "
                              f"(it is of {', '.join(owners)})")
        knobs[dest] = value
    return make(**knobs)


def generator_params(pairs: list[str]) -> dict:
    """`--param NAME=VALUE` pairs as AgentXParams knobs, typed (ConfigError naming a bad
    one)."""
    from dataclasses import fields

    from labkit.traces import AgentXParams

    known = {f.name: f.type for f in fields(AgentXParams)}
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in known:
            raise ConfigError(f"--param {pair!r}: expected NAME=VALUE with NAME one of "
                              f"{', '.join(known)}")
        kind = known[name] if not isinstance(known[name], str) else eval(known[name])
        try:
            params[name] = kind(value)
        except ValueError:
            raise ConfigError(f"--param {pair!r}: {value!r} is not a {kind.__name__}") from None
    return params
