"""The ``nki.*`` front end (NKI 0.7, Neuron SDK 2.33) of the CPU simulator.

A thin layer over the same core as the legacy ``neuronxcc.nki`` front end (``simulate``):
every instruction translates its 0.7 signature (``dst`` first, no ``mask=``, no result
allocation) onto the legacy implementation and writes the result into ``dst`` the way the
legacy ``dst[...] = nisa.op(...)`` path does, so numerics, hardware rules, cost, schedule and
program size come from one place. Module layout mirrors AWS's package::

    simulate.nki            ~ nki            jit, simulate
    simulate.nki.language   ~ nki.language   (nl)
    simulate.nki.isa        ~ nki.isa        (nisa)

``simulate.register_as_nki()`` makes ``import nki`` resolve here. API reference: AWS's stubs
``nki/api/nki/**/__init__.py`` (aws-neuron/aws-neuron-sdk) and the 2.33 doc pages cited in
each module. See docs/simulator.md, "The nki.* front end (NKI 0.7)".
"""

from __future__ import annotations

import functools
import os
import warnings

from .. import _launch, _runtime, _hw
from . import language, isa, typing  # noqa: F401 (public submodules)

__all__ = ["jit", "simulate", "Kernel", "language", "isa", "typing"]

#: What ``_launch.launch`` records as the front end of a launch (``LaunchRecord.api``).
API = "nki"

DOC_JIT = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/generated/"
           "nki.jit.html")
DOC_SIMULATOR = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/guides/"
                 "nki_simulator.html")
DOC_MIGRATION = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/migration/"
                 "index.html")

# nki.jit docstring: NEURON_PLATFORM_TARGET_OVERRIDE takes trn1|inf2|gen2, trn2|gen3, trn3|gen4
_TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
_REMOVED_JIT_OPTIONS = ("mode", "platform_target")


def _target_opts():
    """Launch options naming the target: ``NEURON_PLATFORM_TARGET_OVERRIDE`` (nki.jit
    docstring), resolved through ``_hw.get_target`` (so ``trn3|gen4`` work once the core has
    that target). ``simulate.measure(target=...)`` still overrides it (``_runtime``)."""
    env = os.environ.get(_TARGET_ENV)
    if not env:
        return {}
    return {"platform_target": _hw.get_target(env).name}


def _warn_trn1(tgt):
    # nki/nki_faq.rst: "NKI supports Trainium2 and Trainium3"; the NKI 0.3+ pages are tagged
    # "relevant for: Trn2, Trn3" although the jit docstring lists trn1|inf2|gen2.
    if tgt.name == "trn1":
        warnings.warn(
            "nki.* kernel on trn1 (NeuronCore-v2): AWS documents nki.* (NKI 0.3+) kernels as "
            "not supported on Trn1/Inf2 devices (nki_faq: 'NKI supports Trainium2 and "
            "Trainium3'); the simulator runs it with the trn1 table anyway.",
            UserWarning, stacklevel=4)


class Kernel:
    """``@nki.jit`` kernel (NKI 0.7). ``kernel(*arrays)`` runs it on the simulator;
    ``kernel[lnc]`` sets the LNC degree (1 or 2: the kernel runs once per physical core of
    the logical core, as an ``nl.nc(lnc)`` grid dimension); ``kernel[g0, g1, ...]`` (or a
    single int > 2) is an SPMD launch grid, kept for backward compatibility (announcement
    'deprecation of the SPMD launch grid requirement for LNC2 NKI kernels')."""

    def __init__(self, func, grid=(), opts=None):
        if isinstance(func, Kernel):
            func, grid, opts = func.func, grid or func.grid, dict(func.opts, **(opts or {}))
        self.func = func
        self.grid = grid
        self.opts = dict(opts or {})
        functools.update_wrapper(self, func, updated=())

    def __getitem__(self, key):
        if self.grid:
            raise TypeError("kernel[...] was already given its LNC degree / launch grid")
        if isinstance(key, tuple):
            grid = key
        elif isinstance(key, int) and not isinstance(key, bool) and key in (1, 2):
            # nki.jit docstring: "The LNC degree can be set at the callsite using bracket
            # syntax: kernel[lnc](args). The default is LNC=1."
            grid = (_runtime.NC(key),) if key > 1 else (1,)
        else:
            grid = (key,)
        return Kernel(self.func, grid, self.opts)

    def __call__(self, *args, **kwargs):
        if _runtime.in_kernel():
            # 0.3.0 update guide: @nki.jit marks the top-level kernel only; helpers are plain
            # Python functions called from it
            raise TypeError(
                f"nki.jit kernel '{getattr(self.func, '__name__', self.func)}' called from "
                "inside a running kernel: in NKI 0.3+ only the top-level kernel is decorated "
                f"with @nki.jit; call the undecorated helper function instead ({DOC_MIGRATION})")
        return run(self, args, kwargs)

    def __repr__(self):
        g = f"[{', '.join(map(repr, self.grid))}]" if self.grid else ""
        return f"<nki.jit kernel {getattr(self.func, '__name__', self.func)}{g} (NKI 0.7)>"


def run(kernel, args, kwargs):
    """Launch an nki.* kernel on the core (``api='nki'`` in its launch record)."""
    opts = dict(kernel.opts)
    opts.update(_target_opts())
    opts["_api"] = API
    _warn_trn1(_runtime.resolve_target(opts))
    return _launch.launch(kernel.func, kernel.grid, args, kwargs, opts)


def jit(fn=None, **kwargs):
    """``@nki.jit`` / ``nki.jit(fn)``: a :class:`Kernel`. NKI 0.2+ removed ``mode=`` and
    ``platform_target=`` (the target comes from ``NEURON_PLATFORM_TARGET_OVERRIDE``); they are
    refused. Other keyword options are accepted and ignored."""
    bad = [k for k in _REMOVED_JIT_OPTIONS if k in kwargs]
    if bad:
        raise TypeError(
            f"nki.jit: option(s) {bad} do not exist in the nki.* API (NKI 0.2+): the target "
            f"comes from {_TARGET_ENV} and the framework from the arguments ({DOC_JIT}, "
            f"{DOC_MIGRATION})")
    if fn is None:
        return lambda f: Kernel(f, opts=kwargs)
    return Kernel(fn, opts=kwargs)


def simulate(kernel):
    """``nki.simulate(kernel)(*numpy_arrays)``: run ``kernel`` (an ``@nki.jit`` kernel,
    ``kernel[lnc]`` or a plain function, which is wrapped) on the CPU and return NumPy arrays
    (nki_simulator guide). Unlike AWS's simulator, which "does not model instruction latency,
    engine parallelism, or hardware scheduling", the launch is recorded by an active
    ``simulate.measure()`` like any other."""
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)

    @functools.wraps(k.func)
    def simulated(*args, **kwargs):
        return run(k, args, kwargs)

    return simulated
