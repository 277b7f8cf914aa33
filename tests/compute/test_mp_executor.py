"""Ranks as processes compute exactly what ranks as threads compute.

The same requests as test_runner_layouts (a shared prefix hit in the prefix cache,
chunked prompts, speculative decoding) run with `executor="threads"` — the in-process
cluster, itself checked against one device — and with `executor="mp"`: one process per
GPU, collectives over gloo. Reductions add in member order in both, so every logits row
must be bit-identical, and so must the tokens. A worker killed mid-run makes the driver
raise a one-line error and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from compute_cases import (
    compute_engine, logits_by_row, outputs, replay_agentic, run_to_end,
    shared_prefix_prompts, submit_prompts)

from labkit.engine.compute.mp_executor import WorkerDied
from labkit.engine.engine import Engine
from labkit.errors import ConfigError
from labkit.specs import get_model
from labkit.traces import TINY_AGENTX, generate_agentx_trace

CASES = [("tiny-llama", "tp2"), ("tiny-deepseek-v3", "dcp2"), ("tiny-qwen3-moe", "dep2"),
         ("tiny-llama", "tp2xpp2"),  # 4 processes
         pytest.param("tiny-deepseek-v3", "tp2xpcp2xdcp2", marks=pytest.mark.slow)]


def scenario(model: str, layout: str, executor: str):
    eng = compute_engine(model, layout, num_speculative_tokens=2, max_num_batched_tokens=32,
                         executor=executor)
    try:
        submit_prompts(eng, shared_prefix_prompts(get_model(model).vocab_size), max_tokens=6)
        return run_to_end(eng)
    finally:
        eng.data_plane.close()


@pytest.mark.parametrize("model,layout", CASES)
def test_processes_match_threads(model, layout):
    threads = scenario(model, layout, "threads")
    procs = scenario(model, layout, "mp")
    assert outputs(procs) == outputs(threads)
    assert len(outputs(procs)) == 3
    a, b = logits_by_row(threads), logits_by_row(procs)
    assert a.keys() == b.keys() and len(a) >= 20
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not dist.is_initialized()  # closing the plane released the process group


def test_executor_knob_is_checked():
    with pytest.raises(ConfigError, match=r"unknown executor 'fork'; allowed: threads, mp"):
        compute_engine("tiny-llama", "tp2", executor="fork")
    with pytest.raises(ConfigError, match="executor only appl"):
        Engine(model="tiny-llama", layout="tp2", executor="mp")


def test_killed_worker_stops_the_run():
    eng = compute_engine("tiny-llama", "tp4", max_num_batched_tokens=32, executor="mp")
    procs = list(eng.data_plane.executor.procs)
    assert len(procs) == 4 and all(p.is_alive() for p in procs)  # procs[g]: GPU g
    submit_prompts(eng, shared_prefix_prompts(get_model("tiny-llama").vocab_size),
                   max_tokens=20)
    for _ in range(3):
        eng.step()
    os.kill(procs[2].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"GPU 2 \(pid \d+\) died \(killed by SIGKILL\)"):
        run_to_end(eng)
    assert time.monotonic() - start < 20
    assert all(p.exitcode is not None for p in procs)  # no orphans: all were reaped
    assert not dist.is_initialized()
    eng.data_plane.close()  # closing a failed plane is harmless


def test_the_first_death_is_named_not_a_worker_the_watchdog_killed_after_it():
    """The watchdog records the first worker to die, then kills the others. A driver
    that scans the workers after that sees GPU 0 dead too; it must still name GPU 1."""
    from types import SimpleNamespace

    from labkit.engine.compute.mp_executor import ProcessExecutor

    executor = object.__new__(ProcessExecutor)
    executor.procs = [SimpleNamespace(pid=10, exitcode=-9), SimpleNamespace(pid=11, exitcode=-9)]
    executor._dead = (1, 11, -9)  # what the watchdog saw first
    assert executor._first_dead(wait_s=0.0) == (1, 11, -9)
    executor._dead = None  # no watchdog report yet: the scan decides
    assert executor._first_dead(wait_s=0.0) == (0, 10, -9)


def agentic(executor: str):
    eng = compute_engine("tiny-qwen3-moe", "dep2", executor=executor)
    try:
        trace = generate_agentx_trace(3, seed=1, block_size=16, **TINY_AGENTX)
        return eng.replay(trace, concurrency=3, loop_trace=False, max_idle_s=1.0,
                          start_part_way=False).requests
    finally:
        eng.data_plane.close()


def test_agentic_replay_with_kv_fetched_across_processes():
    """Sessions move between the DP ranks of dep2: their KV is sent from one process to
    another (`move_blocks`) and the tokens stay those of the thread run."""
    threads, procs = agentic("threads"), agentic("mp")
    assert procs.fetched_tokens.sum() > 0  # some KV crossed between DP ranks
    assert threads.output_token_ids.map(list).tolist() == \
        procs.output_token_ids.map(list).tolist()


def offloaded(layout: str, executor: str, folder):
    """The shorter agentic trace on its 24 GPU blocks, with a 12-block CPU tier and a
    disk tier: prefixes go down to the host and to files, and come back."""
    eng = compute_engine("tiny-llama", layout, executor=executor)
    gib = eng.block_size * eng.placement.kv_bytes_per_token() / 2**30
    eng.data_plane.close()
    eng, _ = replay_agentic("tiny-llama", layout, short=True, executor=executor,
                            cpu_kv_gib=12 * gib, disk_kv_gib=200 * gib,
                            kv_offload_dir=str(folder))
    eng.data_plane.close()
    return eng


@pytest.mark.parametrize("layout", ["dp2", pytest.param("tp2", marks=pytest.mark.slow)])
def test_offload_tiers_with_processes_give_the_threads_tokens(layout, tmp_path):
    """With `executor="mp"` the tier moves reach the ranks as step commands: each
    process reads and writes its own GPU's slice of a block (dp2: a block stored from
    one DP rank's process is loaded into the other's). Same tokens as threads, and
    blocks really came back from both tiers."""
    threads = offloaded(layout, "threads", tmp_path / "threads")
    procs = offloaded(layout, "mp", tmp_path / "mp")
    stats = procs.offload.summary()
    assert stats["cpu_tier_hit_blocks"] > 0 and stats["disk_tier_hit_blocks"] > 0
    assert stats == threads.offload.summary()
    assert outputs(procs) == outputs(threads)
    assert not dist.is_initialized()


@pytest.mark.parametrize("model,layout", [("tiny-llama", "tp2xpp2"), ("tiny-qwen3-moe", "dep2")])
def test_a_process_makes_only_its_own_shard(model, layout):
    """Seeded weights (`RankPlan.source`) are made only where a GPU slices from them
    (its stage's layers, its experts): fewer tensors than the whole model, and the rank
    built from them holds exactly the tensors of a rank cut from the whole model."""
    from labkit.engine.compute.executors import RankPlan
    from labkit.engine.compute.mesh import Mesh
    from labkit.engine.compute.models.weights import init_weights
    from labkit.engine.compute.rank_weights import rank_weights

    eng = compute_engine(model, layout)
    plane = eng.data_plane
    plan = RankPlan(plane.spec, plane.layout, eng.config, 4, eng.block_size, plane.device,
                    plane.dtype)
    full = init_weights(plane.spec, eng.config.seed, plane.dtype)
    for place in Mesh(plane.layout, plane.spec).places:
        source, made = plan.source(), []
        read = source.read
        source.read = (lambda name, part=None, read=read, made=made:
                       made.append(name) or read(name, part))
        mine = rank_weights(plane.spec, source, place, plane.layout)
        assert 0 < len(set(made)) < len(full)
        want = rank_weights(plane.spec, full, place, plane.layout)
        assert mine.keys() == want.keys()
        for layer in want:
            assert mine[layer].keys() == want[layer].keys()
            assert all(torch.equal(mine[layer][k], want[layer][k]) for k in want[layer])
    plane.close()


def test_worker_processes_hold_their_shards_bytes():
    """Under mp each process's weights take exactly the bytes of the same GPU's rank
    under threads (built by slicing the whole model)."""
    from labkit.engine.compute.executors import weight_nbytes

    sizes = {}
    for executor in ("threads", "mp"):
        plane = compute_engine("tiny-llama", "pp2", executor=executor).data_plane
        sizes[executor] = plane.executor.run(weight_nbytes, [(), ()], [0, 1])
        plane.close()
    assert sizes["mp"] == sizes["threads"] and min(sizes["mp"]) > 0
