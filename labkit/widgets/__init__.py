"""Live views over the engine's event stream, for notebooks.

Each view subscribes to an engine's events, keeps a plain-Python model of what it
shows (testable without a browser: `view.figure_data()`, and `view.model.frame()` as
a DataFrame), and redraws its plotly figure at most a few times a second.
`KVPlacementView` draws which GPU holds which tokens' KV (GPUs x token positions of
the requests in flight; its data is `view.placement()`). `Dashboard` puts them
together with the controls people turn; `Compare` replays one trace on several
layouts and stacks the same views on one time axis.

    from labkit.widgets import Dashboard, Compare
    Dashboard(trace, model="deepseek-v3", layout="dep8", concurrency=8)
    Compare(trace, layouts=["tp8", "tp8xdcp8", "dep8"], model="deepseek-v3")
"""

from labkit.widgets.block_table import BlockTableModel, BlockTableView
from labkit.widgets.compare import Compare
from labkit.widgets.dashboard import VIEWS, Dashboard
from labkit.widgets.layout_choices import options as layout_options
from labkit.widgets.lockstep import LockstepModel, LockstepView
from labkit.widgets.placement import KVPlacementView
from labkit.widgets.prefix_cache import PrefixCacheModel, PrefixCacheView
from labkit.widgets.rank_kv import RankKVModel, RankKVView
from labkit.widgets.request_gantt import RequestGantt, RequestGanttModel

__all__ = ["VIEWS", "BlockTableModel", "BlockTableView", "Compare", "Dashboard",
           "KVPlacementView", "LockstepModel", "LockstepView", "PrefixCacheModel",
           "PrefixCacheView", "RankKVModel", "RankKVView", "RequestGantt", "RequestGanttModel",
           "layout_options"]
