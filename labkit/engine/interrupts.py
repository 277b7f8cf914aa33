"""Ctrl-C between a replay's events, not inside one.

A replay spends most of its time in compiled (numba) functions. A SIGINT that arrives
during one of their calls is raised by Python around it, and numba's dispatcher does not
always pass it on: it can come out as a chain of SystemErrors ("returned a result with an
exception set") or, while the dispatcher picks a compiled version, be lost altogether
(under load, ~1 Ctrl-C in 40 in `labkit replay`; the replay ran on). So while a replay
runs, Ctrl-C only notes the request (`SafeInterrupt`), and the replay loop raises
KeyboardInterrupt between two events, where nothing is half done. A second Ctrl-C raises
at once, wherever the program is. Python delivers signals to the main thread only: in
another thread, or where SIGINT has a handler of someone else's (not Python's default),
nothing changes. The previous handler comes back when the replay ends.
"""

from __future__ import annotations

import signal
import threading


class SafeInterrupt:
    """A context: inside, SIGINT sets `requested` (a second one raises); `check()`
    raises KeyboardInterrupt where a request is pending."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> SafeInterrupt:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _note(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        if self.requested:
            self.requested = False
            raise KeyboardInterrupt


def interrupted(err: BaseException) -> bool:
    """Is a KeyboardInterrupt the root of this chain of SystemErrors? (numba's dispatcher
    reports a Ctrl-C that came during its call as "returned a result with an exception
    set", one SystemError per level, each caused by the one below.)"""
    while isinstance(err, SystemError):
        err = err.__cause__
    return isinstance(err, KeyboardInterrupt)
