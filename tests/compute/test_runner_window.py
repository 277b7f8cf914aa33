"""Sliding-window attention on the compute plane (tiny-gpt-oss: layer 0 slides, W = 24).

The sliding layer keeps its KV in a second table per request whose blocks the KV
manager frees as the window moves and hands to anyone. Two scenarios:

- shared-prefix prompts longer than the window, chunked by a small token budget, with
  speculative decoding: every logits row of one device matches a whole-sequence
  recomputation of the reference model (whose sliding layer masks keys W or more
  positions back), and every layout (TP, PP, DP, EP) matches one device;
- a miniature agentic replay on a pool so small that requests are preempted and
  recomputed, prefixes are hit, and window blocks freed by one request are reused by
  another: exactly the reference model's greedy tokens, on one device, TP and PP.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from compute_cases import (
    REL_TOL, assert_greedy, compute_engine, logits_by_row, max_rel_error, outputs,
    reference_rows, replay_agentic, run_to_end, shared_prefix_prompts, submit_prompts)

from labkit.engine.compute.models import (
    family_config, init_weights, layer_weights, reference_logits)
from labkit.engine.compute.models.gqa import gqa_qkv
from labkit.engine.compute.models.layers import rms_norm
from labkit.engine.compute.rank_model import rank_forward
from labkit.engine.compute.step_batch import Entry, StepBatch
from labkit.engine.events import WindowSlid
from labkit.specs import get_model

MODEL = "tiny-gpt-oss"
# two agentic sessions (up to ~400-token contexts, 4 concurrent calls) on 32 blocks
SMALL_POOL = dict(sessions=2, num_gpu_blocks_override=32, max_num_batched_tokens=48,
                  num_speculative_tokens=2)
_single: dict = {}


def test_the_model_slides():
    spec = get_model(MODEL)
    assert spec.sliding_window_layers == (0,) and spec.sliding_window == 24
    assert spec.block_size == 16


# ------------------------------------------------------------ one rank, by hand
def test_step_batch_pads_window_tables_with_minus_one():
    entries = [Entry("a", 40, 1, True, np.array([7, 8, 9]), False,
                     window_table=np.array([-1, 4, 5])),
               Entry("b", 0, 3, False, np.array([1]), True, window_table=np.array([2]))]
    batch = StepBatch(entries, [0, 1, 2, 3], block_size=16)
    assert batch.block_table.tolist() == [[7, 8, 9], [1, 0, 0]]
    assert batch.table(sliding=True).tolist() == [[-1, 4, 5], [2, -1, -1]]
    assert batch.tables_of(np.array([3]), sliding=True).tolist() == [[2, -1, -1]]
    plain = StepBatch([Entry("c", 0, 1, False, np.array([1]), True)], [0], block_size=16)
    with pytest.raises(ValueError, match="no window tables"):
        plain.table(sliding=True)


def test_a_new_token_in_a_freed_window_block_is_an_error():
    eng = compute_engine(MODEL, "tp1")
    bad = Entry("r", 40, 1, True, np.array([0, 1, 2]), False,
                window_table=np.array([-1, 4, -1]))  # position 40 lives in block 2
    with pytest.raises(RuntimeError, match="block is not held"):
        rank_forward(eng.data_plane.ranks[0], StepBatch([bad], [5], 16))
    eng.data_plane.close()


def test_sliding_layer_writes_and_reads_only_its_window_pages():
    """Prefill 40 tokens with the full table on blocks 0-2 and the window table on
    blocks 3-5, then decode one token after the window table dropped block 3 (-1) and
    its page got someone else's garbage: layer 0 (sliding) wrote only pages 3-5, layer
    1 only blocks 0-2, and both steps give the reference model's logits."""
    spec = get_model(MODEL)
    eng = compute_engine(MODEL, "tp1")
    rank = eng.data_plane.ranks[0]
    tokens = torch.randint(0, spec.vocab_size, (41,), generator=torch.Generator().manual_seed(7))
    ref = reference_logits(spec, init_weights(spec, eng.config.seed), tokens)

    prefill = Entry("r", 0, 40, False, np.array([0, 1, 2]), True,
                    window_table=np.array([3, 4, 5]))
    rows, logits = rank_forward(rank, StepBatch([prefill], tokens[:40].tolist(), 16))
    assert max_rel_error(logits[0], ref[39]) < REL_TOL
    written = {layer: set(torch.nonzero(rank.kv.layers[layer]["k"].abs().sum((1, 2, 3)))
                          .flatten().tolist()) for layer in (0, 1)}
    assert written == {0: {3, 4, 5}, 1: {0, 1, 2}}

    rank.kv.layers[0]["k"][3] = float("nan")  # freed, reused: not the sliding layer's
    rank.kv.layers[0]["v"][3] = float("nan")
    decode = Entry("r", 40, 1, True, np.array([0, 1, 2]), False,
                   window_table=np.array([-1, 4, 5]))
    rows, logits = rank_forward(rank, StepBatch([decode], [int(tokens[40])], 16))
    assert max_rel_error(logits[0], ref[40]) < REL_TOL
    eng.data_plane.close()


def test_request_kv_of_a_sliding_layer_is_its_window():
    """Mid-run, the sliding layer holds whole blocks from (at most) its last step's
    window on — earlier ones were freed — and they hold layer 0's keys and values
    (computed here from the embeddings: layer 0's input)."""
    spec = get_model(MODEL)
    eng = compute_engine(MODEL, "tp1", max_num_batched_tokens=32)
    submit_prompts(eng, {"long": list(range(5, 5 + 3 * spec.sliding_window))}, max_tokens=4)
    req = eng.requests["long"]
    while req.num_computed_tokens < 3 * spec.sliding_window:  # three 32-token chunks
        assert eng.step()
    n, B = req.num_computed_tokens, spec.block_size
    positions, entries = eng.request_kv(req, 0, 0)
    first = int(positions[0])
    assert positions.tolist() == list(range(first, n)) and first % B == 0
    assert 0 < first <= (n - spec.sliding_window + 1) // B * B  # the next query's window
    w = layer_weights(init_weights(spec, eng.config.seed), 0)
    cfg = family_config(spec)
    h = rms_norm(w_embed(eng)[torch.tensor(req.token_ids[:n])], w["input_layernorm.weight"],
                 cfg.rms_norm_eps)
    _, k, v = gqa_qkv(h, w, spec.head_dim, torch.arange(n), cfg.rope, cfg.rms_norm_eps)
    torch.testing.assert_close(entries["k"], k[first:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entries["v"], v[first:], rtol=1e-5, atol=1e-5)
    assert eng.request_kv(req, 1, 0)[0].tolist() == list(range(n))


def w_embed(eng):
    return eng.data_plane.ranks[0].weights["model"]["model.embed_tokens.weight"]


# ----------------------------------------------------------- shared-prefix prompts
def scenario(layout: str):
    eng = compute_engine(MODEL, layout, num_speculative_tokens=2, max_num_batched_tokens=32)
    submit_prompts(eng, shared_prefix_prompts(get_model(MODEL).vocab_size), max_tokens=8)
    return run_to_end(eng)


def single_device():
    if "scenario" not in _single:
        _single["scenario"] = scenario("tp1")
    return _single["scenario"]


def test_single_device_matches_whole_sequence_recompute():
    eng = single_device()
    ref = reference_rows(MODEL, eng)
    latest = {(rid, pos): row for (rid, pos, _), row in logits_by_row(eng).items()}
    checked = [max_rel_error(row, ref[key]) for key, row in latest.items() if key in ref]
    assert len(checked) >= 20
    assert max(checked) < REL_TOL
    # rows past the window: where a missing window mask would have shown
    assert max(pos for _, pos in latest) > 2 * get_model(MODEL).sliding_window
    assert sum(r.num_cached_tokens for r in eng.requests.values()) > 0


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "tp2xep2", "dep2"])
def test_layout_matches_single_device(layout):
    base, eng = single_device(), scenario(layout)
    want, got = logits_by_row(base), logits_by_row(eng)
    assert got.keys() == want.keys()
    worst = max(max_rel_error(got[k], want[k]) for k in want)
    assert worst < REL_TOL, f"{layout}: max relative error {worst:.2e}"
    assert outputs(eng) == outputs(base)


# ------------------------------------------------------------ agentic, small pool
class BlockUse:
    """What the data plane was handed, step by step: each entry, and a chronological
    log of ("slid", request, pages) when a window moves (a WindowSlid event) and
    ("step", {request: blocks it holds in either table}) for each step."""

    def __init__(self, eng) -> None:
        self.entries: list = []
        self.log: list = []
        eng.events.subscribe(
            lambda e: self.log.append(("slid", e.request_id, set(e.blocks.tolist()))),
            WindowSlid)
        step_batch = eng.data_plane._step_batch

        def recording(b, *rest):
            batch = step_batch(b, *rest)
            # (the tables are views of the KV manager's: keep them as they were)
            self.entries += [replace(e, table=e.table.copy(), window_table=e.window_table.copy())
                             for e in batch.entries]
            self.log.append(("step", {e.request_id: set(e.table.tolist())
                                      | (set(e.window_table.tolist()) - {-1})
                                      for e in batch.entries}))
            return batch
        eng.data_plane._step_batch = recording

    def reused_by_others(self) -> int:
        """Pages one request's window released that a later step shows in another
        request's table."""
        released: dict[int, str] = {}
        reused = 0
        for kind, *rest in self.log:
            if kind == "slid":
                rid, pages = rest
                released.update(dict.fromkeys(pages, rid))
                continue
            for rid, blocks in rest[0].items():
                for p in blocks & released.keys():
                    reused += released.pop(p) != rid
        return reused


def agentic(layout: str):
    if layout not in _single:
        use = []
        eng, counts = replay_agentic(MODEL, layout, setup=lambda e: use.append(BlockUse(e)),
                                     **SMALL_POOL)
        _single[layout] = eng, counts, use[0]
    return _single[layout]


def test_small_pool_replay_is_greedy_and_reuses_window_blocks():
    eng, counts, use = agentic("tp1")
    assert assert_greedy(MODEL, eng) >= 15
    assert counts["preemptions"] > 0
    assert sum(r.num_cached_tokens for r in eng.requests.values()) > 0
    assert eng.extra_summary()["kv_window_blocks_freed"] > 0
    assert use.reused_by_others() > 0
    longest = max(len(r.token_ids) for r in eng.requests.values())
    assert longest > 10 * get_model(MODEL).sliding_window


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_small_pool_replay_gives_the_same_tokens_on_layouts(layout):
    base, _, _ = agentic("tp1")
    eng, counts, _ = agentic(layout)
    assert outputs(eng) == outputs(base)
    assert counts["preemptions"] > 0


def test_window_tables_hold_what_the_sliding_layer_reads():
    """Every step's window table holds pages from the first block the step's queries
    can see to its last new token's block, and -1 before (the KV manager's contract,
    which lets the kernels skip the rest)."""
    _, _, use = agentic("tp1")
    W, B = get_model(MODEL).sliding_window, get_model(MODEL).block_size
    slid = 0
    for e in use.entries:
        first = max(0, e.context - W + 1) // B
        last = (e.context + e.num_new - 1) // B
        assert (e.window_table[first:last + 1] >= 0).all(), e.request_id
        assert (e.window_table[:first] == -1).all(), e.request_id
        slid += first > 0
    assert slid > 100
