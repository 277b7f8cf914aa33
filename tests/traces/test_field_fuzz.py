"""Hostile field values in every JSON trace format are refused with a TraceError, or
loaded and described — never another exception, a gigabyte allocation or a hang. The
same for the knobs of the trace generators (ConfigError).

A fixed-seed fuzzer: a field of a valid file (labkit, Mooncake, Bailian, AgentX; any
depth, list items too) gets a value from a hostile list (huge and negative integers,
floats, strings, null, booleans, lists, objects), then the file is loaded (its format
named or detected) and `trace_stats` run. It found two bugs (session 32): a damaged
token count in a call without hash_ids had ids minted for it (MemoryError, AgentX and
Bailian), and a Bailian chat that is its own parent raised KeyError. On the
generators: TypeErrors for knobs of the wrong type, and MemoryErrors for sizes no
memory holds (1e12 prompts, a 1e300-token shared prefix).
"""
from __future__ import annotations

import copy
import json
import random
import resource

import pytest

from labkit.errors import ConfigError
from labkit.traces import (
    TINY_AGENTX, TraceError, generate_agentx_trace, load_trace, trace_stats, write_trace)

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"
HOSTILE = [10**30, 2**63, 2**63 - 1, 2**62, 2**40, 2**33, -1, -2**63, 0, 1e308, 1.5, -0.0,
           "x", "", None, True, False, [], {}, [1, [2]], {"a": 1}, "NaN", 1e-300, 3.0,
           2**53 + 1, -1, -1, 10, 12]
MOONCAKE = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 27482, "input_length": 1100, "output_length": 5,
             "hash_ids": [1, 3, 4]}]


def _documents(tmp_path) -> list[tuple[str, list, bool]]:
    """(format, its objects, written as one indented document?)"""
    labkit = tmp_path / "labkit.jsonl"
    write_trace(generate_agentx_trace(2, seed=0, block_size=16, **TINY_AGENTX), labkit)
    lines = labkit.read_text().splitlines()[:6]
    return [("labkit", [json.loads(x) for x in lines], False),
            ("mooncake", MOONCAKE, False),
            ("bailian", [json.loads(x) for x in (FIXTURES / "bailian.jsonl").read_text()
                         .splitlines() if x.strip()], False),
            ("agentx", [json.loads((FIXTURES / "agentx.json").read_text())], True),
            ("agentx", [json.loads(x) for x in (FIXTURES / "agentx_many.jsonl").read_text()
                        .splitlines() if x.strip()], False)]


def _damage(objects: list, rng: random.Random) -> None:
    """Set a hostile value on a random key of a random object, or in an id list."""
    found: list[dict] = []

    def walk(node):
        if isinstance(node, dict):
            found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objects)
    target = rng.choice(found)
    if not target:
        return
    key = rng.choice(list(target))
    value = copy.deepcopy(rng.choice(HOSTILE))
    if isinstance(target[key], list) and target[key] and rng.random() < 0.5:
        target[key][rng.randrange(len(target[key]))] = value
    else:
        target[key] = value


@pytest.fixture
def bounded_memory():
    """A 4 GiB address-space limit: a runaway allocation fails here, not the machine."""
    before = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, before[1]))
    yield
    resource.setrlimit(resource.RLIMIT_AS, before)


def test_hostile_field_values_are_trace_errors(tmp_path, bounded_memory):
    rng = random.Random(32)
    documents = _documents(tmp_path)
    path = tmp_path / "t.json"
    loaded = refused = 0
    for _ in range(1500):
        fmt, objects, indented = rng.choice(documents)
        objects = copy.deepcopy(objects)
        for _ in range(rng.randint(1, 2)):
            _damage(objects, rng)
        path.write_text(json.dumps(objects[0], indent=1) if indented
                        else "\n".join(json.dumps(o) for o in objects))
        try:
            trace_stats(load_trace(path, format=rng.choice([fmt, "auto"])))
            loaded += 1
        except (TraceError, ConfigError):
            refused += 1
    assert loaded > 50 and refused > 50


def test_hostile_generator_knobs_are_config_errors(bounded_memory):
    import dataclasses
    import inspect

    from labkit.traces import (
        AgentXParams, generate_agentx_trace, generate_multi_turn_trace, generate_random_trace,
        generate_shared_prefix_trace)

    values = [0, -1, 1, 2, 3, 64, 10**12, 0.5, -0.5, 1e300, float("nan"), float("inf"),
              True, "x", None]
    agentx = [f.name for f in dataclasses.fields(AgentXParams)]
    small = {generate_random_trace: {"num_prompts": 5},
             generate_shared_prefix_trace: {"num_groups": 2, "prompts_per_group": 2},
             generate_multi_turn_trace: {"num_sessions": 3}}
    rng = random.Random(7)
    made = refused = 0
    for _ in range(400):
        if rng.random() < 0.4:
            make, names, knobs = generate_agentx_trace, agentx, {}
            args = (rng.choice([1, 2]),)
        else:
            make = rng.choice(list(small))
            names = [p for p in inspect.signature(make).parameters if p != "seed"]
            knobs, args = dict(small[make]), ()
        knobs.update({k: rng.choice(values) for k in rng.sample(names, rng.randint(1, 3))})
        try:
            trace_stats(make(*args, **knobs))
            made += 1
        except (ConfigError, TraceError):
            refused += 1
    assert made > 30 and refused > 200
