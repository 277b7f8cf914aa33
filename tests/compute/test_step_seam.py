"""The seam between the planes: one picklable message per step, and no way back.

A data plane must hold no reference to the control plane's objects (KV managers,
schedulers, instances, the engine, requests): everything it needs arrives in the
`StepInput`. These tests walk a running data plane's object graph for such references,
check that each step's message survives pickling, and that its tables are the KV
manager's at that step.
"""

from __future__ import annotations

import functools
import pickle
import sys
import types

import numpy as np
import torch

from compute_cases import compute_engine, run_to_end, shared_prefix_prompts, submit_prompts
from labkit.engine.engine import Engine
from labkit.engine.instance import Instance
from labkit.engine.kv.kv_manager import KVManager
from labkit.engine.request import Request
from labkit.engine.scheduler import Scheduler
from labkit.engine.step_io import Release, RestoreState, SaveState, StepInput
from labkit.specs import get_model

CONTROL = (KVManager, Scheduler, Instance, Engine, Request)


def control_refs(root, kinds: tuple = CONTROL, stop: tuple = ()) -> list[str]:
    """Paths from `root` to objects of `kinds` (the control plane's, unless told):
    through attributes, slots, containers, bound methods, partials and closures
    (tensors are leaves; objects of `stop` are not entered)."""
    found, seen, todo = [], set(), [(root, "root")]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.append(f"{path}: {type(obj).__name__}")
            continue
        if isinstance(obj, (torch.Tensor, np.ndarray, str, bytes, int, float, type,
                            types.ModuleType, *stop)):
            continue
        children = []
        if isinstance(obj, dict):
            children = [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif isinstance(obj, types.MethodType):
            children = [(obj.__self__, f"{path}.__self__")]
        elif isinstance(obj, functools.partial):
            children = [(obj.func, f"{path}.func"), (obj.args, f"{path}.args")]
        elif isinstance(obj, types.FunctionType):
            cells = obj.__closure__ or ()
            children = [(c.cell_contents, f"{path}.<closure>") for c in cells]
        else:
            attrs = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        attrs[name] = getattr(obj, name)
            children = [(v, f"{path}.{k}") for k, v in attrs.items()]
        todo.extend(children)
    return found


def test_the_walk_finds_a_reference_hidden_in_a_closure():
    """The check itself can fail: a callback into a KV manager is found."""
    eng = compute_engine("tiny-llama", "tp1")
    kv = eng.schedulers[0].kv

    class Plane:
        def __init__(self):
            self.hooks = {"table": lambda dp: kv}

    assert control_refs(Plane()) == ["root.hooks['table'].<closure>: KVManager"]
    eng.data_plane.close()


def record_steps(eng: Engine) -> list[tuple[StepInput, list]]:
    """Each step's message as the plane received it (pickled there and then), with
    the KV manager's tables of that moment."""
    seen, execute = [], eng.data_plane.execute

    def spy(step):
        tables = [[eng.schedulers[r.rank].kv.table(rid).tolist() for rid in r.request_ids]
                  for r in step.ranks]
        seen.append((pickle.dumps(step), tables))
        return execute(step)

    eng.data_plane.execute = spy
    return seen


def test_a_hybrid_runs_through_messages_only():
    """Kimi-Linear with prefix reuse (state snapshots saved and restored) and a sliding
    window-free pool: each step's message pickles, carries the KV manager's block
    tables and the prompt's tokens, and the commands travel in it; the plane holds no
    control-plane object."""
    spec = get_model("tiny-kimi-linear")
    eng = compute_engine("tiny-kimi-linear", "tp2")
    prompts = shared_prefix_prompts(spec.vocab_size, prefix=40)
    submit_prompts(eng, prompts, max_tokens=4, gap_s=1.0)  # one after the other: hits
    seen = record_steps(eng)
    run_to_end(eng)
    del eng.data_plane.execute  # (the spy)
    assert control_refs(eng.data_plane) == []
    commands = []
    for blob, tables in seen:
        step = pickle.loads(blob)
        commands += step.commands
        for r, want in zip(step.ranks, tables):
            assert [t.tolist() for t in r.block_tables] == want
            for rid, ctx, n, decode, new in zip(r.request_ids, r.contexts, r.num_new_tokens,
                                                r.is_decode, r.token_ids):
                if not decode:
                    assert new == eng.requests[rid].token_ids[ctx:ctx + n]
    kinds = {type(c) for c in commands}
    assert {SaveState, RestoreState, Release} <= kinds
    released = [c.request_id for c in commands if isinstance(c, Release)]
    assert released == sorted(set(released), key=released.index)  # each call once
    eng.data_plane.close()


def test_fetched_kv_travels_as_a_copy_command():
    """dp2 with session KV fetched across DP ranks: the copies are commands in the
    messages, and the plane still holds nothing of the control plane."""
    from compute_cases import agentic_trace

    eng = compute_engine("tiny-llama", "dp2", router="least_loaded",
                         num_gpu_blocks_override=30)
    seen = record_steps(eng)
    eng.replay(agentic_trace(3), concurrency=4, loop_trace=False, max_idle_s=1.0,
               start_part_way=False)
    del eng.data_plane.execute
    copies = [c for blob, _ in seen for c in pickle.loads(blob).commands
              if type(c).__name__ == "CopyBlocks"]
    fetched = sum(r.num_fetched_tokens for r in eng.requests.values())
    assert fetched > 0 and copies
    assert all(c.src_dp != c.dst_dp and len(c.src_blocks) == len(c.dst_blocks)
               for c in copies)
    assert control_refs(eng.data_plane) == []
    eng.data_plane.close()


def test_the_simulated_planes_hold_nothing_of_the_control_plane():
    """The sim plane (with HiSparse's copies, and with offload tiers) sees the same
    messages: they pickle, name the scheduled requests, and carry no tables."""
    from support import small_agentx

    trace = small_agentx(sessions=3)
    for knobs in ({"hisparse_buffer_tokens": 4096, "model": "deepseek-v3.2",
                   "layout": "dcp8", "kv_cache_dtype": "fp8"},
                  {"cpu_kv_gib": 1, "num_gpu_blocks_override": 2000, "model": "llama-3.1-8b"}):
        eng = Engine(**knobs)
        seen = record_steps(eng)
        eng.replay(trace, concurrency=3, duration_s=20.0)
        del eng.data_plane.execute
        assert seen and control_refs(eng.data_plane) == []
        for blob, tables in seen:
            step = pickle.loads(blob)
            assert all(r.block_tables is None and r.token_ids is None for r in step.ranks)
            assert all(rid in eng.requests for r in step.ranks for rid in r.request_ids)
            assert [len(t) for t in tables] == [len(r) for r in step.ranks]


def test_offload_tier_moves_travel_as_commands(tmp_path):
    """cpu and disk tiers on the compute plane: the moves reach the plane as TierMoves
    commands (with a step, or delivered at once when they write files), the plane's
    reports name each file it wrote, and neither plane holds the other's objects: the
    plane nothing of the control plane, the offload nothing of the plane's bytes."""
    from compute_cases import agentic_trace

    from labkit.engine.compute.tier_bytes import TierBytes
    from labkit.engine.step_io import DiskWrite, TierMoves

    eng = compute_engine("tiny-llama", "tp1", num_gpu_blocks_override=30)
    gib = eng.block_size * eng.placement.kv_bytes_per_token() / 2**30
    eng = compute_engine("tiny-llama", "tp1", num_gpu_blocks_override=30,
                         cpu_kv_gib=12 * gib, disk_kv_gib=200 * gib,
                         kv_offload_dir=str(tmp_path))
    seen = record_steps(eng)
    applied, apply = [], eng.data_plane.apply

    def spy_apply(commands):
        applied.append((list(commands), reports := apply(commands)))
        return reports

    eng.data_plane.apply = spy_apply
    eng.replay(agentic_trace(3), concurrency=4, loop_trace=False, max_idle_s=1.0,
               start_part_way=False)
    del eng.data_plane.execute, eng.data_plane.apply
    in_steps = [c for blob, _ in seen for c in pickle.loads(blob).commands
                if isinstance(c, TierMoves)]
    at_once = [c for commands, _ in applied for c in commands if isinstance(c, TierMoves)]
    moves = [m for c in in_steps + at_once for m in c.moves]
    kinds = {m.kind for m in moves}
    assert {"store", "demote", "load"} <= kinds
    assert eng.offload.summary()["disk_tier_hit_blocks"] > 0
    # every demote was delivered at once, and its file reported back
    written = [r for _, reports in applied for r in reports if isinstance(r, DiskWrite)]
    demotes = [m for c in at_once for m in c.moves if m.kind == "demote"]
    assert demotes and len(written) == len(demotes) == \
        sum(m.kind == "demote" for m in moves)
    assert all(r.path and len(r.digest) == 32 for r in written)
    assert control_refs(eng.data_plane) == []
    outbox = eng.offload.outbox
    plane_side = (type(eng.data_plane), TierBytes, torch.Tensor)
    # (the engine and its instances own the plane, to execute steps; the outbox is the
    # way commands go)
    assert control_refs(eng.offload, plane_side, stop=(type(outbox), Engine, Instance)) == []
    eng.data_plane.close()


def test_a_pd_hand_over_travels_as_commands(monkeypatch):
    """P/D on the compute plane: the KV crosses as an ExportKV carried out by the
    prefill side's plane and an ImportKV in the decode side's step messages; the
    conversion (kv_convert) runs only inside the planes' `apply`, never called by the
    control plane."""
    from compute_cases import FixedStepCost, agentic_trace

    from labkit.engine.compute import kv_convert
    from labkit.engine.disagg import PDEngine
    from labkit.engine.step_io import ImportKV

    callers = []

    def spying(real):
        def spy(*args, **kw):
            frame = sys._getframe(1)
            while frame.f_code.co_filename == kv_convert.__file__:
                frame = frame.f_back
            callers.append(frame.f_code.co_name)  # who asked kv_convert
            return real(*args, **kw)
        return spy

    for name in ("export_kv", "import_kv"):
        monkeypatch.setattr(kv_convert, name, spying(getattr(kv_convert, name)))
    pd = PDEngine("tiny-llama", "pcp2", "tp2", backend="compute", cost_model=FixedStepCost(),
                  clock="predicted", num_gpu_blocks_override=60)
    seen = record_steps(pd.decode[0])
    pd.replay(agentic_trace(3), concurrency=4, loop_trace=False, max_idle_s=1.0,
              start_part_way=False)
    del pd.decode[0].data_plane.execute  # (the spy)
    imports = [c for blob, _ in seen for c in pickle.loads(blob).commands
               if isinstance(c, ImportKV)]
    assert len(pd.transfers) >= 3 and len(imports) == len(pd.transfers)
    assert callers == ["apply"] * (2 * len(pd.transfers))
    for e in (*pd.prefill, *pd.decode):
        assert control_refs(e.data_plane) == []
        e.data_plane.close()
