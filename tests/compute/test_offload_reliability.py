"""The disk tier never serves wrong KV and never ends a run (issue 12, items 1 and 2).

- Two engines with different weights (seeds) share one `kv_offload_dir` and run
  interleaved over the same prompts: each generates exactly its own model's tokens
  (before: block files were named by the prompt's keys alone, so one engine loaded the
  other's KV, or found its files deleted and crashed).
- A block damaged after its first check, or while the replay runs, is recomputed: the
  tokens are those of a run without tiers (before: an uncaught `TierCorruption`).
- A full or read-only directory degrades: one `TierWarning` naming the knob and the
  folder, the blocks it could not write counted in the summary, the tokens unchanged;
  `kv_offload_strict=True` stops instead. Tests run as root, where `chmod` does not stop
  writes, so these failures are injected where the store writes (`_write_all`, the
  folder's creation) with the errno the kernel would give.
"""

from __future__ import annotations

import errno
import functools
import warnings

import pytest
from compute_cases import assert_greedy, compute_engine, outputs, run_to_end

from labkit.engine.compute import disk_store, tier_bytes
from labkit.engine.compute.tier_bytes import TierCorruption, TierWarning, TierWriteError
from labkit.engine.events import StepsCompleted
from labkit.specs import get_model
from labkit.traces import TINY_AGENTX, generate_agentx_trace

GIB = 2**30
SMALL = dict(num_gpu_blocks_override=30)


def block_gib() -> float:
    eng = compute_engine("tiny-llama", "tp1")
    return eng.block_size * eng.placement.kv_bytes_per_token() / GIB


def tiers(tmp_path, **knobs) -> dict:
    gib = block_gib()
    return dict(cpu_kv_gib=6 * gib, disk_kv_gib=200 * gib, kv_offload_dir=str(tmp_path),
                **SMALL, **knobs)


@functools.cache
def trace():
    """Three tiny agentic sessions with short outputs: on 30 GPU blocks and a 6-block
    CPU tier their prefixes travel to the disk tier and back (~240 steps)."""
    return generate_agentx_trace(3, seed=3, block_size=16, **dict(
        TINY_AGENTX, output_median=6.0, output_max=24, context_window_tokens=400,
        compact_threshold_tokens=280))


def start(eng):
    eng.start_replay(trace(), concurrency=3, loop_trace=False, max_idle_s=1.0,
                     start_part_way=False)
    return eng


@functools.cache
def plain_outputs(seed: int = 0) -> dict:
    return outputs(run_to_end(start(compute_engine("tiny-llama", "tp1", seed=seed, **SMALL))))


VOCAB = get_model("tiny-llama").vocab_size
PROMPT = [(7 * i) % (VOCAB - 4) + 4 for i in range(160)]  # 10 blocks


def small_tier_engine(tmp_path, **knobs):
    """24 GPU blocks and a 4-block CPU tier: a prompt's blocks soon sit on disk."""
    gib = block_gib()
    return compute_engine("tiny-llama", "tp1", num_gpu_blocks_override=24, cpu_kv_gib=4 * gib,
                          disk_kv_gib=64 * gib, kv_offload_dir=str(tmp_path), **knobs)


def run_prompt_then_push_it_to_disk(eng, tag: str) -> None:
    eng.submit_prompt(PROMPT, 2, request_id=f"{tag}-first")
    run_to_end(eng)
    for i in range(3):  # other traffic: the prompt's blocks leave the GPU and the CPU
        eng.submit_prompt([(11 * j + i) % (VOCAB - 4) + 4 for j in range(150)], 2,
                          request_id=f"{tag}-other{i}")
        run_to_end(eng)


def test_two_engines_sharing_one_offload_dir_each_generate_their_own_tokens(tmp_path):
    """Engines with other weights (seeds 1 and 0) put the same prompt's blocks on disk
    in one kv_offload_dir, B first; B then reloads the prompt. Its tokens must be its
    own model's greedy tokens (before: A's files replaced B's under the same names and
    B served A's KV)."""
    b = small_tier_engine(tmp_path, seed=1)
    run_prompt_then_push_it_to_disk(b, "b")
    a = small_tier_engine(tmp_path, seed=0)
    run_prompt_then_push_it_to_disk(a, "a")
    for eng, tag in ((b, "b"), (a, "a")):
        eng.submit_prompt(PROMPT + [5, 6, 7], 4, request_id=f"{tag}-again")
        run_to_end(eng)
        assert eng.requests[f"{tag}-again"].num_offload_tokens > 0  # it did load
        assert assert_greedy("tiny-llama", eng) == 5
        assert eng.offload.summary()["disk_tier_corrupt_blocks"] == 0
    assert a.requests["a-again"].output_token_ids != b.requests["b-again"].output_token_ids
    # one namespace per weights identity, one locked folder per engine inside it
    spaces = sorted(tmp_path.glob("labkit-kv-*"))
    assert len(spaces) == 2 and all(len(list(s.glob("run-*"))) == 1 for s in spaces)


def test_interleaved_replays_sharing_one_offload_dir_generate_their_own_tokens(tmp_path):
    a = start(compute_engine("tiny-llama", "tp1", seed=0, **tiers(tmp_path)))
    b = start(compute_engine("tiny-llama", "tp1", seed=1, **tiers(tmp_path)))
    going = {"a": True, "b": True}
    while any(going.values()):  # step by step, in turn: both write and read the folder
        for name, eng in (("a", a), ("b", b)):
            if going[name]:
                going[name] = eng.step()
    for eng in (a, b):
        s = eng.offload.summary()
        assert s["disk_tier_hit_blocks"] > 0 and s["disk_tier_corrupt_blocks"] == 0
    assert outputs(a) == plain_outputs(0)
    assert outputs(b) == plain_outputs(1)


def test_a_block_file_from_another_namespace_fails_its_check(tmp_path):
    a = run_to_end(start(compute_engine("tiny-llama", "tp1", seed=0, **tiers(tmp_path))))
    b = compute_engine("tiny-llama", "tp1", seed=1, **tiers(tmp_path))
    disk_a, disk_b = a.data_plane.tiers.disk(0), b.data_plane.tiers.disk(0)
    key = disk_a.keys()[0]
    path = disk_b.path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(disk_a.path(key).read_bytes())  # the right name, another model's KV
    reopened = type(disk_b)(path.parent, disk_b.namespace)
    assert key in reopened and reopened.read(key) is None and not path.exists()
    assert disk_a.read(key) is not None  # in its own namespace it is fine


def damage(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_block_damaged_after_its_first_check_is_recomputed(tmp_path):
    """The file passes the check made when its load is offered, then is damaged before
    the load starts: the load stops before it and the rest is recomputed."""
    eng = small_tier_engine(tmp_path)
    run_prompt_then_push_it_to_disk(eng, "p")
    disk = eng.data_plane.tiers.disk(0)
    checked = eng.offload.intact
    damaged = []

    def check_then_damage(store, key):
        ok = checked(store, key)
        if ok and not damaged:  # the first block checked goes bad right after its check
            damage(disk.path(key))
            damaged.append(key)
        return ok

    eng.offload.intact = check_then_damage
    eng.submit_prompt(PROMPT + [5, 6, 7], 3, request_id="again")
    run_to_end(eng)
    assert damaged and eng.offload.summary()["disk_tier_corrupt_blocks"] == 1
    assert assert_greedy("tiny-llama", eng) == 5


def test_blocks_damaged_while_a_replay_runs_are_recomputed(tmp_path):
    """Every disk block goes bad right after a load offer checked it, while the replay
    runs: every load from disk is refused when it starts, and the replay still
    generates its tokens."""
    eng = start(compute_engine("tiny-llama", "tp1", **tiers(tmp_path)))
    disk, checked, passed = eng.data_plane.tiers.disk(0), eng.offload.intact, []

    def check_then_damage(store, key):
        ok = checked(store, key)
        if ok:
            damage(disk.path(key))
            passed.append(key)
        return ok

    eng.offload.intact = check_then_damage
    run_to_end(eng)
    assert passed
    s = eng.offload.summary()
    assert s["disk_tier_corrupt_blocks"] > 0 and s["disk_tier_hit_blocks"] == 0
    assert outputs(eng) == plain_outputs(0)


def failing_writes(after: int, code: int):
    """`_write_all` that works `after` times, then fails as a full or read-only disk."""
    real, calls = disk_store._write_all, []

    def write_all(fd, data):
        calls.append(1)
        if len(calls) > after:
            raise OSError(code, __import__("os").strerror(code))
        real(fd, data)
    return write_all


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_disk_that_fills_up_degrades_with_one_warning(tmp_path, monkeypatch, code):
    # each block file takes two writes (header, payload): 45 blocks fit, then none
    monkeypatch.setattr(disk_store, "_write_all", failing_writes(90, code))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = run_to_end(start(compute_engine("tiny-llama", "tp1", **tiers(tmp_path))))
    said = [w for w in caught if issubclass(w.category, TierWarning)]
    assert len(said) == 1
    text = str(said[0].message)
    assert "kv_offload_dir" in text and str(tmp_path) in text and "kv_offload_strict" in text
    s = eng.offload.summary()
    assert s["disk_tier_unwritable_blocks"] > 0
    assert s["disk_tier_hit_blocks"] > 0  # what was written before keeps being served
    assert outputs(eng) == plain_outputs(0)
    # the tier's index and the files agree: nothing unwritten is believed stored
    store = eng.offload.stores[0]
    assert sorted(eng.data_plane.tiers.disk(0).keys()) == \
        sorted(store.tiers[1].policy.resident())


def test_a_read_only_offload_dir_degrades_to_the_cpu_tier(tmp_path, monkeypatch):
    class ReadOnly:
        def __init__(self, root, identity):
            raise OSError(errno.EROFS, "Read-only file system", str(root))

    monkeypatch.setattr(tier_bytes, "EngineFolder", ReadOnly)
    with pytest.warns(TierWarning, match="Read-only file system"):
        eng = run_to_end(start(compute_engine("tiny-llama", "tp1", **tiers(tmp_path))))
    s = eng.offload.summary()
    assert s["disk_tier_unwritable_blocks"] > 0 and s["disk_tier_hit_blocks"] == 0
    assert not eng.offload.stores[0].tiers[1].policy.resident()  # nothing believed on disk
    assert outputs(eng) == plain_outputs(0)


def test_strict_mode_stops_instead(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_store, "_write_all", failing_writes(10, errno.ENOSPC))
    with pytest.raises(TierWriteError, match="kv_offload_strict"):
        run_to_end(start(compute_engine("tiny-llama", "tp1", kv_offload_strict=True,
                                        **tiers(tmp_path / "a"))))
    monkeypatch.undo()
    eng = start(compute_engine("tiny-llama", "tp1", kv_offload_strict=True,
                               **tiers(tmp_path / "b")))
    eng.events.subscribe(lambda e: [damage(p) for p in eng.data_plane.tiers.disk(0)
                                    .directory.glob("*.kvb")], StepsCompleted)
    with pytest.raises(TierCorruption, match="kv_offload_strict"):
        run_to_end(eng)
