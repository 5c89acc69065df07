"""Run BLAS single-threaded while a kernel is simulated.

Every simulated TensorE instruction is a small matmul (<= 128 x 128 x 512). Multi-threaded
OpenBLAS is slower *and* very noisy at that size on small machines (measured 0.5-3.8 ms vs
0.13 ms single-threaded on 2 cores), so the launcher pins the BLAS thread count to 1 for the
duration of a launch and restores it afterwards. The library is located through
``/proc/self/maps`` and driven with ctypes (what threadpoolctl does); when it cannot be found
this is a silent no-op (results never depend on it).
"""

from __future__ import annotations

import ctypes
import os

_lib = None
_probed = False
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_", "openblas_get_num_threads")


def _probe():
    global _lib, _probed
    _probed = True
    if os.environ.get("NKI_SIM_KEEP_BLAS_THREADS"):
        return
    try:
        import numpy  # noqa: F401  (make sure numpy's BLAS is loaded)
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()
                     and line.rstrip().endswith(".so") or ("openblas" in line.lower()
                                                          and ".so" in line)}
        for p in sorted(paths):
            if not os.path.exists(p):
                continue
            try:
                lib = ctypes.CDLL(p)
            except OSError:
                continue
            setter = next((getattr(lib, s) for s in _SETTERS if hasattr(lib, s)), None)
            getter = next((getattr(lib, g) for g in _GETTERS if hasattr(lib, g)), None)
            if setter is not None and getter is not None:
                getter.restype = ctypes.c_int
                setter.argtypes = [ctypes.c_int]
                _lib = (getter, setter)
                return
    except Exception:
        _lib = None


class single_threaded:
    """Context manager: BLAS uses one thread inside (re-entrant, restores the old count)."""

    def __enter__(self):
        if not _probed:
            _probe()
        self._old = None
        if _lib is not None:
            try:
                self._old = _lib[0]()
                if self._old != 1:
                    _lib[1](1)
            except Exception:
                self._old = None
        return self

    def __exit__(self, *exc):
        if _lib is not None and self._old not in (None, 1):
            try:
                _lib[1](self._old)
            except Exception:
                pass
        return False
