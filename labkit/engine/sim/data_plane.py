"""The simulated data plane: steps take the time a cost model predicts.

No tensors exist here. `execute` receives the step message (`step_io.StepInput`),
whose `StepWork` sums up what each rank computes, and asks the cost model how long
each rank is busy; the engine's virtual clock advances by the step's duration. There
are no bytes to copy, so commands are no-ops. Because the work of a steady decode
step is known in advance, this plane can also cost whole runs of them at once
(`supports_runs`), which the compute plane, running real kernels, cannot.
"""

from __future__ import annotations

from typing import Protocol

from labkit.engine.step_work import StepTiming, StepWork
from labkit.engine.step_io import StepInput, StepOutput


class StepCostModel(Protocol):
    """What the simulated data plane needs from a cost model.

    `step_timing` maps a (steps, ranks) StepWork to per-rank busy seconds and per-step
    durations (the slowest rank when `lockstep`); it must accept any number of steps
    and give each step the same seconds whether costed alone or in a batch of steps.
    `min_step_s` is a lower bound on any step's duration (> 0). A model that cannot
    price rows with prefill chunks apart from the others may say so with a false
    `prices_chunk_rows` (then runs carry no prefill chunks: `chunk_run.py`).
    The roofline model implements it; the calibrated, layout-aware model will too.
    """

    min_step_s: float

    def step_timing(self, work: StepWork, lockstep: bool) -> StepTiming: ...


class SimDataPlane:
    computes = False
    supports_runs = True

    def __init__(self, cost_model: StepCostModel) -> None:
        self.cost_model = cost_model

    @property
    def min_step_s(self) -> float:
        return self.cost_model.min_step_s

    def execute(self, step: StepInput) -> StepOutput:
        return StepOutput(self.cost_model.step_timing(step.work, step.lockstep))

    def apply(self, commands: list) -> None:
        """Nothing to copy or release: the simulated cluster holds no bytes."""

    def close(self) -> None:
        pass
