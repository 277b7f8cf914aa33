"""Live views over the engine's event stream, for notebooks.

Each view subscribes to an engine's events, keeps a plain-Python model of what it
shows (testable without a browser: `view.figure_data()`), and redraws a plotly
`FigureWidget` at most a few times a second. `Dashboard` puts the four together with
the controls people turn. `KVPlacementView` draws which GPU holds which tokens' KV
(GPUs x token positions of the requests in flight), its data is `view.placement()`.

    from labkit.widgets import Dashboard
    Dashboard(trace, model="deepseek-v3", layout="dep8", concurrency=8)
"""

from labkit.widgets.block_table import BlockTableModel, BlockTableView
from labkit.widgets.dashboard import Dashboard, layout_string
from labkit.widgets.lockstep import LockstepModel, LockstepView
from labkit.widgets.placement import KVPlacementView
from labkit.widgets.prefix_cache import PrefixCacheModel, PrefixCacheView
from labkit.widgets.rank_kv import RankKVModel, RankKVView

__all__ = ["BlockTableModel", "BlockTableView", "Dashboard", "KVPlacementView", "LockstepModel",
           "LockstepView", "PrefixCacheModel", "PrefixCacheView", "RankKVModel", "RankKVView",
           "layout_string"]
