"""A fetch from another rank sees that rank's cache as step-by-step simulation has it.

With fast-forward, a rank's run of decode steps is played lazily: its allocations and
cache registrations happen when someone looks. A moved call that fetches its prefix
from another DP rank (`session_kv_migration="fetch"`) looks at that rank's cache, so
the source's run must first be played up to now (`Instance.lookup_at`) wherever that
changes the answer; otherwise the blocks its decoding requests have filled since its
last playback are missing and the fetch is shorter than step by step (or, where its
allocations have evicted part of the prefix, longer).

In the first test the caller continues a call still decoding on rank 0 (it arrives
part-way through, as open-loop traces allow), and asks rank 0 for a prefix that runs
into the blocks that call generates. It is admitted when a call on its own rank
finishes, not at an arrival. (Without playing the run the fetch brings 64 or 144
tokens instead of 208, on this code and on session 5's.)"""

import numpy as np
import pandas as pd

from labkit import Engine
from labkit.engine.kv.block_keys import TraceBlockKeys
from labkit.engine.kv.block_table import EMPTY, PrefixHint
from labkit.engine.request import Request

BLOCK = 16


def _request(rid: str, prompt: int, output: int, ids: np.ndarray, hint=None) -> Request:
    req = Request(request_id=rid, session_id="s", num_prompt_tokens=prompt,
                  max_output_tokens=output, arrival_s=0.0)
    req.keys = TraceBlockKeys(ids, BLOCK, BLOCK)
    req.prefix_hint = hint
    return req


def _run(fast_forward: bool):
    engine = Engine("tiny-llama", "dp2", "h100", block_size=BLOCK, router="round_robin",
                    session_kv_migration="fetch", max_num_seqs=2,
                    sim_fast_forward=fast_forward)
    # rank 0: a call decoding 600 tokens after a 4-block prompt; its context ids name
    # its generated blocks too (what the next call re-sends)
    first = np.arange(1, 1 + 4 + 600 // BLOCK, dtype=np.int64)
    engine.submit(_request("a", 4 * BLOCK, 600, first), at=0.0)
    # round robin alternates: rank 1 gets two long calls (busy until ~0.16 s), rank 0
    # two short ones beside a (gone within milliseconds); b then waits on rank 1 and is
    # admitted when a call there finishes — not at an arrival, when every rank is played
    for i, (rid, output) in enumerate([("c1", 150), ("e1", 3), ("c2", 150), ("e2", 3)]):
        ids = np.arange(100 * (i + 1), 100 * (i + 1) + 15, dtype=np.int64)
        engine.submit(_request(rid, 4 * BLOCK, output, ids), at=0.0)
    # rank 1 (round robin), half-way through a's decode: a call whose prompt is a's
    # prompt and first 20 generated blocks, then 3 blocks of its own; its hint points
    # at rank 0, so it fetches whatever rank 0 has cached of that prefix by then
    second = np.concatenate([first[:24], np.arange(1000, 1003, dtype=np.int64)])
    hint = PrefixHint(rank=0, blocks=EMPTY, generations=EMPTY)
    engine.submit(_request("b", 27 * BLOCK, 8, second, hint), at=0.1)
    engine.run_until()
    return engine.result()


def test_fetch_sees_the_source_rank_played_up_to_now():
    fast, slow = _run(True), _run(False)
    b = slow.requests.set_index("request_id").loc["b"]
    assert b["fetched_tokens"] > 4 * BLOCK  # blocks a generated before b came were fetched
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, slow.steps, check_exact=True)


def _evicting_run(fast_forward: bool, fetch_at: float):
    """Rank 0 caches call p's 20-block prompt, then serves call a, whose decode runs the
    small pool out of never-used blocks and goes on evicting p's blocks, tail first.
    p's next call b lands on rank 1 and fetches what rank 0 still holds of p's prompt."""
    engine = Engine("tiny-llama", "dp2", "h100", block_size=BLOCK, router="round_robin",
                    session_kv_migration="fetch", num_gpu_blocks_override=60,
                    sim_fast_forward=fast_forward)
    prompt = np.arange(1, 21, dtype=np.int64)
    engine.submit(_request("p", 20 * BLOCK, 2, prompt), at=0.0)
    engine.submit(_request("x", 2 * BLOCK, 2, np.arange(500, 502, dtype=np.int64)), at=0.0)
    engine.submit(_request("a", 2 * BLOCK, 800, np.arange(900, 902, dtype=np.int64)),
                  at=0.01)
    then = np.concatenate([prompt, np.arange(1000, 1003, dtype=np.int64)])
    hint = PrefixHint(rank=0, blocks=EMPTY, generations=EMPTY)
    engine.submit(_request("b", 23 * BLOCK, 4, then, hint), at=fetch_at)
    plays = []
    engine.instances[0].sync = _counting(engine.instances[0].sync, plays)
    engine.run_until()
    return engine.result(), len(plays)


def _counting(sync, plays):
    def counted(t, cut=True):
        if not cut:
            plays.append(t)
        return sync(t, cut)
    return counted


def test_a_fetch_sees_the_blocks_the_source_run_has_evicted_by_now():
    """The source's run is not played for a fetch when playing it cannot change what is
    fetched (`DecodeRun.could_change_lookup`); here it can: by b's arrival a's decode
    has evicted part of p's prompt, which the fetch must not bring."""
    fast, slow = _evicting_run(True, 0.75)[0], _evicting_run(False, 0.75)[0]
    fetched = slow.requests.set_index("request_id").loc["b", "fetched_tokens"]
    assert 0 < fetched < 20 * BLOCK
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, slow.steps, check_exact=True)


def test_a_fetch_leaves_the_source_run_unplayed_when_nothing_it_does_matters():
    """Earlier, a's decode still takes never-used blocks: p's prompt is whole, the
    fetch brings all of it, and rank 0's run is played only when it ends."""
    (fast, plays), slow = _evicting_run(True, 0.3), _evicting_run(False, 0.3)[0]
    assert slow.requests.set_index("request_id").loc["b", "fetched_tokens"] == 20 * BLOCK
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=True)
    assert plays == 0
