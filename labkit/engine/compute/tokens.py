"""Token ids from trace block ids: the same trace drives both data planes.

A trace names a prompt's content only by block ids (equal ids, equal content). The
compute plane needs real token ids, so each block id is expanded into `block_size`
pseudo-random tokens from a generator seeded by the id itself: the same id always
becomes the same tokens, in any request, any run, any process. Prompts that share
block ids therefore share tokens, and prefix caching behaves in the compute plane as
the ids say — except for generated tokens, which are the model's own (the next turn's
prompt re-sends the trace's version of them, so those blocks are recomputed).

Tokens avoid the first `RESERVED` ids of the vocabulary (special tokens in real
tokenizers).
"""

from __future__ import annotations

import numpy as np

RESERVED = 4


def block_tokens(block_id: int, block_size: int, vocab_size: int) -> np.ndarray:
    """The tokens one trace block expands to."""
    rng = np.random.Generator(np.random.PCG64(int(block_id) & ((1 << 63) - 1)))
    return rng.integers(RESERVED, vocab_size, size=block_size, dtype=np.int64)


def prompt_tokens(hash_ids, input_length: int, block_size: int, vocab_size: int) -> list[int]:
    """A prompt's `input_length` token ids from its trace block ids."""
    needed = -(-input_length // block_size)
    if len(hash_ids) < needed:
        raise ValueError(f"{len(hash_ids)} block ids cannot cover {input_length} tokens "
                         f"of {block_size} per block")
    parts = [block_tokens(b, block_size, vocab_size) for b in hash_ids[:needed]]
    return np.concatenate(parts)[:input_length].tolist() if parts else []
