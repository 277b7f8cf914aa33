"""Test helpers shared by several folders: small traces, where reference data lives."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = next((p for p in (REPO.parent / "shared" / "data", Path("/work/shared/data"))
                    if p.is_dir()), REPO.parent / "shared" / "data")
MOONCAKE = SHARED_DATA / "traces" / "mooncake_synthetic_trace.jsonl"

# AgentX-shaped sessions scaled down so a replay takes milliseconds.
SMALL_AGENTX = dict(
    shared_prefix_tokens=512, initial_context_median=600, initial_context_max=4000,
    output_median=40, output_max=400, tool_result_median=120, tool_result_max=3000,
    file_read_median=1500, main_calls_median=10, subagent_task_median=100,
    subagent_calls_median=3, summary_median=200, restored_context_median=800,
    compact_threshold_tokens=20_000, context_window_tokens=40_000,
)


def small_agentx(sessions: int = 6, seed: int = 0, block_size: int = 16):
    from labkit import generate_agentx_trace

    return generate_agentx_trace(sessions, seed=seed, block_size=block_size, **SMALL_AGENTX)


class FixedStepCost:
    """Every step takes the same time (10 ms), whatever the layout: runs of different
    layouts of one DP rank then schedule identically (same batches, same preemptions),
    and a fuzzed run costs only the control plane's work."""

    min_step_s = 0.01

    def step_timing(self, work, lockstep):
        import numpy as np

        from labkit.engine.step_work import StepTiming

        steps, ranks = work.idle.shape
        busy = np.full((steps, ranks), self.min_step_s)
        zero = np.zeros((steps, ranks))
        return StepTiming(busy, busy.copy(), zero, np.full(steps, self.min_step_s), zero)


# ------------------------------------------------------------- a JupyterLab server
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc, url: str, token: str, log: Path, name: str) -> None:
    """Wait (up to 2 min) until the Jupyter server `proc` answers at `url`; a server
    that exits or never answers fails the test with the end of its log."""
    import time
    import urllib.request

    import pytest

    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
    proc.terminate()
    pytest.fail(f"{name} did not start:\n{log.read_text()[-3000:]}")
