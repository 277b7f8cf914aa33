"""End-to-end validation: the simulator against measured vLLM serving runs.

`labkit validate` replays every measured run of ../shared/data/e2e in distribution —
the run's model, GPU, TP layout and vLLM knobs; its workload's rates, stages, prompt
lengths and prefix groups — and reports, per run and as median APE over runs, TTFT
mean / p90, E2E mean / p90, TPOT and throughput, separately for the runs the step
overheads were fitted on and for the held-out ones.

Reading order: `runs` (what was measured, the fitted / held-out split), `workload`
(a run's traffic as a trace), `simulate` (one replay, measured as the client did),
`report` (`validate`, the comparison), `fit` (the overhead constants), `cli`.
"""

from labkit.validate.report import ValidationResult, validate
from labkit.validate.runs import load_runs

__all__ = ["ValidationResult", "load_runs", "validate"]
