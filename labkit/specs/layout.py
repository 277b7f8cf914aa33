"""Layouts: how a deployment spreads a model over GPUs, written as a short string.

A layout string names parallelism degrees joined by ``x``: ``tp8``, ``dp8``,
``dep16``, ``tp4xpp2``, ``pcp8xdcp8xep8``. The building blocks (DESIGN.md §2):

- ``dp``   data parallel: independent replicas, each with its own scheduler and KV.
- ``tp``   tensor parallel: heads and matrices split inside a replica.
- ``pp``   pipeline parallel: layers split into stages.
- ``ep``   expert parallel: MoE experts spread over the GPUs of a stage.
- ``dcp``  decode context parallel: KV sharded by token position. It reuses the GPUs
  of the TP (and PCP) group, as in vLLM; ``dcp8`` alone means ``tp8xdcp8``.
- ``pcp``  prefill context parallel: prompt tokens split across extra GPUs.
- ``dep``  DP attention + EP experts over the same GPUs: ``dep16`` = ``dp16`` with
  ``ep16``. DP ranks that share experts must step in **lockstep**.
- ``kvpp`` each layer's KV owned by one rank of the TP group.

GPU count: ``dp * tp * pcp * pp``, at most `MAX_GPUS` (every rank keeps state in a
run; beyond that a simulation only grows, and no deployment is that large). This
module parses and checks a layout's *structure*; which rank holds which KV, weights
and experts, and what a step communicates, is the layouts module's job
(engine/layouts.py, a later issue).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from labkit.errors import ConfigError

DIMENSIONS = ("dp", "tp", "pp", "ep", "dcp", "pcp", "dep", "kvpp")
_TOKEN = re.compile(r"^([a-z]+)(\d+)$")
_EXAMPLES = "e.g. 'tp8', 'dp8', 'dep16', 'tp4xpp2', 'pcp8xdcp8xep8'"
MAX_GPUS = 4096


@dataclass(frozen=True, slots=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dcp: int = 1
    pcp: int = 1
    kvpp: int = 1
    text: str = "tp1"

    @classmethod
    def parse(cls, text: str | Layout) -> Layout:
        if isinstance(text, Layout):
            return text
        spec = str(text).strip().lower()
        if spec in ("", "single", "1"):
            spec = "tp1"
        degrees: dict[str, int] = {}
        for token in spec.split("x"):
            match = _TOKEN.match(token)
            if not match:
                raise ConfigError(
                    f"cannot parse layout {text!r}: {token!r} is not <dimension><degree>; "
                    f"allowed dimensions: {', '.join(DIMENSIONS)} ({_EXAMPLES})"
                )
            dim, degree = match.group(1), int(match.group(2))
            if dim not in DIMENSIONS:
                raise ConfigError(
                    f"unknown layout dimension {dim!r} in {text!r}; "
                    f"allowed: {', '.join(DIMENSIONS)} ({_EXAMPLES})"
                )
            if degree < 1:
                raise ConfigError(f"layout {text!r}: degree of {dim} must be >= 1")
            if dim in degrees:
                raise ConfigError(f"layout {text!r} names {dim} twice")
            degrees[dim] = degree
        if "dep" in degrees:
            if "dp" in degrees or "ep" in degrees:
                raise ConfigError(f"layout {text!r}: dep already sets dp and ep; drop them")
            degrees["dp"] = degrees["ep"] = degrees.pop("dep")
        layout = cls(**degrees, text=spec)
        layout = layout._with_dcp_shorthand()
        layout._check_structure()
        return layout

    def with_dcp_knob(self, dcp: int | None) -> Layout:
        """vLLM's decode_context_parallel_size, reconciled with the layout string."""
        if dcp is None or dcp == self.dcp:
            return self
        if self.dcp == 1:
            return Layout.parse(f"{self.text}xdcp{dcp}")
        raise ConfigError(f"decode_context_parallel_size={dcp} disagrees with layout "
                          f"{self.text!r} (dcp{self.dcp}); give the degree in one place")

    def _with_dcp_shorthand(self) -> Layout:
        # vLLM runs DCP inside the TP group; a bare `dcp8` means tp8 with dcp8.
        if self.dcp > 1 and self.tp * self.pcp == 1:
            return Layout(self.dp, self.dcp, self.pp, self.ep, self.dcp, self.pcp, self.kvpp,
                          self.text)
        return self

    def _check_structure(self) -> None:
        group = self.tp * self.pcp
        if group % self.dcp:
            raise ConfigError(
                f"layout {self.text!r}: dcp{self.dcp} must divide the tp*pcp group "
                f"({group} GPUs) whose KV it shards"
            )
        if (self.dp * group) % self.ep:
            raise ConfigError(
                f"layout {self.text!r}: ep{self.ep} must divide the GPUs of a pipeline "
                f"stage (dp*tp*pcp = {self.dp * group})"
            )
        if self.tp % self.kvpp:
            raise ConfigError(f"layout {self.text!r}: kvpp{self.kvpp} must divide tp{self.tp}")
        if self.gpus > MAX_GPUS:
            raise ConfigError(f"layout {self.text!r} has {self.gpus:,} GPUs; labkit simulates "
                              f"deployments of at most {MAX_GPUS:,} GPUs")

    # ----------------------------------------------------------------- derived
    @property
    def gpus_per_replica(self) -> int:
        """GPUs behind one DP rank (one scheduler, one KV manager)."""
        return self.tp * self.pcp * self.pp

    @property
    def gpus(self) -> int:
        return self.dp * self.gpus_per_replica

    @property
    def num_dp_ranks(self) -> int:
        return self.dp

    @property
    def lockstep(self) -> bool:
        """DP ranks that share experts (DEP) must run every step together: true as
        soon as an EP group does not fit inside one replica's GPUs."""
        return self.dp > 1 and (self.tp * self.pcp) % self.ep != 0

    def check_model(self, model) -> None:
        """Divisibility the model imposes on this layout; raises ConfigError."""
        if model.num_heads % self.tp:
            raise ConfigError(
                f"layout {self.text!r}: tp{self.tp} must divide {model.name}'s "
                f"{model.num_heads} attention heads"
            )
        if not model.is_mla and model.num_kv_heads and (
            model.num_kv_heads % self.tp and self.tp % model.num_kv_heads
        ):
            raise ConfigError(
                f"layout {self.text!r}: tp{self.tp} and {model.name}'s {model.num_kv_heads} "
                f"KV heads must divide one another"
            )
        if self.ep > 1 and not model.is_moe:
            raise ConfigError(f"layout {self.text!r}: ep needs a MoE model; {model.name} is dense")
        if model.is_moe and model.num_experts % self.ep:
            raise ConfigError(
                f"layout {self.text!r}: ep{self.ep} must divide {model.name}'s "
                f"{model.num_experts} experts"
            )
        if self.pp > model.num_layers:
            raise ConfigError(
                f"layout {self.text!r}: pp{self.pp} exceeds {model.name}'s "
                f"{model.num_layers} layers"
            )

    def __str__(self) -> str:
        return self.text
