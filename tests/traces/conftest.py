"""Fixtures for the trace tests: the shared reference data, and trace_helpers on sys.path."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `import trace_helpers`

REPO_ROOT = Path(__file__).resolve().parents[2]
MOONCAKE_NAME = "traces/mooncake_synthetic_trace.jsonl"


@pytest.fixture(scope="session")
def mooncake_path() -> Path:
    """The Mooncake reference trace in the shared data folder (not in the repo)."""
    for data in (REPO_ROOT.parent / "shared" / "data", Path("/work/shared/data")):
        if (data / MOONCAKE_NAME).is_file():
            return data / MOONCAKE_NAME
    pytest.skip(f"reference data absent: ../shared/data/{MOONCAKE_NAME} (relative to the "
                f"repository root {REPO_ROOT}) is only in the project's workspace")
