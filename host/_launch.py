"""Running a kernel on the active backend (the one :mod:`nki_kernels.nki` bound).

Host entry points call :func:`launch` and never touch the backend directly, so the choice between
the CPU simulator and a Trainium device is made in one place.
"""
from __future__ import annotations

import numbers
import os

from nki_kernels.nki import BACKEND, nki

#: ``NKI_FLASH_RUN=simulate`` runs kernels through ``nki.simulate_kernel`` even when the backend is
#: the real neuronx-cc (its own CPU simulator); the default on that backend is the device.
RUN_ENV_VAR = "NKI_FLASH_RUN"


def runs_on_simulator() -> bool:
    """True when :func:`launch` executes kernels on a CPU simulator rather than a device."""
    return BACKEND == "simulate" or os.environ.get(RUN_ENV_VAR, "").lower() == "simulate"


def launch(kernel, grid, *args, **kwargs):
    """Run ``kernel`` on the SPMD ``grid`` (ints, ``nl.nc(n)`` or ``nl.spmd_dim``) with NumPy
    arguments.

    On the simulator this is ``nki.simulate_kernel(kernel[grid], ...)``; on a Trainium host it is
    ``nki.baremetal(kernel)[grid](...)``. Returns whatever the kernel returns, as NumPy arrays.
    """
    # ints stay ints; nl.nc(n) / nl.spmd_dim(...) dimensions (LNC=2) are passed as they are
    grid = tuple(int(g) if isinstance(g, numbers.Integral) else g for g in grid)
    if runs_on_simulator():
        return nki.simulate_kernel(kernel[grid], *args, **kwargs)
    return nki.baremetal(kernel)[grid](*args, **kwargs)
