"""The KV manager: property tests against naive references, and fork semantics.

A hypothesis state machine opens requests whose prompts share prefixes (a random tree
of block ids), admits them with their cached prefix, computes tokens, forks and frees
them, passing prefix hints along as a replay would. After every step:

- ref counts are never negative and equal the number of tables holding each block;
- free + used = total, and the free queue holds exactly the unreferenced blocks;
- a block carries a key exactly when the cache hands it out for that key;
- `lookup` (hint + binary search + dictionary walk) equals a naive walk of the cache,
  block for block.

At the end everything is freed and nothing may leak.
"""

import itertools

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from labkit.engine.kv import KVManager, TokenBlockKeys, TraceBlockKeys
from labkit.engine.kv.block_pool import NO_KEY
from labkit.engine.request import Request

BS = 4


def naive_lookup(kv: KVManager, req) -> list[int]:
    """Walk the cache key by key; cap so that at least one token is recomputed."""
    limit = min((req.num_tokens - 1) // kv.block_size, req.keys.num_blocks)
    blocks = []
    for j in range(limit):
        b = kv.pool.cached_block(req.keys.key(j))
        if b < 0:
            break
        blocks.append(b)
    return blocks


class KVMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 48))
    def setup(self, num_blocks):
        self.kv = KVManager(num_blocks, BS)
        self.next_id = 0
        self.counter = 0
        self.fresh: list[Request] = []  # created, not admitted
        self.running: list[Request] = []
        self.hints: dict[str, object] = {}
        self.paths: list[np.ndarray] = [np.empty(0, dtype=np.int64)]

    def _new_request(self, ids: np.ndarray, tokens: int, hint=None, forked=0) -> Request:
        self.counter += 1
        req = Request(f"r{self.counter}", "s", tokens, 4, 0.0,
                      keys=TraceBlockKeys(ids, BS, BS), prefix_hint=hint)
        req.forked_tokens = forked
        return req

    @rule(base=st.integers(0, 10_000), keep=st.integers(0, 12), extra=st.integers(1, 8),
          partial=st.integers(0, BS - 1))
    def open_request(self, base, keep, extra, partial):
        """A prompt that shares `keep` blocks with an earlier path, then goes its own way."""
        prefix = self.paths[base % len(self.paths)][:keep]
        new = np.arange(self.next_id, self.next_id + extra + 1, dtype=np.int64)
        self.next_id += extra + 1
        ids = np.concatenate([prefix, new])
        self.paths.append(ids)
        tokens = (len(ids) - 1) * BS + max(partial, 1)
        hint = self.hints.get(f"{base % max(len(self.paths), 1)}")
        self.fresh.append(self._new_request(ids, tokens, hint))

    @precondition(lambda self: self.fresh)
    @rule(pick=st.integers(0, 10_000), chunk=st.integers(1, 40))
    def admit(self, pick, chunk):
        req = self.fresh[pick % len(self.fresh)]
        match = self.kv.lookup(req)
        expected = naive_lookup(self.kv, req)
        full = match.blocks[: match.num_tokens // BS]
        assert full.tolist() == expected
        event("hit" if expected else "miss")
        if match.forked and match.num_tokens % BS:
            event("adopted a partial tail")
        if req.prefix_hint is not None and expected:
            event("hit with a prefix hint")
        n = min(chunk, req.num_tokens - match.num_tokens)
        free_before = self.kv.pool.num_free
        if self.kv.allocate(req, n, match):
            self.fresh.remove(req)
            req.num_computed_tokens = match.num_tokens
            self.running.append(req)
        else:
            assert self.kv.pool.num_free == free_before  # a refusal changes nothing
            assert req.request_id not in self.kv.tables

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10_000), chunk=st.integers(1, 12), ahead=st.booleans())
    def compute(self, pick, chunk, ahead):
        """Compute the scheduled tokens, register full blocks, schedule the next chunk.
        `ahead`: the chunk's blocks are registered when it is planned (same-step hits),
        then the step runs at once, as in the scheduler."""
        req = self.running[pick % len(self.running)]
        table = self.kv.table(req.request_id)
        covered = min(len(table) * BS, req.num_tokens)
        req.num_computed_tokens = max(req.num_computed_tokens, covered)
        self.kv.cache_full_blocks(req)
        more = min(chunk, req.num_tokens - req.num_computed_tokens)
        if more > 0 and self.kv.allocate(req, more) and ahead:
            self.kv.register_blocks(req, req.num_computed_tokens + more)
            assert self.kv.lookup(req, computed_only=True).num_tokens <= \
                self.kv.lookup(req).num_tokens
            event("registered ahead")
            req.num_computed_tokens += more
            self.kv.cache_full_blocks(req)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10_000), extra=st.integers(1, 6))
    def fork(self, pick, extra):
        """A child shares a running parent's computed tokens and adds its own."""
        parent = self.running[pick % len(self.running)]
        shared = parent.num_computed_tokens
        if shared == 0:
            return
        ids = np.concatenate([parent.keys.ids[: -(-shared // BS)],
                              np.arange(self.next_id, self.next_id + 2, dtype=np.int64)])
        self.next_id += 2
        child = self._new_request(ids, shared + extra)
        self.kv.fork(parent, child, shared)
        assert self.kv.table(child.request_id).tolist() == \
            self.kv.table(parent.request_id)[: -(-shared // BS)].tolist()
        # the parent's next token would land in the partial block both now hold
        assert self.kv.tail_is_shared(parent) == bool(shared % BS)
        if self.kv.allocate(child, extra):
            event("fork")
            if shared % BS:  # wrote into the shared partial block: it was copied
                event("copy-on-write")
                (src, dst), = child.pending_copies
                assert self.kv.table(parent.request_id)[shared // BS] == src
                assert self.kv.table(child.request_id)[shared // BS] == dst != src
            self.running.append(child)
        else:
            self.kv.free(child)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10_000), slot=st.integers(0, 10_000))
    def free(self, pick, slot):
        req = self.running.pop(pick % len(self.running))
        hint = self.kv.free(req)
        self.hints[f"{slot % (len(self.paths) + 1)}"] = hint
        # a successor extends the same prompt and inherits the hint
        ids = np.concatenate([req.keys.ids, np.arange(self.next_id, self.next_id + 2)])
        self.next_id += 2
        self.paths.append(ids)
        self.fresh.append(self._new_request(ids, len(ids) * BS - 1, hint))
        # and a subagent forks from exactly what it computed (it may adopt the tail)
        done = req.num_computed_tokens
        if done:
            kid = np.concatenate([req.keys.ids[: -(-done // BS)],
                                  np.arange(self.next_id, self.next_id + 3)])
            self.next_id += 3
            self.fresh.append(self._new_request(kid, done + 2 * BS, hint, forked=done))

    @invariant()
    def a_shared_tail_is_seen(self):
        """`tail_is_shared` (which skips looking at blocks a table took itself) agrees
        with the pool: the next token lands mid-block in a block held twice or keyed."""
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        for req in self.running:
            table, computed = self.kv.tables[req.request_id], req.num_computed_tokens
            idx = computed // BS
            looked = bool(computed % BS) and idx < table.n and bool(
                pool.ref_count[table.blocks[idx]] > 1
                or pool.block_key[table.blocks[idx]] != NO_KEY)
            assert self.kv.tail_is_shared(req) == looked

    @invariant()
    def ref_counts_match_tables(self):
        if not hasattr(self, "kv"):
            return
        counts = np.zeros(self.kv.num_blocks, dtype=np.int64)
        for table in self.kv.tables.values():
            np.add.at(counts, table.view(), 1)
        assert (self.kv.pool.ref_count >= 0).all()
        assert counts.tolist() == self.kv.pool.ref_count.tolist()

    @invariant()
    def free_plus_used_is_total(self):
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        assert pool.num_free + pool.num_used == pool.num_blocks
        free = sorted(pool.free_order().tolist())
        assert free == np.flatnonzero(pool.ref_count == 0).tolist()

    @invariant()
    def no_step_left_half_done(self):
        """Blocks registered ahead are marked written once their step has run."""
        if hasattr(self, "kv"):
            assert not self.kv.pool.pending.any()

    @invariant()
    def keys_are_registered(self):
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        keyed = np.flatnonzero(pool.block_key != NO_KEY)
        index = pool._cached.as_dict()
        assert sorted(index.values()) == sorted(keyed.tolist())
        for b in keyed.tolist():
            assert index[int(pool.block_key[b])] == b

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for req in self.running:
            self.kv.free(req)
        assert not self.kv.tables
        assert self.kv.pool.num_free == self.kv.num_blocks
        assert (self.kv.pool.ref_count == 0).all()


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVManager = KVMachine.TestCase


# ------------------------------------------------------------ hand-made cases
def _req(name, ids, tokens, hint=None, forked=0):
    r = Request(name, "s", tokens, 8, 0.0, keys=TraceBlockKeys(np.asarray(ids), BS, BS),
                prefix_hint=hint)
    r.forked_tokens = forked
    return r


def _run(kv, req, computed):
    """Admit req and pretend it computed `computed` tokens."""
    match = kv.lookup(req)
    assert kv.allocate(req, computed - match.num_tokens, match)
    req.num_computed_tokens = computed
    kv.cache_full_blocks(req)
    return match


def test_lookup_is_capped_one_token_short():
    kv = KVManager(16, BS)
    a = _req("a", [1, 2, 3], 12)
    _run(kv, a, 12)
    kv.free(a)
    same = _req("b", [1, 2, 3], 12)  # identical prompt: last block must be recomputed
    assert kv.lookup(same).num_tokens == 8
    longer = _req("c", [1, 2, 3, 4], 13)
    assert kv.lookup(longer).num_tokens == 12


def test_subagent_fork_adopts_the_partial_tail_and_copies_on_write():
    kv = KVManager(16, BS)
    parent = _req("p", [1, 2, 3], 10)  # 2 full blocks + 2 tokens in the third
    _run(kv, parent, 10)
    tail = kv.table("p")[2]
    hint = kv.free(parent)
    assert hint.tail == tail and hint.num_tokens == 10
    # two subagents fork from the parent's context (10 tokens) and add their own
    kids = [_req(f"k{i}", [1, 2, 30 + i, 40 + i], 14, hint, forked=10) for i in range(2)]
    m0 = kv.lookup(kids[0])
    assert m0.forked and m0.num_tokens == 10 and m0.blocks[-1] == tail
    assert kv.allocate(kids[0], 4, m0)  # first writer: the tail is only its own
    assert kids[0].pending_copies == [] and kv.table("k0")[2] == tail
    m1 = kv.lookup(kids[1])
    assert m1.num_tokens == 10
    assert kv.allocate(kids[1], 4, m1)  # second: the shared tail is copied first
    (src, dst), = kids[1].pending_copies
    assert src == tail and dst != tail and kv.table("k1")[2] == dst
    assert kv.pool.ref_count[kv.table("k0")[:2]].tolist() == [2, 2]  # full blocks shared


def test_a_reused_tail_is_not_adopted():
    kv = KVManager(4, BS)
    parent = _req("p", [1, 2], 6)
    _run(kv, parent, 6)
    hint = kv.free(parent)
    other = _req("x", [9, 8, 7, 6], 16)  # takes every block, the tail included
    _run(kv, other, 16)
    kv.free(other)
    kid = _req("k", [1, 2, 3], 9, hint, forked=6)
    assert kv.lookup(kid).num_tokens == 0


def test_prefix_hint_of_another_rank_is_ignored():
    a, b = KVManager(8, BS, rank=0), KVManager(8, BS, rank=1)
    r = _req("r", [1, 2, 3], 12)
    _run(a, r, 12)
    hint = a.free(r)
    nxt = _req("n", [1, 2, 3, 4], 16, hint)
    assert a.lookup(nxt).num_tokens == 12 and b.lookup(nxt).num_tokens == 0


@pytest.mark.parametrize("engine_bs,trace_bs", [(4, 16), (16, 16), (64, 16)])
def test_block_keys_name_prefixes_across_block_sizes(engine_bs, trace_bs):
    """Keys agree exactly on the engine blocks two id chains share."""
    a = np.array([10, 11, 12, 13, 14, 15, 16, 17])
    b = np.array([10, 11, 12, 13, 90, 91, 92, 93])  # same first 4 trace blocks
    ka, kb = (TraceBlockKeys(x, trace_bs, engine_bs) for x in (a, b))
    n = min(ka.num_blocks, kb.num_blocks)
    same = ka.keys(0, n) == kb.keys(0, n)
    shared_tokens = 4 * trace_bs
    assert same.tolist() == [(j + 1) * engine_bs <= shared_tokens for j in range(n)]
    assert len(set(ka.keys(0, ka.num_blocks).tolist())) == ka.num_blocks
    assert [ka.key(j) for j in range(n)] == ka.keys(0, n).tolist()
    for start in range(ka.num_blocks + 1):  # any range: each key as `key` names it
        for stop in range(start, ka.num_blocks + 1):
            assert ka.keys(start, stop).tolist() == [ka.key(j) for j in range(start, stop)]
    with pytest.raises(IndexError, match="keyed blocks"):
        ka.keys(0, ka.num_blocks + 1)  # past the keys the ids define


def _trace_ids(tokens: list, trace_bs: int, ids: dict) -> np.ndarray:
    """Chain-unique ids of a token stream's trace blocks, the last one partial (as a
    trace loader makes them): one id per distinct (prefix, block) content."""
    return np.array([ids.setdefault(tuple(tokens[: end]), len(ids))
                     for end in range(trace_bs, len(tokens) + trace_bs, trace_bs)])


@pytest.mark.parametrize("engine_bs,trace_bs", [(4, 16), (8, 16), (16, 64), (16, 16),
                                                (32, 16)])
def test_trace_keys_share_what_token_hashes_share(engine_bs, trace_bs):
    """Threads of calls, each re-sending a random part of its parent's context: where
    that part ends inside a trace block, parent and child have different ids for the
    block, yet the engine blocks inside the shared part hold the same tokens. With lent
    keys, the trace keys of any two calls of a thread agree exactly where vLLM's token
    hashes do (they did not on those sub-blocks, nor, once lent, on their children's)."""
    rng = np.random.default_rng(engine_bs * 1000 + trace_bs)
    for _ in range(40):
        ids: dict = {}
        tokens = [rng.integers(1000, size=int(rng.integers(1, 90))).tolist()]
        keys = [TraceBlockKeys(_trace_ids(tokens[0], trace_bs, ids), trace_bs, engine_bs)]
        for _ in range(4):
            shared = int(rng.integers(0, len(tokens[-1]) + 1))
            tokens.append(tokens[-1][:shared]
                          + rng.integers(1000, size=int(rng.integers(1, 60))).tolist())
            keys.append(TraceBlockKeys(_trace_ids(tokens[-1], trace_bs, ids), trace_bs,
                                       engine_bs))
            keys[-1].lend(keys[-2], shared)
        for a, b in itertools.combinations(range(len(keys)), 2):
            n = min(len(tokens[a]), len(tokens[b])) // engine_bs  # full blocks of both
            by_ids = keys[a].keys(0, n) == keys[b].keys(0, n)
            by_tokens = (TokenBlockKeys(tokens[a], engine_bs).keys(0, n)
                         == TokenBlockKeys(tokens[b], engine_bs).keys(0, n))
            assert by_ids.tolist() == by_tokens.tolist()
        for k in keys:
            assert [k.key(j) for j in range(k.num_blocks)] == k.keys(0, k.num_blocks).tolist()


def test_token_keys_chain_over_whole_prefixes():
    from labkit.engine.kv import TokenBlockKeys

    base = list(range(100, 140))  # 10 blocks of 4
    a = TokenBlockKeys(base, BS)
    b = TokenBlockKeys(base[:20] + [7] + base[21:], BS)  # differs in block 5
    assert a.num_blocks == b.num_blocks == 10
    same = a.keys(0, 10) == b.keys(0, 10)
    assert same.tolist() == [True] * 5 + [False] * 5  # all later blocks differ too
    lora = TokenBlockKeys(base, BS, extra="adapter-1")
    assert not (lora.keys(0, 10) == a.keys(0, 10)).any()
    grown = TokenBlockKeys(base[:18], BS)
    assert grown.num_blocks == 4
    grown.extend(base[18:])
    assert grown.keys(0, 10).tolist() == a.keys(0, 10).tolist()
    assert [a.key(j) for j in range(10)] == a.keys(0, 10).tolist()


def test_token_keyed_requests_share_cached_prefixes():
    from labkit.engine.kv import TokenBlockKeys

    kv = KVManager(32, BS)
    prompt = list(range(1, 31))
    first = Request("a", "s", len(prompt), 4, 0.0, keys=TokenBlockKeys(prompt, BS))
    _run(kv, first, len(prompt))
    kv.free(first)
    follow = prompt + [99, 98, 97, 96, 95]
    second = Request("b", "s", len(follow), 4, 0.0, keys=TokenBlockKeys(follow, BS))
    assert kv.lookup(second).num_tokens == (len(prompt) // BS) * BS


def test_a_sibling_that_filled_the_shared_tail_forces_a_copy():
    """The first subagent writes into the parent's tail, fills and caches it, finishes;
    the second adopts the same tail: it must copy, not overwrite cached content."""
    kv = KVManager(16, BS)
    parent = _req("p", [1, 2, 3], 10)
    _run(kv, parent, 10)
    tail = kv.table("p")[2]
    hint = kv.free(parent)
    first = _req("k0", [1, 2, 30, 31], 14, hint, forked=10)
    match = kv.lookup(first)
    assert kv.allocate(first, 4, match) and kv.table("k0")[2] == tail
    first.num_computed_tokens = 14
    kv.cache_full_blocks(first)  # the tail is now a full, cached block of k0's content
    assert kv.pool.block_key[tail] == first.keys.key(2)
    kv.free(first)
    second = _req("k1", [1, 2, 40, 41], 14, hint, forked=10)
    match = kv.lookup(second)
    assert match.forked and match.blocks[-1] == tail
    assert kv.allocate(second, 4, match)
    (src, dst), = second.pending_copies
    assert src == tail and kv.table("k1")[2] == dst != tail
    second.num_computed_tokens = 14
    kv.cache_full_blocks(second)
    assert kv.pool.cached_block(first.keys.key(2)) == tail  # k0's content still cached
    assert kv.pool.cached_block(second.keys.key(2)) == dst
