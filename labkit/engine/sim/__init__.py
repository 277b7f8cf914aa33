"""The simulated data plane and its cost models."""

from labkit.engine.sim.data_plane import SimDataPlane
from labkit.engine.sim.roofline import RooflineCostModel, RooflineParams
from labkit.engine.sim.work import StepTiming, StepWork

__all__ = ["RooflineCostModel", "RooflineParams", "SimDataPlane", "StepTiming", "StepWork"]
