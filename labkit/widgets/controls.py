"""The deployment controls: model, hardware, layout kind and degree, exact layout.

Three ways to say one thing must agree. The *layout* and *degree* dropdowns offer
only what the chosen model and hardware allow (`layout_choices.options`), each degree
labelled with the layout it means; the *exact* box holds that layout string. Pick a
kind or degree and *exact* follows; type a layout into *exact* (Enter) and the
dropdowns follow — or, for a layout they cannot express, go blank while a note says
whether the engine would accept it and why not. Changing the model or hardware
recomputes the choices and keeps the kind and degree where they remain legal.
"""

from __future__ import annotations

import html
from contextlib import contextmanager

import ipywidgets as widgets

from labkit.specs import EngineConfig
from labkit.specs.hardware import HARDWARE_PRESETS
from labkit.specs.model_presets import MODEL_PRESETS
from labkit.widgets.layout_choices import KINDS, choice_of, options, refusal

NARROW = dict(style={"description_width": "initial"})


@contextmanager
def quiet(owner):
    """Set widgets without `owner`'s observers reacting (they are being synced)."""
    before, owner._syncing = owner._syncing, True
    try:
        yield
    finally:
        owner._syncing = before


class DeploymentControls:
    """The widgets, kept consistent; `value()` is (model, hardware, layout)."""

    def __init__(self, model: str, hardware: str, layout: str, knobs: dict) -> None:
        self.knobs = knobs  # what else shapes legality (max_model_len, dtype, ...)
        self.model = widgets.Dropdown(options=list(MODEL_PRESETS), value=model,
                                      description="model", **NARROW)
        self.hardware = widgets.Dropdown(options=list(HARDWARE_PRESETS), value=hardware,
                                         description="hardware", **NARROW)
        self.kind = widgets.Dropdown(options=[], description="layout", **NARROW)
        self.degree = widgets.Dropdown(options=[], description="degree", **NARROW)
        self.exact = widgets.Text(value=layout, description="exact", continuous_update=False,
                                  layout=widgets.Layout(width="16em"), **NARROW)
        self.note = widgets.HTML()
        self.table: dict[str, dict[int, str]] = {}
        self._syncing = False
        self._recompute()
        self._follow_exact()
        self.model.observe(lambda _: self._deployment_changed(), names="value")
        self.hardware.observe(lambda _: self._deployment_changed(), names="value")
        self.kind.observe(lambda _: self._kind_changed(), names="value")
        self.degree.observe(lambda _: self._degree_changed(), names="value")
        self.exact.observe(lambda _: self._follow_exact(), names="value")

    @property
    def widgets(self) -> list:
        return [self.model, self.hardware, self.kind, self.degree, self.exact, self.note]

    def value(self) -> tuple[str, str, str]:
        return self.model.value, self.hardware.value, self.exact.value.strip()

    # ---------------------------------------------------------------- syncing
    def _recompute(self) -> None:
        self.table = options(self.model.value, self.hardware.value, **self.knobs)
        legal = [k for k in KINDS if self.table[k]]
        with quiet(self):
            self.kind.options = legal
            self.kind.value = None

    def _deployment_changed(self) -> None:
        kind, degree = self.kind.value, self.degree.value
        self._recompute()
        if kind not in self.table or not self.table[kind]:
            kind = next(iter(self.kind.options), None)
        if kind is None:
            self._set_dropdowns(None, None)
            self._check_exact()
            return
        degrees = self.table[kind]
        degree = degree if degree in degrees else next(iter(degrees))
        self._set_dropdowns(kind, degree)
        self._set_exact(degrees[degree])

    def _kind_changed(self) -> None:
        if self._syncing or self.kind.value is None:
            return
        degrees = self.table[self.kind.value]
        degree = self.degree.value if self.degree.value in degrees else next(iter(degrees))
        self._set_dropdowns(self.kind.value, degree)
        self._set_exact(degrees[degree])

    def _degree_changed(self) -> None:
        if self._syncing or self.kind.value is None or self.degree.value is None:
            return
        self._set_exact(self.table[self.kind.value][self.degree.value])

    def _follow_exact(self) -> None:
        if self._syncing:
            return
        choice = choice_of(self.exact.value, self.table)
        self._set_dropdowns(*(choice or (None, None)))
        self._check_exact()

    def _set_dropdowns(self, kind, degree) -> None:
        with quiet(self):
            self.kind.value = kind
            degrees = self.table.get(kind, {}) if kind else {}
            self.degree.options = [(f"{d}  ({text})", d) for d, text in degrees.items()]
            self.degree.value = degree

    def _set_exact(self, text: str) -> None:
        with quiet(self):
            self.exact.value = text
        self._check_exact()

    def _check_exact(self) -> None:
        """Say what the exact layout will do: accepted (and by how many GPUs) or not."""
        text = self.exact.value.strip()
        config = EngineConfig.from_knobs(**self.knobs)
        why = refusal(self.model.value, text, self.hardware.value, config)
        if why is not None:
            self.note.value = f"<span style='color:#c00'>refused: {html.escape(why)}</span>"
        elif self.kind.value is None:
            self.note.value = "<span style='color:#555'>custom layout (not in the lists)</span>"
        else:
            self.note.value = ""
