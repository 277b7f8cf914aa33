"""The cross-version fuzzer (`tests/fuzz_revision.py`): a replay's digest is the same
in another process with the same code, and changes with what the replay gives."""

import subprocess
from collections import Counter

import pytest

from tests.fuzz_paths import replay_case
from tests.fuzz_revision import REPO, compare, digest, random_cases


def _labkit_unchanged() -> bool:
    done = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "labkit"],
                          capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _labkit_unchanged(), reason="labkit/ differs from HEAD here")
def test_the_same_code_in_another_process_gives_the_same_digests():
    differing = compare(seed=7, n=6, rev="HEAD")
    assert differing == []


def test_a_digest_follows_the_replay():
    case = next(c for c in random_cases(3, 40) if not c["pd"] and c["model"].startswith("tiny"))
    counts = Counter()
    first = digest(replay_case(case, counts=counts), counts)
    again = Counter()
    assert digest(replay_case(case, counts=again), again) == first
    other = dict(case, knobs=dict(case["knobs"], max_num_seqs=1))  # one call at a time
    assert digest(replay_case(other, counts=Counter()), Counter()) != first
    assert digest(replay_case(case, counts=Counter()), Counter({"FirstToken": 1})) != first
