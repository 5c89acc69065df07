"""Running a kernel on the active backend (the one :mod:`nki_kernels.nki` bound).

Host entry points call :func:`launch` and never touch the backend directly, so the choice between
the CPU simulator and a Trainium device is made in one place.
"""
from __future__ import annotations

import numbers
import os

from nki_kernels import port
from nki_kernels.nki import BACKEND, namespace, nki, select_api

#: ``NKI_FLASH_RUN=simulate`` runs kernels through ``nki.simulate_kernel`` even when the backend is
#: the real neuronx-cc (its own CPU simulator); the default on that backend is the device.
RUN_ENV_VAR = "NKI_FLASH_RUN"


def runs_on_simulator() -> bool:
    """True when :func:`launch` executes kernels on a CPU simulator rather than a device."""
    return BACKEND == "simulate" or os.environ.get(RUN_ENV_VAR, "").lower() == "simulate"


def launch(kernel, grid, *args, **kwargs):
    """Run ``kernel`` on the SPMD ``grid`` (ints, ``nl.nc(n)`` or ``nl.spmd_dim``) with NumPy
    arguments.

    A kernel written against :mod:`nki_kernels.port` traces through the namespace
    :func:`nki_kernels.nki.select_api` picks (``NKI_FLASH_API``); the others through the legacy
    one. Legacy: ``nki.simulate_kernel(kernel[grid], ...)`` on the simulator,
    ``nki.baremetal(kernel)[grid](...)`` on a Trainium host. ``nki.*``: ``nki.simulate(kernel[grid])
    (...)`` on the simulator, ``kernel[grid](...)`` on a device (a one-int grid ``(lnc,)`` is
    ``kernel[lnc]``) (NumPy arguments there are
    UNCONFIRMED: AWS documents framework tensors). Returns the kernel's outputs as NumPy arrays.
    """
    # ints stay ints; nl.nc(n) / nl.spmd_dim(...) dimensions (LNC=2) are passed as they are
    grid = tuple(int(g) if isinstance(g, numbers.Integral) else g for g in grid)
    if isinstance(kernel, port.Kernel):
        return _launch_port(kernel, grid, args, kwargs)
    if runs_on_simulator():
        return nki.simulate_kernel(kernel[grid], *args, **kwargs)
    return nki.baremetal(kernel)[grid](*args, **kwargs)


def _launch_port(kernel, grid, args, kwargs):
    ns = namespace(kernel.api or select_api())
    jitted = kernel.jitted(ns)
    with port.tracing(ns):
        if ns.api == "legacy":
            if ns.backend == "simulate" or runs_on_simulator():
                return ns.nki.simulate_kernel(jitted[grid], *args, **kwargs)
            return ns.nki.baremetal(jitted)[grid](*args, **kwargs)
        # 0.7 launches kernel[lnc]: a one-int grid is the LNC degree
        key = grid[0] if len(grid) == 1 else grid
        if ns.backend == "simulate" or os.environ.get(RUN_ENV_VAR, "").lower() == "simulate":
            return ns.nki.simulate(jitted[key])(*args, **kwargs)
        return jitted[key](*args, **kwargs)


def program_size(kernel, grid, *args, **kwargs):
    """``simulate.program_size`` of a launch of ``kernel`` on ``grid`` (simulator only): the
    instructions of its compiled program, each loop body traced once. A kernel written against
    :mod:`nki_kernels.port` is traced through the namespace :func:`launch` would use."""
    import simulate

    if not isinstance(kernel, port.Kernel):
        return simulate.program_size(kernel[grid], *args, **kwargs)
    ns = namespace(kernel.api or select_api())
    key = grid[0] if ns.api == "nki" and len(grid) == 1 else tuple(grid)
    with port.tracing(ns):
        return simulate.program_size(kernel.jitted(ns)[key], *args, **kwargs)
