"""Two "nodes" under torchrun compute what one process with thread ranks computes.

`labkit replay --executor mp` is launched twice by torchrun on this machine
(`--nnodes 2 --nproc-per-node 1`, static master on 127.0.0.1), as two machines would run
it: node 0's process drives, node 1's serves. Its requests' generated tokens must equal
those of the same replay with `--executor threads` in one process.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

BIN = Path(sys.executable).parent


def replay_args(trace: Path, out: Path, executor: str) -> list[str]:
    return ["replay", "--trace", str(trace), "--model", "tiny-llama", "--layout", "tp2",
            "--backend", "compute", "--clock", "predicted", "--concurrency", "1",
            "--no-loop-trace", "--executor", executor, "--out", str(out), "--json"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_torchrun_matches_threads(tmp_path):
    trace = tmp_path / "t.jsonl"
    subprocess.run([sys.executable, "-m", "labkit", "trace", "gen", "--kind", "agentx",
                    "--sessions", "1", "--seed", "2", "--tiny", "--out", str(trace)],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "labkit",
                    *replay_args(trace, tmp_path / "threads", "threads")],
                   check=True, capture_output=True, timeout=300)
    port = str(free_port())
    nodes = [subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(n), "--master-addr", "127.0.0.1",
                               "--master-port", port, "-m", "labkit",
                               *replay_args(trace, tmp_path / "mp", "mp")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (1, 0)]
    try:
        results = [p.communicate(timeout=400) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], results[1][1][-2000:]
    a = pd.read_parquet(tmp_path / "threads" / "requests.parquet")
    b = pd.read_parquet(tmp_path / "mp" / "requests.parquet")
    assert len(a) >= 3 and list(a.request_id) == list(b.request_id)
    assert a.output_token_ids.map(list).tolist() == b.output_token_ids.map(list).tolist()
    assert a.output_tokens.sum() > 0
