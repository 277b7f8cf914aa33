"""One coding-agent session, turn by turn: the model behind the AgentX generator.

A session is a main agent working on a task. Each main call sends the whole
context (a ``TokenStream``) and answers briefly; then one of three things happens
before the next call:

* tools run (``_run_tools``): the context grows by the answer and the tool
  results -- usually small (command output, diffs), sometimes a whole file, far
  more often in the first turns while the agent explores the code; now and then
  the user types a few words, after a longer think time;
* subagents run (``_run_subagents``): the answer spawned a few subagents *in
  parallel*. Each forks the current context (input + answer), appends its task,
  and runs its own growing turns; the file lists all their calls right after the
  spawning call. Their last answers (reports) come back as the tool result of the
  next main call, which waits for all of them (``Trace.joins``);
* compaction (``_restart_after_compaction``): when the context passed the
  threshold, this call was a "summarise the conversation" call; the next prompt
  restarts from the shared prefix + the summary + re-read files.

Token counts are lognormal draws (``AgentXParams``); ids come from the streams, so
each request owns a fresh array and the trace is chain-unique by construction.
"""
from __future__ import annotations

import numpy as np

from labkit.traces.agentx_params import AgentXParams
from labkit.traces.schema import TraceRequest
from labkit.traces.streams import IdMinter, TokenStream


def lognormal_tokens(rng: np.random.Generator, median: float, sigma: float,
                     size: int, lo: int = 1, hi: int = 2**31) -> np.ndarray:
    """Token counts: lognormal (median, sigma), rounded, clipped to [lo, hi]."""
    x = np.rint(median * np.exp(sigma * rng.standard_normal(size)))
    return np.clip(x, lo, hi).astype(np.int64)


class SessionBuilder:
    """Emits the requests of one session, in file order, into ``self.out``."""

    def __init__(self, p: AgentXParams, block_size: int, minter: IdMinter,
                 shared_ids: np.ndarray, out: list[TraceRequest]):
        self.p, self.bs, self.minter, self.shared_ids, self.out = \
            p, block_size, minter, shared_ids, out
        self.session_id = ""                       # set per session by build()
        self.rng: np.random.Generator | None = None

    # -- small helpers -------------------------------------------------------
    def _fresh_stream(self) -> TokenStream:
        return TokenStream(self.bs, self.minter, self.shared_ids, self.p.shared_prefix_tokens)

    def _tokens(self, median: float, sigma: float, hi: int = 2**31) -> int:
        """One draw of `lognormal_tokens(rng, median, sigma, 1, 1, hi)`, on numbers: the
        same normal, the same float operations (numpy's exp and rint), a tenth of the
        cost of (1,) arrays -- the generator draws some 60K of them per 400 sessions."""
        x = float(np.rint(median * np.exp(sigma * self.rng.standard_normal())))
        return int(min(max(x, 1), hi))

    def _gap(self, median_s: float, sigma: float) -> float:
        return float(min(median_s * np.exp(sigma * self.rng.standard_normal()),
                         self.p.max_delay_s))

    def _room(self, stream: TokenStream) -> int:
        """Tokens a stream may still grow by, leaving room for a full answer."""
        return max(1, self.p.context_window_tokens - self.p.output_max - stream.tokens)

    def _emit(self, request_id: str, parent_id: str | None, kind: str, delay_s: float,
              stream: TokenStream, output_length: int) -> TraceRequest:
        req = TraceRequest(self.session_id, request_id, parent_id, kind, delay_s,
                           stream.tokens, int(output_length), stream.prompt_ids())
        self.out.append(req)
        return req

    def _tool_result(self, file_read_prob: float) -> int:
        p = self.p
        if self.rng.random() < file_read_prob:
            return self._tokens(p.file_read_median, p.file_read_sigma, p.tool_result_max)
        return self._tokens(p.tool_result_median, p.tool_result_sigma, p.tool_result_max)

    def _spawn_turns(self, main_calls: int, subagents: int) -> dict[int, int]:
        """Which main calls spawn how many parallel subagents."""
        batches = []
        left = subagents
        while left > 0:
            size = min(left, 1 + int(self.rng.poisson(self.p.parallel_subagents_mean - 1.0)))
            batches.append(size)
            left -= size
        slots = main_calls - 1  # the last call has no next call to return results to
        while len(batches) > slots:  # too few calls: merge the smallest batches
            batches.sort()
            smallest = batches.pop(0)
            batches[0] += smallest
        turns = np.sort(self.rng.choice(slots, size=len(batches), replace=False))
        return {int(t): b for t, b in zip(turns, batches, strict=True)}

    # -- a session -------------------------------------------------------------
    def build(self, index: int, main_calls: int, subagents: int,
              rng: np.random.Generator) -> None:
        """Emit session ``index``: its main calls, and its subagents' calls right
        after the main call that spawned them."""
        p = self.p
        self.session_id, self.rng = f"s{index:05d}", rng
        spawns = self._spawn_turns(main_calls, subagents)
        due = 0  # subagents whose spawn turn has come (a compaction call defers them)
        main = self._fresh_stream()
        main.append(self._tokens(p.initial_context_median, p.initial_context_sigma,
                                 p.initial_context_max))
        n_calls, k, parent_id, delay, compacting = main_calls, 0, None, 0.0, False
        while k < n_calls:
            due += spawns.get(k, 0)
            if compacting:  # this call summarises the conversation
                main.append(p.compact_instruction_tokens)
                output = self._tokens(p.summary_median, p.summary_sigma, p.output_max)
            else:
                output = self._tokens(p.output_median, p.output_sigma, p.output_max)
            req = self._emit(f"{self.session_id}.m{k:03d}", parent_id, "main", delay,
                             main, output)
            spawning = due > 0 and not compacting
            if spawning and k == n_calls - 1:
                n_calls += 1  # spawns deferred to the last call: one more call for results
            if k == n_calls - 1:
                break
            if compacting:
                main, delay = self._restart_after_compaction(output)
            elif spawning:
                delay = self._run_subagents(main, req, due)
                due = 0
            else:
                delay = self._run_tools(main, req, k)
            compacting = main.tokens > p.compact_threshold_tokens
            parent_id, k = req.request_id, k + 1

    def _run_tools(self, main: TokenStream, call: TraceRequest, turn: int) -> float:
        """The call's tools run (and maybe the user types): the context grows by the
        call's output and the results. Returns the idle time before the next call."""
        p = self.p
        main.append(call.output_length)
        # Early turns explore the code base, so they read files far more often.
        explore = np.exp(-turn / p.explore_turns) if p.explore_turns > 0 else 0.0
        growth = self._tool_result(p.file_read_prob + explore * (
            p.explore_file_read_prob - p.file_read_prob))
        delay = self._gap(p.tool_gap_median_s, p.tool_gap_sigma)
        if self.rng.random() < p.user_text_prob:
            growth += self._tokens(p.user_text_median, p.user_text_sigma)
            delay = self._gap(p.think_time_median_s, p.think_time_sigma)
        main.append(min(growth, self._room(main)))
        return delay

    def _run_subagents(self, main: TokenStream, spawner: TraceRequest, count: int) -> float:
        """``count`` parallel subagents fork the context (input + output of
        ``spawner``); their reports come back as the tool result."""
        main.append(spawner.output_length)
        reports = sum(self._subagent(main.fork(), spawner, j) for j in range(count))
        growth = reports + count * self.p.subagent_result_overhead_tokens
        main.append(min(growth, self._room(main)))
        return self._gap(self.p.dispatch_gap_median_s, self.p.dispatch_gap_sigma)

    def _restart_after_compaction(self, summary: int) -> tuple[TokenStream, float]:
        """The next prompt: shared prefix + the summary + re-read files (new content)."""
        p = self.p
        main = self._fresh_stream()
        restored = self._tokens(p.restored_context_median, p.restored_context_sigma)
        main.append(min(summary + restored, self._room(main)))
        return main, self._gap(p.dispatch_gap_median_s, p.dispatch_gap_sigma)

    def _subagent(self, stream: TokenStream, fork_from: TraceRequest, slot: int) -> int:
        """Run one subagent forked from ``fork_from``; return its report's length."""
        p = self.p
        name = f"{fork_from.request_id}.a{slot:02d}"
        stream.append(self._tokens(p.subagent_task_median, p.subagent_task_sigma))
        n_calls = self._tokens(p.subagent_calls_median, p.subagent_calls_sigma,
                               p.subagent_calls_max)
        parent_id = fork_from.request_id
        delay = self._gap(p.dispatch_gap_median_s, p.dispatch_gap_sigma)
        for j in range(n_calls):
            output = self._tokens(p.output_median, p.output_sigma, p.output_max)
            req = self._emit(f"{name}.t{j:03d}", parent_id, "subagent", delay, stream, output)
            # The subagent wraps up at its planned end, or when its context is full.
            if j == n_calls - 1 or stream.tokens > p.compact_threshold_tokens:
                break
            growth = output + self._tool_result(p.subagent_file_read_prob)
            stream.append(min(growth, self._room(stream)))
            delay = self._gap(p.tool_gap_median_s, p.tool_gap_sigma)
            parent_id = req.request_id
        return output  # the last answer is the report handed back to the main agent
