"""Differential fuzzing across versions: this tree's replays against a git revision's.

The paths fuzzer (`fuzz_paths.py`) replays a case two ways with one version of the
engine, so a change to code every path shares — the scheduler, the KV manager, the
block pool — cannot show there: both ways change alike. A change meant to make the
simulator faster, not different, is checked here instead: the same random cases
(`fuzz_paths.random_case`, with and without P/D) replayed on the default path with
this tree and with `labkit/` as it was at REV (`git archive`, as `labkit bench sim
--against` takes it), in a child process, and compared through a digest of each
replay — its requests and steps tables, its summary (wall-clock entries aside) and the
counts of the events the case watches.

    python tests/fuzz_revision.py SEED CASES [--rev REV] [--out DIR]

prints a line per case that differs (pickling it into DIR for `fuzz_paths.replay_case`)
and a count. REV defaults to HEAD: uncommitted changes against the last commit. The
child imports the revision's `labkit` first, then this tree's `tests/fuzz_paths.py`
(the cases and how to replay them), so REV must have what that file imports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
import labkit  # the revision's, before this tree's tests put the tree on the path
assert labkit.__file__.startswith(sys.argv[1]), labkit.__file__
sys.path.insert(0, sys.argv[2])
from tests.fuzz_revision import digests
sys.stdout.buffer.write(pickle.dumps(digests(pickle.loads(sys.stdin.buffer.read()))))
"""


def digest(result, counts: Counter) -> str:
    """What `fuzz_paths.differs` compares of a replay, as one hash."""
    import pandas as pd

    from tests.fuzz_paths import UNCOMPARED

    h = hashlib.sha256()
    for table in (result.requests, result.steps):
        h.update(json.dumps(list(map(str, table.columns))).encode())
        h.update(pd.util.hash_pandas_object(table, index=True).to_numpy().tobytes())
    kept = {k: v for k, v in result.summary.items() if k not in UNCOMPARED}
    h.update(json.dumps(kept, sort_keys=True, default=str).encode())
    h.update(json.dumps(sorted(counts.items())).encode())
    return h.hexdigest()


def digests(cases: list[dict]) -> list[str]:
    """Each case's digest on the default path ("refused": knobs the engine refuses,
    "crash: ..." where the replay raised)."""
    from labkit.errors import ConfigError
    from tests.fuzz_paths import replay_case

    out = []
    for case in cases:
        counts = Counter()
        try:
            out.append(digest(replay_case(case, counts=counts), counts))
        except ConfigError:
            out.append("refused")
        except Exception as e:  # noqa: BLE001 — a crash is a finding, compared like one
            out.append(f"crash: {type(e).__name__}: {e}")
    return out


def at_revision(rev: str, cases: list[dict]) -> list[str]:
    """`digests` of the cases with labkit as it was at `rev` (a child process)."""
    from labkit.bench_against import checkout

    with tempfile.TemporaryDirectory(prefix="labkit-rev-") as tmp:
        checkout(REPO, rev, Path(tmp))
        done = subprocess.run([sys.executable, "-c", _CHILD, tmp, str(REPO)],
                              input=pickle.dumps(cases), capture_output=True, cwd=tmp)
    if done.returncode:
        raise RuntimeError(f"the replays at {rev} failed:\n{done.stderr.decode()[-2000:]}")
    return pickle.loads(done.stdout)


def random_cases(seed: int, n: int) -> list[dict]:
    """n cases of the paths fuzzer, one in five a P/D pair of groups."""
    from tests.fuzz_paths import random_case

    rng = random.Random(seed)
    return [random_case(rng, pd=rng.random() < 0.2) for _ in range(n)]


def compare(seed: int, n: int, rev: str = "HEAD") -> list[tuple[int, dict, str, str]]:
    """(index, case, this tree's digest, the revision's) of each case that differs."""
    cases = random_cases(seed, n)
    ours, theirs = digests(cases), at_revision(rev, cases)
    return [(i, case, a, b) for i, (case, a, b) in enumerate(zip(cases, ours, theirs))
            if a != b]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seed", type=int)
    ap.add_argument("cases", type=int)
    ap.add_argument("--rev", default="HEAD", help="the git revision to compare with")
    ap.add_argument("--out", type=Path, default=Path("fuzz-cases"))
    args = ap.parse_args()
    differing = compare(args.seed, args.cases, args.rev)
    for i, case, ours, theirs in differing:
        args.out.mkdir(exist_ok=True)
        path = args.out / f"rev-case-{args.seed}-{i}.pkl"
        path.write_bytes(pickle.dumps(case))
        print(f"DIFF case {i}: {ours[:40]} vs {theirs[:40]} {case['model']} {case['knobs']} "
              f"{case['trace']} -> {path}", flush=True)
    print(f"{args.cases} cases replayed with this tree and at {args.rev}, "
          f"{len(differing)} differ")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
