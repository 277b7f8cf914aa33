"""Names a package exports but imports on first use (PEP 562's module `__getattr__`).

`labkit` and `labkit.engine` offer their main classes at the top (`from labkit import
Engine`), but importing all of them costs seconds (pandas, numba, plotly). A process
that needs one module -- a rank process of the compute plane, the CLI, a notebook
kernel -- should not pay for the rest; so the package names where each export lives,
and the first access imports that module alone.
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, homes: dict[str, str]):
    """`(__getattr__, __dir__)` for `package`, whose name `n` lives in module
    `homes[n]`; a name once imported is kept in the package's namespace."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
