"""`labkit sweep --executor ray` on a local Ray cluster of 2 CPUs gives the same
results.parquet as the local executor (up to the wall seconds each run took), and the
planner the same tables.

One cluster serves the module (it starts in ~40 s on a busy 2-core machine): started
here, it is one the executor finds running, uses and leaves running. Starting and
stopping a cluster of its own is `test_ray_executor_lifecycle.py`'s (a stand-in ray)."""

from __future__ import annotations

import pandas as pd
import pytest

from sweep_helpers import sweep, tiny_notebook

ray_module = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """A local cluster of 2 CPUs, as the executor would start for --jobs 2."""
    from labkit.experiments.executors import _start_ray

    _start_ray(ray_module, None, jobs=2)
    try:
        yield
    finally:
        ray_module.shutdown()


def test_ray_and_local_executors_write_the_same_results(tmp_path, capsys):
    notebook = tiny_notebook(tmp_path / "tiny.ipynb")
    grid = ["-p", "x", "1,3,4", "-p", "label", "a,b", "--jobs", "2", "--no-progress"]
    assert sweep([notebook, *grid, "--out", tmp_path / "local"]) == 1  # x=3 fails
    assert sweep([notebook, *grid, "--out", tmp_path / "ray", "--executor", "ray"]) == 1
    err = capsys.readouterr().err
    assert err.count(" failed: ") == 4, err  # x=3 (2 labels) under each executor
    assert err.count("failed: ValueError: x=3 is impossible") == 4

    local = pd.read_parquet(tmp_path / "local" / "results.parquet")
    ray = pd.read_parquet(tmp_path / "ray" / "results.parquet")
    assert len(local) == 6 and local["status"].tolist().count("ok") == 4
    # every run wrote into its own output_dir, under its own sweep
    assert local["summary.x"].dropna().tolist() == [1, 1, 4, 4]
    # equal but for run_s, the wall seconds each run took
    by_run = lambda f: f.sort_values("run").reset_index(drop=True).drop(columns=["run_s"])
    pd.testing.assert_frame_equal(by_run(local), by_run(ray))
    assert ray_module.is_initialized()  # the sweep left the cluster it found running


def test_the_planner_gives_the_same_tables_on_ray():
    from labkit.experiments.plan import plan
    from tests.support import small_agentx

    trace = small_agentx(6, seed=2)
    kwargs = dict(concurrency=(4,), duration_s=10.0, layouts=["tp1", "tp2"],
                  disaggregated=False, jobs=2, progress=False)
    local = plan(trace, "llama-3.1-8b", "h200", 2, "ttft=0.1", **kwargs)
    ray = plan(trace, "llama-3.1-8b", "h200", 2, "ttft=0.1", executor="ray", **kwargs)
    assert len(local.results) == 2 and (local.results["status"] == "ok").all()
    pd.testing.assert_frame_equal(local.results, ray.results)
    pd.testing.assert_frame_equal(local.best, ray.best)
