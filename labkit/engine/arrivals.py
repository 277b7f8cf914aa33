"""Taking requests in: what a plain engine and a P/D system both do the same way.

A deployment (`Engine`, `PDEngine`) keeps its future arrivals in a heap of
(time, sequence number, request); `submit` puts a request there, `submit_prompt` first
builds one from token ids (or text, through the model's tokenizer). Both deployments
inherit this, so a call is admitted by one piece of code whichever serves it.

A subclass provides: `now`, `config`, `model`, `tokenizer`, `block_size`, `requests`
(id -> Request), `check_fits(request_id, input_tokens, output_tokens)`, `close()`
(what it holds let go: `with deployment:` closes it on the way out), and calls
`Arrivals.__init__`.
"""

from __future__ import annotations

import heapq
import operator

from labkit import checks
from labkit.engine.kv.block_keys import TokenBlockKeys
from labkit.engine.request import Request, Status
from labkit.errors import ConfigError
from labkit.tokenizer import no_tokenizer


class Arrivals:
    def __init__(self) -> None:
        self._arrivals: list = []  # (time, seq, request), a heap
        self._seq = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def num_pending(self) -> int:
        """Requests submitted that have not reached the router yet."""
        return len(self._arrivals)

    def submit(self, req: Request, at: float | None = None) -> None:
        """Schedule req to reach the router at time `at` (default: now)."""
        at = self.now if at is None else at
        if at < self.now:
            raise ValueError(f"cannot submit {req.request_id} in the past ({at} < {self.now})")
        req.arrival_s = at
        req.status = Status.PENDING
        req.max_tokens = req.num_prompt_tokens + req.max_output_tokens + \
            self.config.num_speculative_tokens
        self._seq += 1
        req.seq = self._seq
        self.requests[req.request_id] = req
        heapq.heappush(self._arrivals, (at, req.seq, req))

    def submit_prompt(self, token_ids, max_output_tokens: int, request_id: str | None = None,
                      at: float | None = None, session_id: str | None = None) -> Request:
        """Submit one call given by its token ids, or by its text when the model's folder
        has a tokenizer (`labkit.tokenizer`; its block keys are hashed from the ids, so
        equal prefixes hit the prefix cache); the compute plane generates its output.
        Returns the Request (its `output_token_ids` fill in as it runs)."""
        if isinstance(token_ids, str):
            if self.tokenizer is None:
                raise no_tokenizer(self.model)
            token_ids = self.tokenizer.encode(token_ids)
        token_ids = check_prompt(token_ids, self.model.vocab_size)
        checks.integer("max_output_tokens", max_output_tokens, low=1)
        request_id = request_id or f"prompt-{len(self.requests)}"
        self.check_fits(request_id, len(token_ids), max_output_tokens)
        req = Request(request_id=request_id, session_id=session_id or request_id,
                      num_prompt_tokens=len(token_ids), max_output_tokens=max_output_tokens,
                      arrival_s=self.now if at is None else at)
        req.prompt_token_ids = token_ids
        req.keys = TokenBlockKeys(token_ids, self.block_size)
        self.submit(req, at=at)
        return req


def check_prompt(token_ids, vocab_size: int) -> list[int]:
    """A prompt's token ids as ints, refused when empty or outside [0, vocab_size)."""
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        raise ConfigError("token_ids must be integers") from None
    if not ids:
        raise ConfigError("token_ids is empty: a prompt needs at least one token")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConfigError(f"token id {bad} is outside the model's vocabulary "
                          f"[0, {vocab_size})")
    return ids
