"""The optional compiled CPU kernels (numba), loaded once per module with one warning if absent.

Why a module: QSGD's and the sign codecs' hot loops are compiled by numba where it is installed
(the ``fast`` extra, which ``make`` installs) and fall back to torch/numpy code that computes
the same bits otherwise. Whether the compiled form is used is decided here, once per kernel
module and process, so every codec answers the same way and says the same thing when it
cannot (numba missing, or a big-endian machine: the kernels read packed bits and hash words
in little-endian order).
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from types import ModuleType

#: kernel module name -> the module, or None where it cannot be used
_LOADED: dict[str, ModuleType | None] = {}
_LOCK = threading.Lock()


def load(name: str) -> ModuleType | None:
    """The compiled-kernel module ``lowcomm.compress.<name>``, or ``None`` (with one
    ``RuntimeWarning`` naming the extra) where numba is not installed or the machine is
    big-endian. Importing it compiles nothing: numba compiles each kernel on its first call
    and caches it on disk."""
    with _LOCK:
        if name in _LOADED:
            return _LOADED[name]
    module: ModuleType | None = None
    why = "they need numba, on a little-endian machine"
    if sys.byteorder == "little":
        try:
            module = importlib.import_module(f"lowcomm.compress.{name}")
        except ImportError:
            module = None
        except Exception as exc:  # numba present but unusable, e.g. no writable cache folder
            module, why = None, f"numba failed: {type(exc).__name__}: {exc}"
    if module is None:
        warnings.warn(f"{name}: no compiled CPU kernels ({why}); the CPU paths run as torch/numpy "
                      "operations: the same results, more slowly. pip install 'lowcomm[fast]'",
                      RuntimeWarning, stacklevel=3)
    with _LOCK:
        _LOADED[name] = module
    return module
