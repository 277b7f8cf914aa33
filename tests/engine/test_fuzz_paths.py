"""A few fixed seeds of the paths fuzzer (`tests/fuzz_paths.py`): random presets,
layouts, knobs and loads, each replayed on the reference path and the default, bit for
bit. The fuzzer runs for as long as one likes from the command line; these seeds keep a
broad sample of it in the suite (~2 min on two cores)."""

import random

import pytest

from tests.fuzz_paths import check_case, random_case

SAMPLES = {  # against which path, P/D or not, seeds, how many must be legal cases
    "fast-forward, one engine": ("step", False, range(30), 18),
    # (seed 19, a P/D case of 28 s alone -- as long as the other 21 together -- is left
    # to the command-line fuzzer, whose first case is it: `fuzz_paths.py 19 1 --pd`)
    "fast-forward, P/D": ("step", True, [s for s in range(22) if s != 19], 12),
    "memo": ("memo", False, range(40, 56), 8),
    "driven by hand": ("drive", False, range(60, 80), 12),
    "driven by hand, P/D": ("drive", True, range(80, 88), 4),
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_fixed_seeds_of_the_paths_fuzzer_agree_bit_for_bit(name):
    against, pd, seeds, least = SAMPLES[name]
    compared, differing = 0, []
    for seed in seeds:
        case = random_case(random.Random(seed), pd)
        diff = check_case(case, against)
        if diff is None:
            continue  # knobs the engine refuses (a model too big for the layout, ...)
        compared += 1
        if diff:
            differing.append((seed, diff, case))
    assert not differing
    assert compared >= least
