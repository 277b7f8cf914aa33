"""labkit: a Jupyter-first research workbench for serving LLMs to agentic workloads.

    from labkit import Engine, load_trace, generate_agentx_trace
    trace = generate_agentx_trace(num_sessions=16, seed=0)
    engine = Engine(model="deepseek-v3", layout="dep16", hardware="h200")
    result = engine.replay(trace, concurrency=16, duration_s=300)
    result.summary, result.requests, result.steps

    CostModel("h200").step_time("deepseek-v3", "tp8xdcp8", [{"new_tokens": 1, "context": 8192}])
    capacity("deepseek-v3", "tp8xdcp8", "h200", context=1_000_000)
"""

from labkit.lazy_exports import lazy_exports

# where each name lives: imported on first use (labkit/lazy_exports.py)
__getattr__, __dir__ = lazy_exports(__name__, {
    "CostModel": "labkit.costmodel",
    "Engine": "labkit.engine", "EventBus": "labkit.engine", "ReplayResult": "labkit.engine",
    "Request": "labkit.engine",
    "capacity": "labkit.engine.capacity", "capacity_table": "labkit.engine.capacity",
    **dict.fromkeys(["HARDWARE_PRESETS", "MODEL_PRESETS", "EngineConfig", "HardwareSpec",
                     "Layout", "ModelSpec", "get_hardware", "get_model"], "labkit.specs"),
    **dict.fromkeys(["Trace", "TraceError", "TraceRequest", "generate_agentx_trace",
                     "load_trace", "trace_stats", "write_trace"], "labkit.traces"),
})

__all__ = [
    "CostModel", "Engine", "EngineConfig", "EventBus", "HARDWARE_PRESETS", "HardwareSpec",
    "Layout", "MODEL_PRESETS", "ModelSpec", "ReplayResult", "Request", "Trace", "TraceError",
    "TraceRequest", "capacity", "capacity_table", "generate_agentx_trace", "get_hardware",
    "get_model", "load_trace", "trace_stats", "write_trace",
]
__version__ = "0.1.0"
