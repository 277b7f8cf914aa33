"""The simulated data plane and its cost models (the step's work and timing they read
and write are the seam's types, `engine/step_work.py`)."""

from labkit.engine.sim.data_plane import SimDataPlane
from labkit.engine.sim.roofline import RooflineCostModel, RooflineParams

__all__ = ["RooflineCostModel", "RooflineParams", "SimDataPlane"]
