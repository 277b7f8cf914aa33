"""The trace formats labkit reads, each turned into the canonical trace.

=========  ===================================  =================================
format     file                                 what it gives
=========  ===================================  =================================
labkit     JSONL, ``TraceRequest`` fields       everything (``io.py``)
mooncake   JSONL, 512-token ``hash_ids``        open-loop arrivals, prefix reuse
bailian    JSONL, ``chat_id`` / parent links     conversations, 16-token ids
azure      CSV ``TIMESTAMP,ContextTokens,...``  arrivals, token counts
agentx     JSON trace objects (AgentX / Weka)    agent sessions, subagents, ids
burstgpt   CSV ``Timestamp,...,Request tokens``  arrivals, token counts (sessions)
splitwise  CSV ``arrival_timestamp,...``        arrivals, token counts
=========  ===================================  =================================

``load(path, format)`` reads any of them ("auto" tells them apart by the first line,
see ``detect.py``); each module's docstring says how its fields map onto sessions,
parents, subagents, delays and block ids. Ids are made chain-unique by ``Trace``
whatever the format (``canonical.py``), so prefix reuse means the same in all.
"""
from __future__ import annotations

import os

from labkit.errors import ConfigError
from labkit.traces.collector import collector_paused
from labkit.traces.formats.agentx_json import load_agentx
from labkit.traces.formats.azure import load_azure
from labkit.traces.formats.bailian import load_bailian
from labkit.traces.formats.burstgpt import load_burstgpt
from labkit.traces.formats.detect import detect_format
from labkit.traces.formats.row_filter import RowFilter
from labkit.traces.formats.splitwise import load_splitwise
from labkit.traces.io import load_labkit
from labkit.traces.mooncake import load_mooncake
from labkit.traces.schema import Trace

LOADERS = {"labkit": load_labkit, "mooncake": load_mooncake, "bailian": load_bailian,
           "azure": load_azure, "agentx": load_agentx, "burstgpt": load_burstgpt,
           "splitwise": load_splitwise}
FORMATS = tuple(LOADERS)
CSV_FORMATS = ("azure", "burstgpt", "splitwise")  # loaders that take `window` and `where`
FILTERED = (*CSV_FORMATS, "mooncake", "bailian")  # loaders that take `where`: flat rows


def load(path: str | os.PathLike, format: str = "auto",
         window: tuple[float, float] | None = None, where=None) -> Trace:
    """Read a trace file in ``format`` ("auto": from its first line). ``window``: the
    caller will keep only the sessions starting in it (``parts.select``), so a loader
    may leave the others out (the CSV formats do, where read a column at a time: an
    hour of a months-long file without a request object for every row). ``where``:
    conditions on a row's values (a CSV trace's cells, a Mooncake or Bailian line's
    fields: ``"Model=GPT-4"``, ``"type=text"``, or a list of them, all to be met): the
    file read as if it held only the rows meeting them (``row_filter.py``).
    """
    path = os.fspath(path)
    if format not in ("auto", *FORMATS):
        raise ValueError(f"format must be one of auto, {', '.join(FORMATS)}; got {format!r}")
    rows = RowFilter.parse(where)  # (a badly spelt condition: before the file is read)
    with collector_paused():  # (objects by the million, no cycles: `collector.py`)
        if format == "auto":
            format = detect_format(path, FORMATS)
        if format in CSV_FORMATS:
            return LOADERS[format](path, window=window, where=rows)
        if rows is None:
            return LOADERS[format](path)
        if format not in FILTERED:
            raise ConfigError(f"--where picks rows of the traces whose calls are flat rows "
                              f"({', '.join(FILTERED)}); {path} is a {format} trace")
        return LOADERS[format](path, where=rows)
