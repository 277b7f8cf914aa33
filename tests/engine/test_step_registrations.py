"""After a step, the blocks its requests filled are registered in the prefix cache as
one batch (`KVManager.cache_full_blocks_of`) where nobody can see the calls' order —
the same claims in the same order as call by call. A FirstToken subscriber (who could
look at the KV between two requests' updates) gets them call by call; the tables must
not tell the two apart, on loads where requests fill blocks in the same steps and share
prefixes (twin keys in one step: the first block keeps the key)."""

import pandas as pd
import pytest

from labkit import Engine
from labkit.engine.events import FirstToken
from labkit.engine.kv import batch_play
from labkit.traces import generate_multi_turn_trace, generate_shared_prefix_trace

LOADS = {
    # each turn re-sends the conversation: it hits the blocks the answers filled
    "multi-turn, dp2": (dict(model="tiny-llama", layout="dp2"),
                        lambda: generate_multi_turn_trace(num_sessions=40, turns=4,
                                                          input_len=100, output_len=70,
                                                          range_ratio=0.5, request_rate=20.0,
                                                          seed=4, block_size=16)),
    "shared prefix, spec decode": (
        dict(model="tiny-llama", layout="tp1", num_speculative_tokens=2,
             acceptance_length=2.5),
        lambda: generate_shared_prefix_trace(num_groups=3, prompts_per_group=40,
                                             system_prompt_len=120, question_len=40,
                                             output_len=60, request_rate=50.0, seed=5,
                                             block_size=16)),
}


@pytest.mark.parametrize("name", list(LOADS))
def test_a_steps_registrations_as_one_batch_change_nothing(name, monkeypatch):
    knobs, trace = LOADS[name]
    batches = []
    register = batch_play.register
    monkeypatch.setattr(batch_play, "register",
                        lambda kv, registered: (batches.append(len(registered)),
                                                register(kv, registered)))
    batched = Engine(hardware="h100", block_size=16, sim_fast_forward=False, **knobs)
    one = batched.replay(trace(), open_loop=True)
    assert sum(n > 1 for n in batches) > 20  # steps with several requests' blocks
    batches.clear()
    by_call = Engine(hardware="h100", block_size=16, sim_fast_forward=False, **knobs)
    by_call.events.subscribe(lambda event: None, FirstToken)
    other = by_call.replay(trace(), open_loop=True)
    assert not batches  # (call by call, for the subscriber)
    pd.testing.assert_frame_equal(one.requests, other.requests, check_exact=True)
    pd.testing.assert_frame_equal(one.steps, other.steps, check_exact=True)
    assert one.summary["prefix_cache_hit_rate"] == other.summary["prefix_cache_hit_rate"] > 0
