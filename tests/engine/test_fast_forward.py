"""Fast-forward (runs of steady decode steps simulated at once) must change nothing:
the same replay step by step and fast-forwarded gives identical tables, bit for bit."""

import pandas as pd
import pytest

from support import small_agentx
from labkit import Engine
from labkit.engine.events import BlocksAllocated, BlocksCached, RequestTokens

CONFIGS = {
    "single rank": dict(model="tiny-llama", layout="tp1"),
    "spec decode": dict(model="tiny-llama", layout="tp1", num_speculative_tokens=3,
                        acceptance_length=2.99),
    "dp3 sticky": dict(model="tiny-llama", layout="dp3", router="session_sticky"),
    "dp2 prefix-aware": dict(model="tiny-llama", layout="dp2", router="prefix_aware"),
    "dp3 round-robin, KV fetched on moves": dict(model="tiny-llama", layout="dp3",
                                                 router="round_robin"),
    # KV fetched across nodes takes several steps: runs go on while it is on the wire
    "tp8xdp2 round-robin, KV fetched across nodes": dict(model="llama-3.1-8b",
                                                         layout="tp8xdp2",
                                                         router="round_robin"),
    "dp2 least-kv, tight KV": dict(model="tiny-llama", layout="dp2", router="least_kv",
                                   num_gpu_blocks_override=1400),
    "dep4 lockstep": dict(model="tiny-qwen3-moe", layout="dep4", num_speculative_tokens=2,
                          acceptance_length=2.5, router="least_loaded"),
    "preemption pressure": dict(model="tiny-llama", layout="tp1",
                                num_gpu_blocks_override=1000, max_num_seqs=8),
    "sliding window": dict(model="tiny-gpt-oss", layout="tp1", num_speculative_tokens=2,
                           acceptance_length=2.5),
    "sliding window, tight KV": dict(model="tiny-gpt-oss", layout="dp2",
                                     num_gpu_blocks_override=1500, max_num_seqs=8),
    # one run over the ranks of a lockstep instance, each with its own window pages
    "sliding window, dep4 lockstep": dict(model="tiny-gpt-oss", layout="dep4"),
}


def replay(ff: bool, cfg: dict, block_events: bool = False):
    engine = Engine(hardware="h100", block_size=16, sim_fast_forward=ff, **cfg)
    log = []
    if block_events:
        engine.events.subscribe(lambda e: log.append((type(e).__name__, e.t, e.rank,
                                                      e.request_id, e.blocks.tolist())),
                                BlocksAllocated, BlocksCached)
    # part-way starts: long contexts from the first step, so KV pressure bites
    result = engine.replay(small_agentx(6, seed=3), concurrency=4, duration_s=60,
                           max_idle_s=2.0, start_part_way=True)
    return result, log


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_forward_is_exact(name):
    fast, _ = replay(True, CONFIGS[name])
    slow, _ = replay(False, CONFIGS[name])
    assert slow.summary["requests_completed"] > 10
    pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, slow.steps, check_exact=True)
    drop = {"wall_s", "sim_speed"}
    assert {k: v for k, v in fast.summary.items() if k not in drop} == \
        {k: v for k, v in slow.summary.items() if k not in drop}
    if name == "preemption pressure":
        assert slow.summary["preemptions"] > 0


def test_fast_forward_emits_the_same_block_events():
    cfg = CONFIGS["spec decode"]
    _, fast = replay(True, cfg, block_events=True)
    _, slow = replay(False, cfg, block_events=True)
    assert len(slow) > 100
    assert sorted(fast) == sorted(slow)


def test_fast_forward_really_skips_steps():
    """The point of it: far fewer plan/commit rounds for the same steps."""
    counts = {}
    for ff in (True, False):
        engine = Engine("tiny-llama", "tp1", "h100", block_size=16, sim_fast_forward=ff)
        result = engine.replay(small_agentx(4, seed=1), concurrency=2, duration_s=60)
        chunks = engine.step_recorder.num_events  # one per committed plan
        counts[ff] = (chunks, len(result.steps))
    assert counts[True][1] == counts[False][1]  # the same steps...
    assert counts[True][0] < counts[False][0] / 3  # ...in far fewer rounds


def test_fast_forward_reports_the_same_request_tokens():
    """Runs go on while a moved call's KV is on the wire (it sits them out): the
    per-step RequestTokens rows, the waiting call's included, are those of single steps.
    (Two tp8 replicas on two nodes: a moved call's KV crosses the network for several
    steps; a tiny model's would land within one.)"""
    cfg = CONFIGS["tp8xdp2 round-robin, KV fetched across nodes"]
    rows = {}
    for ff in (True, False):
        engine = Engine(hardware="h100", block_size=16, sim_fast_forward=ff, **cfg)
        log = rows[ff] = []

        def per_step(e, log=log):
            for j, step in enumerate(e.step_index.tolist()):
                log.append((e.instance, step, tuple(e.request_ids), tuple(e.ranks.tolist()),
                            tuple(e.context[j].tolist()), tuple(e.num_new[j].tolist()),
                            tuple(e.decode[j].tolist()), tuple(e.held[j].tolist())))

        engine.events.subscribe(per_step, RequestTokens)
        result = engine.replay(small_agentx(6, seed=3), concurrency=4, duration_s=60,
                               max_idle_s=2.0, start_part_way=True)
        if ff:
            assert result.summary["kv_fetched_tokens"] > 0
    waited = [r for r in rows[False] if 0 in r[5]]
    assert waited  # some steps ran while a call's KV was on the wire
    assert sorted(rows[True]) == sorted(rows[False])


@pytest.mark.parametrize("name", ["dp3 round-robin, KV fetched on moves", "single rank"])
def test_an_admitting_step_starts_the_run_after_it(name, monkeypatch):
    """A step that admits a call (its prefix KV put on the wire, or its first prompt
    chunk) and leaves the ranks steady is the first step of a run, not a single step
    of its own: fewer single steps, the same replay as without the merge (and as step
    by step: `test_fast_forward_is_exact`)."""
    from labkit.engine.instance import Instance

    merge, singles = Instance._run_from_step, {}
    plane = type(Engine("tiny-llama", "tp1", "h100").data_plane)
    execute = plane.execute

    def counting(plane, step):
        singles[mode] += 1
        return execute(plane, step)

    results = {}
    for mode in ("merged", "apart"):
        singles[mode] = 0
        monkeypatch.setattr(Instance, "_run_from_step", merge if mode == "merged"
                            else lambda *args: None)
        monkeypatch.setattr(plane, "execute", counting)
        results[mode], _ = replay(True, CONFIGS[name])
    merged, apart = results["merged"], results["apart"]
    pd.testing.assert_frame_equal(merged.requests, apart.requests, check_exact=True)
    pd.testing.assert_frame_equal(merged.steps, apart.steps, check_exact=True)
    assert singles["merged"] < 0.8 * singles["apart"], singles
    if name.startswith("dp3"):
        assert merged.summary["kv_fetched_tokens"] > 0


def test_a_cut_run_goes_on_with_the_steps_it_planned(monkeypatch):
    """An arrival cuts a run; when the newcomer's prefix KV goes on the wire, the run
    after the cut has the same requests decoding as planned and takes the cut run's
    remaining steps and costs as they are (`RunRest`). The replay is the same as with
    every run planned afresh, and as step by step."""
    from labkit import generate_agentx_trace
    from labkit.engine.decode_run import DecodeRun, RunRest

    trace = generate_agentx_trace(40, seed=11, context_window_tokens=200_000,
                                  compact_threshold_tokens=167_000)
    taken, continues, rest = [], RunRest.continues, DecodeRun.rest

    def counting(self, *args):
        went_on = continues(self, *args)
        taken.append(went_on)
        return went_on

    def run(duration_s: float, mode: str):
        monkeypatch.setattr(DecodeRun, "rest", rest if mode == "rest" else
                            lambda *args: None)
        engine = Engine("qwen3-30b-a3b", "dp4", "h200", max_model_len=262144,
                        sim_fast_forward=mode != "step by step")
        return engine.replay(trace, concurrency=16, duration_s=duration_s,
                             start_part_way=False)

    monkeypatch.setattr(RunRest, "continues", counting)
    for duration_s, modes in ((120.0, ("rest", "afresh")), (30.0, ("rest", "step by step"))):
        taken.clear()
        ours, theirs = (run(duration_s, mode) for mode in modes)
        pd.testing.assert_frame_equal(ours.requests, theirs.requests, check_exact=True)
        pd.testing.assert_frame_equal(ours.steps, theirs.steps, check_exact=True)
        assert ours.summary["kv_fetched_tokens"] > 0
        assert sum(taken) >= (25 if duration_s > 60 else 8), (duration_s, sum(taken))


def test_a_run_starts_with_the_scheduled_step_only_if_it_is_that_step(monkeypatch):
    """`DecodeRun.starts_as`: the run's step 0 must be the scheduled batches exactly —
    the same requests in the same order, tokens, contexts and kinds."""
    from labkit.engine.decode_run import DecodeRun
    from labkit.engine.scheduler import RankBatch

    seen, starts_as = [], DecodeRun.starts_as

    def keep(run, batches):
        same = starts_as(run, batches)
        if same and not seen and any(len(b) > 1 for b in batches):
            seen.append((run, batches))
        return same

    monkeypatch.setattr(DecodeRun, "starts_as", keep)
    replay(True, CONFIGS["single rank"])
    run, batches = seen[0]
    i = next(i for i, b in enumerate(batches) if len(b) > 1)

    def edited(edit=None):
        out = [RankBatch(b.rank, list(b.requests), list(b.num_new_tokens), list(b.contexts),
                         list(b.is_decode)) for b in batches]
        if edit is not None:
            edit(out[i])
        return out

    def bump(column):
        return lambda b: column(b).__setitem__(0, column(b)[0] + 1)

    assert starts_as(run, edited())
    assert not starts_as(run, edited(bump(lambda b: b.num_new_tokens)))
    assert not starts_as(run, edited(bump(lambda b: b.contexts)))
    assert not starts_as(run, edited(lambda b: b.is_decode.__setitem__(0, not b.is_decode[0])))
    assert not starts_as(run, edited(lambda b: b.requests.reverse()))
    assert not starts_as(run, edited(lambda b: b.remove(b.requests[-1])))
    assert not starts_as(run, edited(lambda b: b.add(b.requests[0], 1, True)))


def test_accepted_tokens_follow_the_deterministic_counter():
    """cum[j] of `accepted_before` (shared per step_index mod q) against the counter
    written out: A(x) = floor(x p / q) tokens by step x, for any step and acceptance."""
    from fractions import Fraction

    import numpy as np

    from labkit.engine.run_plan import accepted_before

    rng = np.random.default_rng(0)
    for _ in range(300):
        acceptance = Fraction(int(rng.integers(1, 400)), int(rng.integers(1, 101)))
        start, steps = int(rng.integers(0, 10**7)), int(rng.integers(0, 50))
        p, q = acceptance.numerator, acceptance.denominator
        expect = [(start + j) * p // q - start * p // q for j in range(steps + 1)]
        assert accepted_before(start, steps, acceptance).tolist() == expect


def test_a_decode_runs_work_is_its_steps_written_out():
    """`decode_work`: step j of a run, rank r with n requests of summed context c
    before the run, is a decode of n requests over c + n cum[j] tokens, one row per
    step (ranks without requests idle) — against `StepWork.from_batches` of each step."""
    import numpy as np

    from labkit.engine.run_plan import decode_work
    from labkit.engine.scheduler import RankBatch
    from labkit.engine.step_work import StepWork

    rng = np.random.default_rng(2)
    for _ in range(50):
        width, ranks, k = int(rng.integers(1, 5)), int(rng.integers(1, 5)), int(rng.integers(1, 9))
        contexts = [rng.integers(0, 10**6, size=int(rng.integers(0, 4))) for _ in range(ranks)]
        cum = np.cumsum(np.concatenate([[0], rng.integers(1, width + 1, size=k - 1)]))
        work = decode_work(np.array([len(c) for c in contexts]),
                           np.array([int(c.sum()) for c in contexts]), cum, width)
        for j in range(k):
            step = StepWork.from_batches([
                RankBatch(r, [None] * len(c), [width] * len(c), (c + cum[j]).tolist(),
                          [True] * len(c)) for r, c in enumerate(contexts)])
            for f in ("prefill_tokens", "decode_tokens", "num_prefill_reqs", "num_decode_reqs",
                      "kv_read_tokens", "prefill_pairs", "decode_pairs", "idle",
                      "decode_context"):
                got, want = getattr(work, f)[j], getattr(step, f)[0]
                assert got.dtype == want.dtype and got.tolist() == want.tolist(), (f, j)
        assert work.same_counts


def test_the_planners_kernels_match_the_array_formulas():
    """`_chunk_end` and `_running_sum` (numba loops) against the array formulas they
    replace: the steps up to the last with a chunk or a request sitting out (not one
    that has left), and the cumulative sum of the steps' durations, bit for bit."""
    import numpy as np

    from labkit.engine.run_plan import _chunk_end, _running_sum

    rng = np.random.default_rng(1)
    for _ in range(300):
        n, k = int(rng.integers(1, 5)), int(rng.integers(1, 30))
        prefill = rng.random((n, k)) < 0.1
        new = np.where(rng.random((n, k)) < 0.2, 0, 3) * ~prefill + prefill * 7
        done = rng.integers(0, k + 2, n) if rng.random() < 0.5 else None
        out = new == 0
        if done is not None:
            out &= np.arange(k)[None, :] < done[:, None]
        busy = (prefill | out).any(axis=0).nonzero()[0]
        assert _chunk_end(prefill, new, done) == (int(busy[-1]) + 1 if len(busy) else 0)

        durations, now = rng.random(k) * 0.01, float(rng.random() * 1e4)
        times = np.empty(k + 1)
        times[0], times[1:] = now, durations
        assert (_running_sum(now, durations) == times.cumsum()).all()


def test_instances_ending_together_commit_in_the_same_order_either_way():
    """Two ranks doing the same work (a looped trace's copies of a call) finish it at
    the same float time; the call arriving as the first of them finishes must see the
    other in the same state, fast-forwarded or stepped: same-time events go in
    instance order, not in the order they were scheduled (which the two paths differ
    in). A fast-forward vs step-by-step fuzz found this case."""
    from labkit import generate_agentx_trace

    trace = generate_agentx_trace(8, seed=668)
    results, finishes = [], []
    for ff in (False, True):
        engine = Engine("qwen3-30b-a3b", "dp8", "h200", sim_fast_forward=ff, sim_step_cache=ff,
                        max_model_len=1 << 20, seed=22, long_prefill_token_threshold=256,
                        num_gpu_blocks_override=2000)
        engine.finish_callbacks.append(lambda req, t: finishes.append((t, req.rank)))
        results.append(engine.replay(trace, concurrency=16, duration_s=12.0, on_oversize="skip"))
    ties = pd.DataFrame(finishes).groupby(0)[1].nunique()
    assert (ties > 1).any()  # some calls on different ranks finish at the same time
    pd.testing.assert_frame_equal(results[1].requests, results[0].requests, check_exact=True)
    pd.testing.assert_frame_equal(results[1].steps, results[0].steps, check_exact=True)


def test_the_run_ends_where_a_request_would_find_its_rank_short_before_a_slide():
    """The requests of a step allocate one after the other. Where one frees sliding-
    window pages as it goes, the step as a whole may free more than it takes while a
    request before it finds the pool short (step by step: a preemption). The run must
    end before such a step (`_taken_by_rank` against the calls made one by one); it
    used to plan through it, and its playback failed."""
    import numpy as np

    from labkit.engine.run_plan import _taken_by_rank

    rng = np.random.default_rng(5)
    for _ in range(300):
        n, k, ranks = int(rng.integers(1, 6)), int(rng.integers(1, 12)), int(rng.integers(1, 3))
        rank_of = np.sort(rng.integers(0, ranks, n))
        net = rng.integers(0, 4, (n, k)) - 30 * (rng.random((n, k)) < 0.15)
        free = rng.integers(0, 12, ranks)
        fit, held = k, np.zeros(ranks, dtype=np.int64)
        for j in range(k):  # the calls one by one
            for i in range(n):
                held[rank_of[i]] += net[i, j]
                if held[rank_of[i]] > free[rank_of[i]] and fit == k:
                    fit = j
        taken, got = _taken_by_rank(net, rank_of, free)
        assert got == fit
        assert (taken == np.stack([np.bincount(rank_of, net[:, j], ranks) for j in range(k)])
                .cumsum(axis=0)).all()

    # found by the paths fuzzer: gpt-oss-120b on a tight pool, long calls skipped
    from labkit import generate_agentx_trace
    from support import SMALL_AGENTX

    trace = generate_agentx_trace(12, seed=780541, block_size=64, **SMALL_AGENTX)
    results = [Engine("gpt-oss-120b", layout="dp2", hardware="h200", num_gpu_blocks_override=800,
                      max_model_len=2048, sim_fast_forward=ff).replay(
        trace, concurrency=16, start_part_way=True, duration_s=10, max_idle_s=2.0,
        on_oversize="skip") for ff in (False, True)]
    assert results[0].summary["preemptions"] > 0
    pd.testing.assert_frame_equal(results[1].requests, results[0].requests, check_exact=True)
    pd.testing.assert_frame_equal(results[1].steps, results[0].steps, check_exact=True)


def test_a_resumed_requests_last_pending_token_decodes():
    """A request preempted after answering recomputes its stream in chunks; where they
    leave it one token to compute, the scheduler runs that as a decode (it has output
    tokens), not as a one-token prompt chunk, and a run's chunk plan must stop before
    it. Found by the paths fuzzer (seed 3301, case 85): the fast path priced a 1-token
    prefill chunk where step by step priced a decode."""
    from tests.fuzz_paths import check_case

    case = {"pd": False, "model": "qwen3-14b", "watch": [],
            "knobs": {"hardware": "h100", "long_prefill_token_threshold": 64,
                      "max_num_seqs": 8, "num_gpu_blocks_override": 800,
                      "kv_cache_dtype": "fp8", "seed": 7, "max_model_len": 8192,
                      "layout": "dp2"},
            "trace": ("agentx", {"sessions": 5, "seed": 257360, "block_size": 64}),
            "replay": {"concurrency": 16, "start_part_way": False, "duration_s": 10,
                       "max_idle_s": 2.0, "warmup_s": 5.0, "on_oversize": "skip"}}
    assert check_case(case, "step") == []
