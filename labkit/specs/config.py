"""The engine's knobs, named as vLLM names them.

`EngineConfig` gathers every scheduling and cache knob in one validated dataclass.
Each field carries its help text and, where there is a closed set, its allowed
values; the CLI builds one ``--flag`` per field from that metadata, so the Python API
and `labkit replay` can never drift apart. Unknown knobs and out-of-range values are
rejected with the knob's name and what it accepts.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from fractions import Fraction

from labkit.errors import ConfigError

ROUTER_POLICIES = ("round_robin", "least_loaded", "least_kv", "least_running_tokens",
                   "session_sticky", "prefix_aware")
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL", "PIECEWISE", "NONE")
MOE_ROUTINGS = ("balanced", "power_law_1.01", "power_law_1.2")
SAMPLINGS = ("top_p", "random", "greedy")  # engine/sim/sampler_cost.py prices each

# Mean accepted tokens per verify step per draft token, used when only
# num_speculative_tokens is given (AgentX runs: 3 drafts, 2.99 accepted per step).
DEFAULT_ACCEPT_PER_DRAFT = 0.66


def knob(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(slots=True)
class EngineConfig:
    block_size: int | None = knob(None, "tokens per KV block (default: the model's)")
    num_gpu_blocks_override: int | None = knob(
        None, "KV blocks per DP rank, instead of what fits in GPU memory")
    gpu_memory_utilization: float = knob(0.9, "fraction of GPU memory the engine may use")
    max_num_batched_tokens: int = knob(8192, "token budget of one step")
    max_num_seqs: int = knob(256, "most requests running at once per DP rank")
    max_model_len: int | None = knob(None, "longest prompt + output (default: the model's)")
    enable_prefix_caching: bool = knob(True, "reuse KV of identical prefixes")
    enable_chunked_prefill: bool = knob(True, "split long prefills across steps")
    long_prefill_token_threshold: int = knob(
        0, "at most this many tokens of one request per step (0: no limit)")
    prefill_schedule_interval: int = knob(
        1, "prefill work runs on steps that are multiples of this; in between, a rank that "
        "can decode defers its prefills unless saturated (vLLM's DP prefill balancing)")
    scheduling_policy: str = knob("fcfs", "order of the waiting queue", SCHEDULING_POLICIES)
    num_speculative_tokens: int = knob(0, "draft tokens verified per decode step (MTP)")
    acceptance_length: float | None = knob(
        None, "mean tokens accepted per verify step, in [1, 1 + num_speculative_tokens] "
        f"(default: 1 + {DEFAULT_ACCEPT_PER_DRAFT} per draft token)")
    kv_cache_dtype: str = knob("auto", "dtype of the KV cache (auto: bf16)", KV_CACHE_DTYPES)
    decode_context_parallel_size: int | None = knob(
        None, "DCP degree; must agree with the layout's dcp (default: the layout's)")
    dcp_kv_cache_interleave_size: int = knob(
        1, "tokens per DCP shard before moving to the next rank")
    router: str = knob("least_loaded", "how requests are spread over DP ranks",
                       ROUTER_POLICIES)
    session_kv_migration: str = knob(
        "fetch", "a call routed away from the rank holding its session's KV: fetch that KV "
        "over the interconnect, or recompute it", ("fetch", "recompute"))
    cpu_kv_gib: float = knob(
        0.0, "GiB of CPU DRAM per node that holds KV offloaded from its GPUs (0: no CPU tier)")
    disk_kv_gib: float = knob(
        0.0, "GiB of node-local disk that holds KV evicted from the CPU tier (0: no disk tier)")
    kv_offload_eviction: str = knob("lru", "which blocks an offload tier keeps when full",
                                    ("lru", "arc"))
    kv_offload_dir: str | None = knob(
        None, "compute plane: where the disk tier writes its block files (default: a "
        "temporary directory)")
    kv_offload_strict: bool = knob(
        False, "compute plane: stop with an error when the disk tier cannot write a block "
        "or finds one damaged (default: recompute it, warn once, count it in the summary)")
    kv_layout: str = knob(
        "per_layer", "KV memory layout: one buffer per layer (a block is one region per "
        "layer) or packed (a block's layers contiguous: one copy descriptor per block)",
        ("per_layer", "packed"))
    hisparse_buffer_tokens: int = knob(
        0, "DSA models, sim: decode from a host KV pool, keeping this many tokens of each "
        "request's latents on the GPU (HiSparse; 0: off)")
    hisparse_host_gib: float = knob(
        0.0, "HiSparse host pool per GPU in GiB (0: 80 percent of the node's host memory, shared)")
    linear_state_retention: str = knob(
        "both", "hybrid models: when to snapshot linear-attention state for prefix reuse "
        "(interval: end of every call; selective: a prefix seen a second time)",
        ("both", "interval", "selective", "none"))
    # ---- step overheads and MoE routing (engine/sim/overheads.py, costmodel/routing.py)
    cudagraph_mode: str = knob(
        "FULL_AND_PIECEWISE", "CUDA graphs (vLLM compilation_config.cudagraph_mode): FULL "
        "graphs for uniform decode batches, PIECEWISE for the rest, eager beyond the "
        "capture sizes", CUDAGRAPH_MODES)
    cudagraph_capture_sizes: str | None = knob(
        None, "token counts with a captured graph, comma-separated, e.g. 1,2,4,8 (default: "
        "vLLM's 1, 2, 4, 8, 16, ... up to max_cudagraph_capture_size)")
    max_cudagraph_capture_size: int | None = knob(
        None, "largest captured batch in tokens (default: min(2 * max_num_seqs * (1 + "
        "drafts), 512, max_num_batched_tokens))")
    async_scheduling: bool = knob(
        True, "schedule step N+1 while step N runs: CPU work overlaps the GPU, newly "
        "arrived requests wait one more step")
    sampling: str = knob(
        "top_p", "what the sampler does to every row, over the whole vocabulary (a "
        "server takes the model's generation_config when the client sends no sampling "
        "parameters; most set top_p): top_p (top-k / top-p filtering: a sort), random "
        "(temperature only), greedy (temperature 0). It prices the sampler (sim, predicted "
        "clock); the compute plane's own tokens are greedy", SAMPLINGS)
    moe_routing: str = knob(
        "power_law_1.2", "how tokens pick MoE experts (the calibration data's distributions):"
        " skewed routing makes expert-parallel steps wait for the busiest rank", MOE_ROUTINGS)
    enable_eplb: bool = knob(False, "expert-parallel load balancer: replicate hot experts")
    num_redundant_experts: int = knob(
        0, "EPLB: extra expert replicas per MoE layer, spread over the EP ranks")
    # ----
    seed: int = knob(0, "seed of every random choice")
    sim_fast_forward: bool = knob(
        True, "simulate runs of steady decode steps in one go (same results, faster)")
    sim_step_cache: bool = knob(
        True, "remember step costs that depend only on token counts (same results, faster)")

    def __post_init__(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if isinstance(sizes, (list, tuple)):  # Python callers may pass a list, as vLLM takes
            self.cudagraph_capture_sizes = ",".join(str(s) for s in sizes)
        self.validate()

    # -------------------------------------------------------------- creation
    @classmethod
    def from_knobs(cls, **knobs) -> EngineConfig:
        """Build from keyword knobs, naming any unknown one and the allowed set."""
        names = knob_names()
        unknown = sorted(set(knobs) - set(names))
        if unknown:
            raise ConfigError(
                f"unknown engine knob {unknown[0]!r}; allowed: {', '.join(names)}"
            )
        return cls(**knobs)

    # ------------------------------------------------------------ validation
    def validate(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            _check_type(f.name, f.type, value)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name}={value} must be a finite number")
            if choices and value not in choices:
                raise ConfigError(
                    f"{f.name}={value!r} is not allowed; allowed: {', '.join(choices)}"
                )
        _positive(self, "max_num_batched_tokens", "max_num_seqs", "prefill_schedule_interval",
                  "dcp_kv_cache_interleave_size")
        _positive_or_none(self, "block_size", "num_gpu_blocks_override", "max_model_len",
                          "decode_context_parallel_size")
        _at_least(self, 0, "long_prefill_token_threshold", "num_speculative_tokens", "seed")
        if self.cpu_kv_gib < 0 or self.disk_kv_gib < 0:
            raise ConfigError(f"cpu_kv_gib={self.cpu_kv_gib} and disk_kv_gib="
                              f"{self.disk_kv_gib} must be >= 0")
        if self.hisparse_buffer_tokens < 0 or self.hisparse_host_gib < 0:
            raise ConfigError(f"hisparse_buffer_tokens={self.hisparse_buffer_tokens} and "
                              f"hisparse_host_gib={self.hisparse_host_gib} must be >= 0")
        if self.disk_kv_gib and not self.cpu_kv_gib:
            raise ConfigError("disk_kv_gib needs a CPU tier above it: set cpu_kv_gib too "
                              "(blocks reach the disk when the CPU tier evicts them)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        k = self.num_speculative_tokens
        if self.acceptance_length is not None and not 1 <= self.acceptance_length <= 1 + k:
            raise ConfigError(
                f"acceptance_length={self.acceptance_length} must be in [1, {1 + k}] "
                f"with num_speculative_tokens={k}"
            )
        self.capture_sizes()  # a malformed list fails here, naming the knob
        _positive_or_none(self, "max_cudagraph_capture_size")
        _at_least(self, 0, "num_redundant_experts")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ConfigError(f"num_redundant_experts={self.num_redundant_experts} needs "
                              "enable_eplb=True (redundant experts are EPLB's replicas)")
        if self.max_num_batched_tokens < 1 + k:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one "
                f"verify step of {1 + k} tokens"
            )

    # --------------------------------------------------------------- derived
    @property
    def tokens_per_decode_step(self) -> int:
        """Tokens a decoding request sends through the model each step (1 + drafts)."""
        return 1 + self.num_speculative_tokens

    @property
    def acceptance(self) -> Fraction:
        """Mean accepted tokens per verify step, exact (2.99 -> 299/100): the decimal
        the user wrote, not the binary float nearest to it."""
        if self.acceptance_length is not None:
            return Fraction(str(self.acceptance_length))
        per_draft = Fraction(str(DEFAULT_ACCEPT_PER_DRAFT))
        return 1 + self.num_speculative_tokens * per_draft

    def capture_sizes(self) -> tuple[int, ...] | None:
        """`cudagraph_capture_sizes` as integers (None: vLLM's default list)."""
        text = self.cudagraph_capture_sizes
        if text is None:
            return None
        try:
            sizes = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise ConfigError(f"cudagraph_capture_sizes={text!r} must be positive token "
                              "counts separated by commas, e.g. 1,2,4,8")
        return sizes

    def kv_dtype(self) -> str:
        return "bf16" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


def knob_names() -> list[str]:
    return [f.name for f in fields(EngineConfig)]


def knob_fields():
    """(name, type annotation, default, help, choices) of every knob, for the CLI."""
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else None
        yield f.name, f.type, default, f.metadata.get("help", ""), f.metadata.get("choices")


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_type(name: str, annotation: str, value) -> None:
    """Knobs arrive from Python and from the CLI; a wrong type must name the knob."""
    options = [part.strip() for part in str(annotation).split("|")]
    if value is None:
        if "None" in options:
            return
    else:
        for option in options:
            allowed = _TYPES.get(option, ())
            if isinstance(value, allowed) and not (option != "bool" and isinstance(value, bool)):
                return
    wanted = " or ".join(o for o in options if o != "None")
    raise ConfigError(f"{name}={value!r} must be {wanted}, not {type(value).__name__}")


def _positive(cfg, *names):
    for name in names:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be a positive integer")


def _positive_or_none(cfg, *names):
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value} must be a positive integer (or unset)")


def _at_least(cfg, low, *names):
    for name in names:
        if getattr(cfg, name) < low:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= {low}")
