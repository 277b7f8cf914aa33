"""Sweep workers that never outlive the sweep, and stop at once when asked.

A sweep runs its points in worker processes, each of which starts a Jupyter kernel.
Two ways a sweep ends early must leave nothing running:

- **the sweep is killed** (SIGKILL, an out-of-memory kill, a closed terminal): it
  cannot clean up, so each worker asks the Linux kernel to kill it when its parent
  dies (`prctl(PR_SET_PDEATHSIG, SIGKILL)`), and checks once that the parent is still
  the one that started it (it may have died before that call). Elsewhere a watchdog
  thread polls the parent. A worker's Jupyter kernel watches *its* parent the same
  way (ipykernel's parent poller, via ``JPY_PARENT_PID``), so it follows within a
  second; multiprocessing's resource tracker exits once every process that shared
  its pipe is gone.
- **Ctrl-C**: the terminal sends SIGINT to the whole foreground process group. Only
  the sweep itself should decide what happens, so workers ignore SIGINT (kernels run
  in sessions of their own anyway); the sweep then kills its workers and their
  kernels (`stop_workers`), keeps the runs that finished and removes the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCHDOG_S = 0.5


def worker_init(parent_pid: int) -> None:
    """Runs first in every worker process (ProcessPoolExecutor's initializer)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not _die_with_parent():
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before we could ask
        os._exit(1)


def _die_with_parent() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCHDOG_S)
    os._exit(1)


def stop_workers(pool) -> None:
    """Kill a ProcessPoolExecutor's workers and everything they started (their Jupyter
    kernels run in sessions of their own, so a signal to the group misses them)."""
    workers = list(getattr(pool, "_processes", {}).values())
    doomed = [p.pid for p in workers if p.pid is not None]
    doomed += [pid for p in doomed for pid in descendants(p)]
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for p in workers:
        p.join(5)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
