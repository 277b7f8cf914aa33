"""Draft tokens for speculative decoding: n-gram prompt lookup.

When the scheduler gives a decoding request `1 + k` tokens, the control plane must
supply k guesses for the tokens after its last one; the model then verifies them all
in one step (greedy: a draft is accepted while it equals the model's own argmax, and
the first disagreement is replaced by the model's token). Whatever the drafts are, the
accepted tokens are exactly what plain greedy decoding would produce — drafting only
changes how many arrive per step.

The drafter is vLLM's `ngram` method: find the most recent earlier occurrence of the
stream's last n tokens (n from `max_n` down to `min_n`) and propose the k tokens that
followed it. Agentic prompts repeat themselves (tool outputs, re-sent context), so this
often hits; with no match it repeats the last token.
"""

from __future__ import annotations


def ngram_drafts(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """k draft tokens to follow `tokens` (which must not be empty)."""
    if k <= 0:
        return []
    n_tokens = len(tokens)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        tail = tokens[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                follow = tokens[start + n:start + n + k]
                return follow + [follow[-1]] * (k - len(follow))
    return [tokens[-1]] * k
