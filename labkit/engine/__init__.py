"""The control plane: engine, requests, scheduler, router, events, metrics.

Plain Python (and numpy): no torch here, so the same code drives the simulated and
the real data planes.
"""

from labkit.engine.engine import Engine
from labkit.engine.events import EventBus
from labkit.engine.metrics import ReplayResult
from labkit.engine.request import Request, Status

__all__ = ["Engine", "EventBus", "ReplayResult", "Request", "Status"]
