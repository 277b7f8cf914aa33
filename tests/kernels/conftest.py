"""Fixtures for the kernel tests.

With LABKIT_KERNELS=triton, CPU tensors run the Triton kernels under Triton's
interpreter (`labkit.kernels.dispatch` loads an interpreted build of them whatever
TRITON_INTERPRET said when triton was first imported). With CUDA, the same tests run
the compiled kernels on the GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def device():
    """Where the Triton tests put their tensors: the GPU if there is one, else the CPU
    (interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def triton_backend(monkeypatch):
    """Force the Triton path (interpreted on CPU)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    monkeypatch.setenv("LABKIT_KERNELS", "triton")
    return "triton"


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("LABKIT_KERNELS", "torch")
    return "torch"


@pytest.fixture
def g():
    return torch.Generator().manual_seed(1234)
