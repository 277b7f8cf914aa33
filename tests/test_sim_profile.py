"""The component clock (`labkit.sim_profile`): exclusive times that add up, wrappers
that change nothing and are removed afterwards."""

import time

from labkit import Engine, generate_agentx_trace
from labkit.bench_sim import _identical
from labkit.engine.kv.block_pool import BlockPool
from labkit.engine import instance as instance_module
import sys

from labkit.sim_profile import call_counter, component_clock


def _busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


class Toy:
    def outer(self):
        _busy(0.03)
        self.inner()
        self.inner()

    def inner(self):
        _busy(0.02)


TOY = [(__name__, "Toy", ("outer", "inner"), "toy")]


def test_a_caller_is_not_charged_for_the_wrapped_methods_it_calls():
    with component_clock(TOY) as clock:
        Toy().outer()
    df = clock.frame().set_index("component")
    assert df.loc["Toy.inner", "calls"] == 2 and df.loc["Toy.outer", "calls"] == 1
    # inclusive, outer would be ~0.07 s; exclusive it keeps its own ~0.03 s
    assert 0.025 <= df.loc["Toy.outer", "cpu_s"] < 0.05
    assert 0.035 <= df.loc["Toy.inner", "cpu_s"] < 0.06
    assert abs(df["share"].sum() - 1.0) < 1e-9


def _replay():
    engine = Engine(model="qwen3-30b-a3b", layout="dp4", hardware="h200",
                    max_model_len=262144)
    trace = generate_agentx_trace(24, seed=3, context_window_tokens=200_000,
                                  compact_threshold_tokens=167_000)
    t0 = time.process_time()
    result = engine.replay(trace, concurrency=8, duration_s=60, start_part_way=False)
    return result, time.process_time() - t0


def test_the_clock_changes_no_result_and_its_parts_add_up_to_the_replay():
    original_allocate = BlockPool.__dict__["allocate"]
    original_plan = instance_module.plan_decode_run
    plain, _ = _replay()
    with component_clock() as clock:
        timed, cpu = _replay()
        assert BlockPool.__dict__["allocate"] is not original_allocate  # wrapped meanwhile
    assert _identical(plain, timed)
    # restored afterwards, the module-level function too
    assert BlockPool.__dict__["allocate"] is original_allocate
    assert instance_module.plan_decode_run is original_plan
    df = clock.frame().set_index("component")
    assert (df["cpu_s"] >= 0).all()
    # exclusive times add up to Engine.replay's inclusive time: at most what the
    # process spent around it, and not much less
    assert 0.8 * cpu <= df["cpu_s"].sum() <= cpu * 1.001 + 1e-3
    assert df.loc["Engine.replay", "calls"] == 1
    for part in ("BlockPool.allocate", "BlockPool.cache_blocks", "plan_decode_run",
                 "DecodeRun.play", "LayerStepModel.step_timing", "Scheduler.schedule"):
        assert df.loc[part, "calls"] > 0, part
    assert df.loc["Engine._arrive", "calls"] == len(timed.requests)  # one per call


def test_a_part_that_does_not_exist_fails_and_leaves_nothing_wrapped():
    original = Toy.__dict__["outer"]
    parts = [(__name__, "Toy", ("outer", "no_such_method"), "toy")]
    try:
        with component_clock(parts):
            raise AssertionError("the clock should not have started")
    except KeyError:
        pass
    assert Toy.__dict__["outer"] is original


def _leaf(xs):
    return len(xs)


def _caller(n):
    for _ in range(n):
        _leaf([1, 2])
    return sorted([3, 1])


def test_the_call_counter_counts_each_call_and_puts_the_profiler_back():
    before = sys.getprofile()
    with call_counter() as counter:
        _caller(7)
        _caller(5)
    assert sys.getprofile() is before
    df = counter.frame()
    python = dict(zip(df.loc[df["kind"] == "python", "function"],
                      df.loc[df["kind"] == "python", "calls"]))
    name = lambda fn: f"{__file__}:{fn.__code__.co_firstlineno} {fn.__qualname__}"
    assert python[name(_leaf)] == 12 and python[name(_caller)] == 2
    builtin = dict(zip(df.loc[df["kind"] == "builtin", "function"],
                       df.loc[df["kind"] == "builtin", "calls"]))
    assert builtin["builtins.len"] == 12 and builtin["builtins.sorted"] == 2
    # nothing counted once the block is over
    _caller(3)
    assert counter.frame()["calls"].sum() == df["calls"].sum()


def test_the_same_replay_makes_the_same_calls():
    """What makes the count worth having: no noise. (A first replay loads the compiled
    loops and lazy modules; the two counted ones come after it.)"""
    _replay()
    counts = []
    for _ in range(2):
        with call_counter() as counter:
            _replay()
        df = counter.frame()
        counts.append(df.set_index(["kind", "function"])["calls"])
    assert counts[0].sum() > 10_000
    assert counts[0].equals(counts[1])
