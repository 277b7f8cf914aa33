"""Loading and cutting traces run with the cycle collector paused (`collector.py`), and
leave it as they found it — after an error too."""
from __future__ import annotations

import gc

import pytest

from labkit.traces import TraceError, generate_random_trace, load_trace, select, write_trace
from labkit.traces import formats


def test_loads_pause_the_collector_and_restore_it(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    write_trace(generate_random_trace(num_prompts=5, request_rate=1.0, seed=0), path)
    seen = []
    real = formats.LOADERS["labkit"]
    monkeypatch.setitem(formats.LOADERS, "labkit",
                        lambda p: (seen.append(gc.isenabled()), real(p))[1])
    assert gc.isenabled()
    assert len(load_trace(path)) == 5 and seen == [False] and gc.isenabled()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"block_size": 16}\n')
    with pytest.raises(TraceError):
        load_trace(bad)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()  # a caller's choice is kept
    try:
        load_trace(path)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_select_pauses_the_collector_too(monkeypatch):
    from labkit.traces import parts

    trace = generate_random_trace(num_prompts=5, request_rate=1.0, seed=0)
    seen = []
    real = parts.Trace
    monkeypatch.setattr(parts, "Trace", lambda *a, **k: (seen.append(gc.isenabled()),
                                                         real(*a, **k))[1])
    assert len(select(trace, speedup=2.0)) == 5 and seen == [False] and gc.isenabled()
