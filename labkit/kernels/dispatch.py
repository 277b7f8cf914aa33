"""Which implementation runs: the Triton kernels or the torch references.

`LABKIT_KERNELS` (read at every call):

- `auto` (default): CUDA tensors run the Triton kernels, anything else the references;
- `triton`: always Triton. CPU tensors run under Triton's interpreter — how the tests
  run the Triton code without a GPU. Triton decides compiled vs. interpreted when a
  kernel is *decorated* (from TRITON_INTERPRET), so the kernels module is loaded in the
  mode each call needs: as `labkit.kernels.triton_impl` in the process's mode (compiled,
  or interpreted if TRITON_INTERPRET=1 was set when it was imported), and, when CPU
  tensors need the interpreter and that module is compiled, a second, interpreted copy
  of it (decorated with TRITON_INTERPRET=1 set for the duration of its import);
- `torch` (or `reference`): always the references, on any device (A/B checks on a GPU).

Every call is recorded: `last_backend[kernel_name]` is what ran last and
`dispatch_counts[(kernel_name, backend)]` counts calls, so a test can prove which code
ran.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

BACKENDS = ("auto", "triton", "torch")
_ALIASES = {"": "auto", "reference": "torch", "ref": "torch"}

last_backend: dict[str, str] = {}
dispatch_counts: Counter = Counter()

_modules: dict = {}
_triton_error: Exception | None = None
_warned_fallback = False


def requested_backend() -> str:
    raw = os.environ.get("LABKIT_KERNELS", "auto").strip().lower()
    mode = _ALIASES.get(raw, raw)
    if mode not in BACKENDS:
        raise ValueError(f"LABKIT_KERNELS={raw!r} is not a kernel backend; allowed: "
                         "auto, triton, torch (alias: reference)")
    return mode


def _load_primary():
    global _triton_error
    if "primary" not in _modules and _triton_error is None:
        try:
            from labkit.kernels import triton_impl
        except Exception as e:  # triton missing, or broken install
            _triton_error = e
        else:
            _modules["primary"] = triton_impl
    if "primary" not in _modules:
        raise RuntimeError(f"the Triton kernels cannot be loaded: {_triton_error!r}")
    return _modules["primary"]


def _load_interpreted_copy():
    """labkit/kernels/triton_impl.py imported again under another name with
    TRITON_INTERPRET=1, so that its kernels are built for the interpreter."""
    if "interpreted" not in _modules:
        import importlib.util
        import sys

        primary = _modules["primary"]
        name = "labkit.kernels._triton_impl_interpreted"
        spec = importlib.util.spec_from_file_location(name, primary.__file__)
        module = importlib.util.module_from_spec(spec)
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            spec.loader.exec_module(module)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
        if not module.interpreted():
            raise RuntimeError("could not build interpreted Triton kernels")
        sys.modules[name] = module
        _modules["interpreted"] = module
    return _modules["interpreted"]


def triton_module(interpret: bool = False):
    """The Triton implementation module: for CUDA tensors the primary one; for CPU
    tensors (interpret=True) one whose kernels run under the interpreter."""
    primary = _load_primary()
    if not interpret or primary.interpreted():
        return primary
    return _load_interpreted_copy()


def choose(kernel: str, device) -> str:
    """'triton' or 'torch' for a call on tensors living on `device`; records the choice."""
    global _warned_fallback
    mode = requested_backend()
    on_cuda = getattr(device, "type", str(device)) == "cuda"
    if mode == "torch":
        backend = "torch"
    elif mode == "triton" or on_cuda:
        backend = "triton"
        try:
            triton_module(interpret=not on_cuda)
        except RuntimeError:
            if mode == "triton":
                raise
            if not _warned_fallback:
                warnings.warn(f"labkit.kernels: Triton is unavailable ({_triton_error!r}); "
                              "running the torch references on CUDA", stacklevel=3)
                _warned_fallback = True
            backend = "torch"
    else:
        backend = "torch"
    last_backend[kernel] = backend
    dispatch_counts[(kernel, backend)] += 1
    return backend
