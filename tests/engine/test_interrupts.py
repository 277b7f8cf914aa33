"""Ctrl-C during a replay is raised between events (`labkit/engine/interrupts.py`):
numba's dispatcher turned one that came inside a compiled call into SystemErrors, or
lost it (`labkit replay` ran on)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from labkit.engine import Engine
from labkit.engine.interrupts import SafeInterrupt, interrupted
from labkit.traces import generate_random_trace


@pytest.fixture
def python_sigint():
    """SIGINT as a program's main thread has it (a test runner's worker may not)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_is_noted_then_raised_at_a_check_and_a_second_at_once(python_sigint):
    with SafeInterrupt() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested  # (the handler has run: nothing was raised)
        with pytest.raises(KeyboardInterrupt):
            stop.check()
        stop.check()  # taken: nothing pending
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second one: at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_other_threads_and_handlers_are_left_alone(python_sigint):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(
        (SafeInterrupt().__enter__()._previous, signal.getsignal(signal.SIGINT))))
    thread.start()
    thread.join()
    assert seen == [(None, signal.default_int_handler)]
    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGINT, mine)
    with SafeInterrupt():
        assert signal.getsignal(signal.SIGINT) is mine


def test_a_replay_interrupted_mid_run_raises_between_events(python_sigint, monkeypatch):
    engine = Engine("llama-3.1-8b", "tp1", "h200")
    steps, finished = [], []
    real = Engine.step

    def step(self):
        steps.append(self.now)
        if len(steps) == 5:
            os.kill(os.getpid(), signal.SIGINT)  # (as if during the step's compiled work)
        more = real(self)
        finished.append(len(steps))
        return more

    monkeypatch.setattr(Engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        engine.replay(generate_random_trace(num_prompts=200, request_rate=5.0, seed=0),
                      open_loop=True)
    assert len(steps) == 5 and finished[-1] == 5  # the 5th step ran out, then it stopped
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_numba_reported_as_system_errors_is_an_interrupt():
    try:
        try:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as ki:
                raise SystemError("returned a result with an exception set") from ki
        except SystemError as inner:
            raise SystemError("returned a result with an exception set") from inner
    except SystemError as outer:
        assert interrupted(outer)
    assert not interrupted(SystemError("another"))
