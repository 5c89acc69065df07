"""A CPU implementation of the legacy NKI API (``neuronxcc.nki``) on NumPy.

Module layout mirrors neuronx-cc::

    simulate            ~ neuronxcc.nki           jit, simulate_kernel, baremetal, benchmark,
                                                  profile, trace (+ measure, register_as_neuronxcc)
    simulate.nki        ~ nki (NKI 0.7)           the second front end (register_as_nki)
    simulate.language   ~ neuronxcc.nki.language  (nl)
    simulate.isa        ~ neuronxcc.nki.isa       (nisa)
    simulate.typing     ~ neuronxcc.nki.typing    (nt)
    simulate.compiler   ~ neuronxcc.nki.compiler  (ncc)

Kernels run eagerly as Python; NumPy arrays passed in become HBM tensors; results come back as
NumPy arrays in the kernel-declared dtype (bf16 as ml_dtypes.bfloat16). Hardware rules are
enforced with NKI-style errors; ``measure()`` records exact IO and modeled engine time.
There is no device: ``baremetal``/``benchmark``/``profile`` run the simulator and report
*modeled* numbers. See docs/simulator.md.
"""

from __future__ import annotations

import functools

from . import _launch, _runtime
from . import language, isa, typing, compiler
from ._errors import NKIError, NKISyntaxError, ProgramSizeWarning
from ._strict import is_strict, set_strict, strict, StrictError
from ._spill import SpillWarning, is_spill, set_spill, spill
from ._measure import measure, Measurement, program_size
from ._progress import progress
from ._register import register_as_neuronxcc, unregister_neuronxcc, register_as_nki, unregister_nki
from ._tensor import Tensor as tensor

__all__ = ["jit", "trace", "simulate_kernel", "baremetal", "benchmark", "profile", "measure",
           "register_as_neuronxcc", "unregister_neuronxcc", "register_as_nki",
           "unregister_nki", "language", "isa", "typing",
           "compiler", "tensor", "NKIError", "NKISyntaxError", "ProgramSizeWarning",
           "Measurement", "program_size", "progress", "is_strict", "set_strict", "strict", "StrictError",
           "SpillWarning", "is_spill", "set_spill", "spill"]

_MODES = ("auto", "jax", "torchxla", "baremetal", "benchmark", "simulation", "trace")


class Kernel:
    """An ``@nki.jit`` kernel. Calling it with NumPy arrays runs the simulator; calling it from
    inside a running kernel is an inline sub-kernel call (``mode='trace'`` helpers);
    ``kernel[g0, g1](...)`` launches an SPMD grid."""

    _kind = "jit"

    def __init__(self, func, mode="auto", **opts):
        if isinstance(func, Kernel):
            merged = dict(func.opts)
            merged.update(opts)
            opts = merged
            func = func.func
        if mode not in _MODES:
            raise ValueError(f"unknown nki.jit mode {mode!r}; expected one of {_MODES}")
        self.func = func
        self.mode = mode
        self.opts = opts
        functools.update_wrapper(self, func, updated=())

    def __call__(self, *args, **kwargs):
        if _runtime.in_kernel():
            return self.func(*args, **kwargs)
        return self._run((), args, kwargs)

    def __getitem__(self, grid):
        return GridKernel(self, grid)

    def _run(self, grid, args, kwargs):
        opts = self.opts
        if self.mode == "simulation":
            opts = dict(opts, _simulation_mode=True)
        return _launch.launch(self.func, grid, args, kwargs, opts)

    def __repr__(self):
        return f"<nki {self._kind} kernel {getattr(self.func, '__name__', self.func)}>"


class GridKernel:
    """``kernel[grid]``: a kernel bound to an SPMD launch grid."""

    def __init__(self, kernel, grid):
        self.kernel = kernel
        self.grid = grid if isinstance(grid, tuple) else (grid,)

    def __call__(self, *args, **kwargs):
        if _runtime.in_kernel():
            _launch.launch(self.kernel.func, self.grid, args, kwargs, self.kernel.opts)
        return self.kernel._run(self.grid, args, kwargs)

    @property
    def benchmark_result(self):
        return getattr(self.kernel, "benchmark_result", None)

    @property
    def profile_result(self):
        return getattr(self.kernel, "profile_result", None)


class BaremetalKernel(Kernel):
    """``nki.baremetal(kernel)``: no device exists here, so it runs on the CPU simulator (a
    one-time RuntimeWarning says so)."""

    _kind = "baremetal"

    def _run(self, grid, args, kwargs):
        _runtime.cpu_note("baremetal")
        return super()._run(grid, args, kwargs)


class _Latency:
    """``benchmark_result.nc_latency``: modeled latency (the scheduled estimate of the cost
    model plus the fitted overhead of a device benchmark, ``Measurement.benchmark_seconds``)
    -- NOT a hardware measurement. Every percentile is the same deterministic number."""

    def __init__(self, seconds):
        self._us = seconds * 1e6

    def get_latency_percentile(self, p=50):
        return self._us


class BenchmarkResult:
    def __init__(self, measurement):
        self.measurement = measurement
        lo, hi = measurement.modeled_seconds
        self.modeled_seconds = (lo, hi)
        self.estimated_seconds = measurement.estimated_seconds
        self.nc_latency = _Latency(measurement.benchmark_seconds)

    def __repr__(self):
        lo, hi = self.modeled_seconds
        return (f"<BenchmarkResult modeled {lo * 1e6:.2f}..{hi * 1e6:.2f} us, estimate "
                f"{self.estimated_seconds * 1e6:.2f} us (cost model, not hardware)>")


class BenchmarkKernel(Kernel):
    """``nki.benchmark(...)(kernel)``: runs once in the simulator inside ``measure()`` and
    exposes ``benchmark_result.nc_latency.get_latency_percentile(p)`` = the scheduled
    estimate plus the fitted benchmark overhead in microseconds (NOT a hardware number)."""

    _kind = "benchmark"
    benchmark_result = None

    def _run(self, grid, args, kwargs):
        _runtime.cpu_note("benchmark")
        m = measure(self.opts.get("measure_target"))
        with m:
            out = super()._run(grid, args, kwargs)
        self.benchmark_result = BenchmarkResult(m)
        return out


class ProfileKernel(Kernel):
    """``nki.profile(...)(kernel)``: runs in the simulator and stores the ``measure()`` report
    as ``profile_result`` (no NEFF/NTFF files are written)."""

    _kind = "profile"
    profile_result = None

    def _run(self, grid, args, kwargs):
        _runtime.cpu_note("profile")
        m = measure()
        with m:
            out = super()._run(grid, args, kwargs)
        self.profile_result = m
        return out


def _decorator(cls, kernel, mode, kwargs):
    if kernel is None:
        return lambda f: cls(f, mode=mode, **kwargs)
    return cls(kernel, mode=mode, **kwargs)


def jit(func=None, mode="auto", **kwargs):
    """``@nki.jit`` / ``@nki.jit(mode=..., platform_target='trn1'|'trn2', ...)`` /
    ``nki.jit(f, ...)``. Unknown compile options are accepted and ignored. With NumPy inputs
    every mode runs the simulator (benchmark/baremetal/profile see their own docs)."""
    if mode == "benchmark":
        return _decorator(BenchmarkKernel, func, mode, kwargs)
    if mode == "baremetal":
        return _decorator(BaremetalKernel, func, mode, kwargs)
    return _decorator(Kernel, func, mode, kwargs)


def trace(func=None, **kwargs):
    """2.20-era alias decorator (``nki_jit = nki.trace``)."""
    kwargs.setdefault("mode", "trace")
    return jit(func, **kwargs)


def baremetal(kernel=None, **kwargs):
    """Runs on the CPU simulator (there is no device); kwargs such as ``save_neff_name`` are
    accepted and ignored."""
    return _decorator(BaremetalKernel, kernel, "baremetal", kwargs)


def benchmark(kernel=None, warmup=10, iters=100, **kwargs):
    """``nki.benchmark(warmup=..., iters=...)(kernel)``: see ``BenchmarkKernel``."""
    kwargs.update(warmup=warmup, iters=iters)
    return _decorator(BenchmarkKernel, kernel, "benchmark", kwargs)


def profile(kernel=None, **kwargs):
    """``nki.profile(working_directory=..., ...)(kernel)``: see ``ProfileKernel``."""
    return _decorator(ProfileKernel, kernel, "auto", kwargs)


def simulate_kernel(kernel, *args, **kwargs):
    """Run ``kernel`` on NumPy inputs on the CPU and return its outputs as NumPy arrays.
    ``kernel`` may be an ``@nki.jit`` function, a plain function, ``kernel[grid]`` or
    ``nki.baremetal(kernel)[grid]``. 2.20-style kernels that return nothing write their
    outputs into the argument arrays (copied back in place)."""
    if isinstance(kernel, GridKernel):
        return _launch.launch(kernel.kernel.func, kernel.grid, args, kwargs,
                               kernel.kernel.opts)
    if isinstance(kernel, Kernel):
        return _launch.launch(kernel.func, (), args, kwargs, kernel.opts)
    if callable(kernel):
        return _launch.launch(kernel, (), args, kwargs, {})
    raise TypeError(f"simulate_kernel expects a kernel, got {type(kernel).__name__}")
