"""Loads the compiled core, tolerantly: pure-Python parts of pycomm import
without it, and anything that needs it raises one clear message.

PYCOMM_CORE_PATH names another build of the core to load instead of the one in
the package (a sanitizer build: tests/sanitize.sh)."""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional

import torch  # noqa: F401  (loads libtorch, which pycomm._C links against)


def _load_from(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{__package__}._C", path)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"PYCOMM_CORE_PATH={path!r} is not a built pycomm._C")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    sys.modules[spec.name] = module  # later `from pycomm import _C` finds this build
    return module


_core: Optional[ModuleType]
try:
    _override = os.environ.get("PYCOMM_CORE_PATH")
    if _override:
        _core = _load_from(_override)
    else:
        from . import _C as _core

    _load_error: Optional[BaseException] = None
except ImportError as e:  # not built, or built against another torch
    _core = None
    _load_error = e

if _core is not None:
    CommError = _core.CommError
    Work = _core.Work
else:

    try:
        from torch.distributed import DistBackendError as _CommErrorBase
    except ImportError:  # torch without distributed support
        _CommErrorBase = RuntimeError  # type: ignore[misc,assignment]

    class CommError(_CommErrorBase):  # type: ignore[no-redef]
        """A collective failed: bad input, ranks that disagree, a dead peer, a timeout."""

    class Work:  # type: ignore[no-redef]
        """Handle of an asynchronous collective (needs the compiled core)."""


def load_core() -> ModuleType:
    """pycomm._C, or an ImportError that says how to build it."""
    if _core is None:
        raise ImportError(
            "pycomm's compiled core pycomm._C is not available "
            f"({_load_error}). Build it against the installed torch with: "
            "pip install --no-build-isolation -e .   (or run ./dev test, which does it for you)"
        ) from _load_error
    return _core
