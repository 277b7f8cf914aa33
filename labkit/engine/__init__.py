"""The control plane: engine, requests, scheduler, router, events, metrics.

Plain Python (and numpy): no torch here, so the same code drives the simulated and
the real data planes.
"""

from labkit.lazy_exports import lazy_exports

# imported on first use (labkit/lazy_exports.py): a rank process imports
# `labkit.engine.compute...` without the engine, its metrics and their pandas
__getattr__, __dir__ = lazy_exports(__name__, {
    "Engine": "labkit.engine.engine", "EventBus": "labkit.engine.events",
    "ReplayResult": "labkit.engine.metrics", "Request": "labkit.engine.request",
    "Status": "labkit.engine.request"})

__all__ = ["Engine", "EventBus", "ReplayResult", "Request", "Status"]
