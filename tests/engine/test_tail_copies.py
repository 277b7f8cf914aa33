"""Copy-on-write is due where a request's next token lands mid-block in a block that is
not its own alone: shared with another table, or keyed. `KVManager._needs_copy` skips
looking at the pool for a block the table took itself and has not keyed
(`BlockTable.num_shared`, `num_keyed`); here, on fuzz cases that fork subagents off
parents' tails, share prefixes and hand P/D prompts over (whose last block is keyed
before the decode side has computed it all), the shortcut agrees with the look at the
pool on every call."""

import random
from collections import Counter

from labkit.engine.kv import kv_manager
from labkit.engine.kv.block_pool import NO_KEY
from tests.fuzz_paths import random_case, replay_case

CASES = [(3, True), (35, True), (56, True), (5, False), (39, False), (55, False)]  # (seed, P/D)


def test_the_shortcut_agrees_with_the_pool(monkeypatch):
    seen = Counter()
    needs_copy = kv_manager.KVManager._needs_copy

    def checked(self, table, computed):
        got = needs_copy(self, table, computed)
        idx = computed // self.block_size
        looked = bool(computed % self.block_size) and idx < table.n and bool(
            self.pool.ref_count[table.blocks[idx]] > 1
            or self.pool.block_key[table.blocks[idx]] != NO_KEY)
        assert got == looked, (table.num_shared, table.num_keyed, idx)
        if looked:
            seen["shared" if idx < table.num_shared else "keyed ahead"] += 1
        seen["calls"] += 1
        return got

    monkeypatch.setattr(kv_manager.KVManager, "_needs_copy", checked)
    for seed, pd in CASES:
        replay_case(random_case(random.Random(seed), pd))
    # both ways a copy falls due came, among many calls the shortcut answered
    assert seen["shared"] > 20 and seen["keyed ahead"] > 20 and seen["calls"] > 1000
