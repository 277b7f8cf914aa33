"""`labkit` and `labkit.engine` import their exports on first use (labkit/lazy_exports.py):
every exported name resolves to the object its home module defines, and a process that
imports one compute-plane module does not import the control plane's heavy libraries."""

import importlib
import subprocess
import sys

import pytest

import labkit
import labkit.engine


@pytest.mark.parametrize("package", [labkit, labkit.engine], ids=lambda p: p.__name__)
def test_every_exported_name_is_the_object_its_module_defines(package):
    for name in package.__all__:
        value = getattr(package, name)
        if hasattr(value, "__qualname__"):  # a class or function: where it was defined
            assert getattr(importlib.import_module(value.__module__), value.__qualname__) \
                is value, name
        assert vars(package)[name] is value  # kept: the next access is a plain lookup
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        package.Nope  # noqa: B018


def test_a_rank_process_imports_no_pandas_nor_the_engine():
    code = ("import sys, labkit.engine.compute.mp_executor; "
            "print(sorted(m for m in ('pandas', 'plotly', 'labkit.engine.engine', "
            "'labkit.engine.metrics') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"
    code = "import sys; from labkit import Engine; print('labkit.engine.engine' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "True"
