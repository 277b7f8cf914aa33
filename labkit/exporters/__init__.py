"""Exporters: subscribers that turn a run's event stream into files other tools read.

Like the metrics and the widgets, an exporter only subscribes to an engine's events
(the engine never imports it): create it on an engine before the run, save after.

    from labkit.exporters import TimelineRecorder
    timeline = TimelineRecorder(engine)
    engine.replay(trace, concurrency=8, duration_s=300)
    timeline.save("runs/timeline.json")   # open in ui.perfetto.dev

- `TimelineRecorder` (`timeline.py`): Chrome / Perfetto trace-event JSON of a run.
- `RequestPhases` (`request_phases.py`): each call's queue / prefill / decode intervals.
"""

from labkit.exporters.request_phases import RequestPhases
from labkit.exporters.timeline import TimelineRecorder

__all__ = ["RequestPhases", "TimelineRecorder"]
