"""Live views over the engine's event stream, for notebooks.

Each view subscribes to an engine's events, keeps a plain-Python model of what it
shows (testable without a browser: `view.figure_data()`), and redraws a plotly
`FigureWidget` at most a few times a second. `Dashboard` puts the four together with
the controls people turn.

    from labkit.widgets import Dashboard
    Dashboard(trace, model="deepseek-v3", layout="dep8", concurrency=8)
"""

from labkit.widgets.block_table import BlockTableModel, BlockTableView
from labkit.widgets.dashboard import Dashboard, layout_string
from labkit.widgets.lockstep import LockstepModel, LockstepView
from labkit.widgets.prefix_cache import PrefixCacheModel, PrefixCacheView
from labkit.widgets.rank_kv import RankKVModel, RankKVView
from labkit.widgets.request_gantt import RequestGantt, RequestGanttModel

__all__ = ["BlockTableModel", "BlockTableView", "Dashboard", "LockstepModel", "LockstepView",
           "PrefixCacheModel", "PrefixCacheView", "RankKVModel", "RankKVView", "RequestGantt",
           "RequestGanttModel", "layout_string"]
