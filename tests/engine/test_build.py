"""An engine's parts get their collaborators in their constructors (`engine/build.py`).

The house rule: nothing is attached to an object after it is built. The collaborators
are found at run time — every attribute of a built engine's parts (schedulers, KV
managers, window tables, snapshots, offload tiers, prefix sources, instances, router)
that holds a callable or another part, or a flag or an absent (None) collaborator its
constructor was given — and
then the source of labkit is read: such an attribute may be assigned only as
`self.<name> = ...` in its own class's `__init__`, never on another object and never
in another method.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import types
from pathlib import Path

import pytest

from labkit.engine.build import Ranks
from labkit.engine.disagg import PDEngine
from labkit.engine.engine import Engine
from labkit.experiments.rate_matching import role_engine

ROOT = Path(__file__).resolve().parents[2] / "labkit"


def parts_of(engine: Engine) -> list:
    out = [engine.outbox, engine.router, *engine.instances]
    for s in engine.schedulers:
        out += [s, s.kv, s.kv.pool, *s.prefix_sources]
        out += [x for x in (s.kv.window, s.kv.snapshots) if x is not None]
    if engine.offload is not None:
        out.append(engine.offload)
    return [p for p in out if not isinstance(p, (types.FunctionType, types.MethodType))]


def is_collaborator(value) -> bool:
    """A callable, or an object of labkit's that does something (not plain data: a
    dataclass such as a config or counters), or a non-empty list of those."""
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return True
    if isinstance(value, (list, tuple)):
        return bool(value) and all(is_collaborator(v) for v in value)
    cls = type(value)
    return cls.__module__.startswith("labkit.") and not dataclasses.is_dataclass(cls)


def collaborators(engines) -> dict[str, set[str]]:
    """class name -> the names of its attributes that hold collaborators."""
    out: dict[str, set[str]] = {}
    for p in (p for e in engines for p in parts_of(e)):
        attrs = dict(getattr(p, "__dict__", {}))
        for cls in type(p).__mro__:
            attrs.update({n: getattr(p, n) for n in getattr(cls, "__slots__", ())
                          if hasattr(p, n)})
        # what the constructor was given: collaborators, optional ones it was not given
        # (None) and policy flags — not plain numbers (a rank, a block size)
        given = set(inspect.signature(type(p).__init__).parameters)
        names = {n for n, v in attrs.items() if is_collaborator(v) or
                 (n in given and (v is None or isinstance(v, bool)))}
        out.setdefault(type(p).__name__, set()).update(names)
    return out


def late_attachments(source: str, where: str, collab: dict[str, set[str]]) -> list[str]:
    """Assignments in `source` that attach a collaborator after construction."""
    every = set().union(*collab.values())
    found = []

    def visit(node, cls: str | None, fn: str | None):
        if isinstance(node, ast.ClassDef):
            cls, fn = node.name, None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = node.name
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if not isinstance(e, ast.Attribute):
                    continue
                on_self = isinstance(e.value, ast.Name) and e.value.id == "self"
                if on_self and e.attr in collab.get(cls, ()) and fn != "__init__":
                    found.append(f"{where}:{e.lineno} self.{e.attr} set in {cls}.{fn}")
                elif not on_self and e.attr in every:
                    found.append(f"{where}:{e.lineno} .{e.attr} set from outside")
        for child in ast.iter_child_nodes(node):
            visit(child, cls, fn)

    visit(ast.parse(source), None, None)
    return found


@pytest.fixture(scope="module")
def collab():
    engines = [
        Engine("gpt-oss-120b", "dp2", cpu_kv_gib=8, session_kv_migration="fetch"),
        Engine("kimi-linear", "tp1", cpu_kv_gib=8),
        role_engine("decode", "llama-3.1-8b", "tp1"),
    ]
    pd = PDEngine("llama-3.1-8b", "tp1", "tp1")
    return collaborators(engines + pd.prefill + pd.decode)


def test_the_parts_collaborators_are_found(collab):
    """The walk sees the collaborators the builder hands out (so the source check below
    has names to look for)."""
    assert {"prefix_sources", "kv"} <= collab["Scheduler"]
    assert {"pool", "window", "snapshots", "on_cached"} <= collab["KVManager"]
    assert "on_cached" in collab["SlidingWindow"]
    assert {"block_table", "snapshots_of", "window_of", "outbox"} <= \
        collab["Offload"]
    assert {"on_saved", "on_restored"} <= collab["StateSnapshots"]
    assert "hold_kv_on_finish" in collab["Scheduler"]
    assert "ranks" in collab["RemoteFetch"]


def test_no_collaborator_is_attached_after_construction(collab):
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += late_attachments(path.read_text(), str(path.relative_to(ROOT)), collab)
    assert found == []


def test_the_check_catches_late_attachments(collab):
    """Negative control: the wiring as it was before the builder is caught, and so is a
    setter method."""
    before = inspect.cleandoc('''
        for s in engine.schedulers:
            s.prefix_sources = [offer, *s.prefix_sources]
            s.kv.on_cached = offload.cached
        class KVManager:
            def __init__(self):
                self.window = None
            def set_window(self, window):
                self.window = window
    ''')
    assert len(late_attachments(before, "old", collab)) == 3


def test_pd_and_rate_matching_wire_through_constructors():
    pd = PDEngine("llama-3.1-8b", "tp1", "dp2")
    assert all(s.hold_kv_on_finish for e in pd.prefill for s in e.schedulers)
    assert all(not s.hold_kv_on_finish for e in pd.decode for s in e.schedulers)
    assert all(s.prefix_sources[0] == pd._offer_handoff for e in pd.decode
               for s in e.schedulers)
    assert all(pd._offer_handoff not in s.prefix_sources for e in pd.prefill
               for s in e.schedulers)
    decode = role_engine("decode", "llama-3.1-8b", "tp1")
    offer = decode.schedulers[0].prefix_sources[0]  # before the engine's own
    assert offer.__closure__[0].cell_contents is decode  # the source serves its engine


def test_ranks_are_filled_once():
    ranks = Ranks()
    ranks.fill([], {})
    with pytest.raises(RuntimeError, match="filled once"):
        ranks.fill([], {})
