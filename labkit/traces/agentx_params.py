"""The knobs of the AgentX-like generator, with defaults calibrated to the
published statistics of Claude Code traces (SemiAnalysis AgentX):

    main-agent calls per session (median)         43
    input tokens per call, all calls (median)     ~142K
    output tokens per call (median)               ~444
    prefix reuse (infinite cache)                 >= 0.96
    sessions that spawn >= 1 subagent             44 %
    subagents per spawning session (mean)         4

Most quantities are lognormal, given by a median and ``sigma`` (the standard
deviation of the log): the median is exp(mu) and sigma sets the tail
(p90 = median * exp(1.28 * sigma)). Token counts are rounded and clipped to the
stated bounds. The calibration was done at the defaults; change one knob and the
headline statistics move (that is the point of knobs), so re-check them with
``trace_stats``.

Context window: the defaults assume a 1M-token window, so compaction is rare.
With a 200K window (``context_window_tokens=200_000,
compact_threshold_tokens=167_000``) long sessions compact every few dozen turns
and the median prompt drops to ~100K: a sawtooth between a restarted context
and the threshold cannot have a 142K median without prefix reuse falling.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from labkit import checks
from labkit.errors import ConfigError
from labkit.traces.validate import MAX_PROMPT_TOKENS


@dataclass(slots=True, frozen=True)
class AgentXParams:
    # -- sessions ------------------------------------------------------------
    main_calls_median: float = 43.0      # main-agent calls per session
    main_calls_sigma: float = 0.7
    main_calls_min: int = 2
    main_calls_max: int = 400
    subagent_session_share: float = 0.44   # sessions that spawn >= 1 subagent
    subagents_per_spawning_mean: float = 4.0  # 1 + geometric tail, capped below
    subagents_max: int = 32
    parallel_subagents_mean: float = 1.8   # subagents spawned by one main call (1 + Poisson)

    # -- what every prompt starts with -----------------------------------------
    shared_prefix_tokens: int = 18_000   # system prompt + tool definitions: same ids everywhere
    initial_context_median: float = 13_000  # CLAUDE.md, memory, git status, the user's task
    initial_context_sigma: float = 0.8
    initial_context_max: int = 60_000

    # -- one turn of the main agent ----------------------------------------------
    output_median: float = 444.0         # generated tokens per call (mostly tool calls)
    output_sigma: float = 1.0
    output_max: int = 16_000
    tool_result_median: float = 800.0  # command output, search hits, edit diffs
    tool_result_sigma: float = 1.2
    file_read_prob: float = 0.04         # turns that read a large file instead...
    explore_file_read_prob: float = 0.6  # ...much more often early on (exploring the code),
    explore_turns: float = 5.0           # decaying to file_read_prob with this time constant
    subagent_file_read_prob: float = 0.25  # subagents mostly search and read
    file_read_median: float = 9_000.0
    file_read_sigma: float = 0.7
    tool_result_max: int = 25_000        # Claude Code truncates longer tool output
    user_text_prob: float = 0.08         # turns where the user types something
    user_text_median: float = 60.0
    user_text_sigma: float = 1.0

    # -- context window and compaction -------------------------------------------
    context_window_tokens: int = 1_000_000
    compact_threshold_tokens: int = 800_000  # prompts beyond this trigger compaction
    compact_instruction_tokens: int = 400    # "summarise the conversation so far"
    summary_median: float = 3_000.0          # the compaction call's output
    summary_sigma: float = 0.4
    restored_context_median: float = 15_000.0  # re-read files + todo list after compaction
    restored_context_sigma: float = 0.6

    # -- subagents ---------------------------------------------------------------
    subagent_task_median: float = 400.0      # the task prompt appended to the fork
    subagent_task_sigma: float = 0.6
    subagent_calls_median: float = 8.0       # calls of one subagent
    subagent_calls_sigma: float = 0.7
    subagent_calls_max: int = 60
    subagent_result_overhead_tokens: int = 30  # tool-result wrapper per returned report

    # -- idle time between calls (seconds) ---------------------------------------
    tool_gap_median_s: float = 4.0       # a tool runs (lognormal body of the gaps)
    tool_gap_sigma: float = 1.0
    think_time_median_s: float = 45.0    # the user reads and types (turns with user text)
    think_time_sigma: float = 1.0
    dispatch_gap_median_s: float = 0.3   # spawning a subagent, resuming after it / compaction
    dispatch_gap_sigma: float = 0.5
    max_delay_s: float = 900.0

    def __post_init__(self) -> None:
        """Refuse knobs that make no workload, naming the knob (a ConfigError)."""
        for f in fields(self):
            name, value = f.name, getattr(self, f.name)
            if name.endswith(("_prob", "_share")):
                checks.number(name, value, low=0.0, high=1.0)
            elif name.endswith("_sigma"):  # (past 10, a draw is 0 or e**100 times the median)
                checks.number(name, value, low=0.0, high=10.0)
            elif name.endswith(("_median", "_median_s", "_mean")) or name == "explore_turns":
                checks.number(name, value, low=0.0, low_open=True, high=MAX_PROMPT_TOKENS)
            elif name.endswith("_max"):
                checks.number(name, value, low=1, high=MAX_PROMPT_TOKENS)
            else:  # token counts, delays (a prompt's worth of tokens at most)
                checks.number(name, value, low=0, high=MAX_PROMPT_TOKENS)
        if self.subagents_per_spawning_mean < 1.0:
            raise ConfigError("subagents_per_spawning_mean must be >= 1")
        if self.parallel_subagents_mean < 1.0:
            raise ConfigError("parallel_subagents_mean must be >= 1")
        if not 2 <= self.main_calls_min <= self.main_calls_max:
            raise ConfigError("need 2 <= main_calls_min <= main_calls_max")
        if self.compact_threshold_tokens + self.output_max >= self.context_window_tokens:
            raise ConfigError(f"compact_threshold_tokens + output_max must leave room in "
                              f"context_window_tokens (got {self.compact_threshold_tokens} + "
                              f"{self.output_max} >= {self.context_window_tokens})")


# Knobs of a *miniature* agentic workload for the compute plane on a CPU: the same
# session shape (shared prefix, growing context, tool results, subagent forks,
# compaction) at roughly 1/500 of the token counts, so a tiny model replays it in
# seconds. `generate_agentx_trace(n, block_size=16, **TINY_AGENTX)`.
TINY_AGENTX = dict(
    main_calls_median=5.0, main_calls_max=12, subagent_session_share=0.7,
    subagents_max=4, shared_prefix_tokens=32, initial_context_median=24.0,
    initial_context_max=96, output_median=6.0, output_max=24, tool_result_median=12.0,
    file_read_median=40.0, tool_result_max=96, user_text_median=6.0,
    context_window_tokens=640, compact_threshold_tokens=480, compact_instruction_tokens=8,
    summary_median=12.0, restored_context_median=24.0, subagent_task_median=10.0,
    subagent_calls_median=3.0, subagent_calls_max=6, subagent_result_overhead_tokens=4,
)
