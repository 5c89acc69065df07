"""Runtime scalars of NKI 0.7: ``NkiScalar`` and the virtual registers (``VirtualRegister``).

AWS's pages: ``nki.isa.NkiScalar`` ("holds one integer, computed on device, and can be used
as an operand of arithmetic, as the scalar_offset of an access pattern, and as a bound of
nki.language.fori_loop"; created from an int32/int64 tile by ``nisa.scalar_load``; width fixed
at creation, 32-bit arithmetic wraps; comparisons are traced but their result cannot be used),
and the ``VirtualRegister`` class of the ``nki.isa`` stub (allocated by
``nisa.register_alloc``; a loop bound and ``while_loop`` condition; under the tracer "using a
register in Python control flow (if/while) or converting it with int() / range() raises
TypeError").

The simulator runs kernels eagerly, so a runtime scalar carries its value (``.v``); kernel
code may compute with it (``+ - *``, ``//`` and ``%`` by the core's index algebra), use it in
slices, ``nl.ds``, ``.ap(offset=/scalar_offset=)`` and as a ``fori_loop`` bound, but it cannot
turn it into a Python value. The value helpers at the end (``load``, ``store``,
``register_*``) are the semantics the ``nisa`` scalar/register instructions translate to.
"""

from __future__ import annotations

import numpy as np

from . import _runtime, _strict
from ._errors import fmt_shape

DOC_SCALAR = ("https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/"
              "nki.isa.NkiScalar.html")
DOC_LOOPS = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/deep-dives/"
             "nki-loops.html")

_WIDTH = {"int32": 32, "int64": 64}


def _wrap(v, bits):
    m = 1 << bits
    v &= m - 1
    return v - m if v >= m >> 1 else v


class NkiScalar(_strict.SymbolicIndex):
    """A runtime integer (NKI 0.7). ``dtype`` is ``"int32"`` (default) or ``"int64"``; the
    width never grows: 32-bit results wrap (``100000 * 100000 == 1410065408``)."""

    __slots__ = ("dtype",)

    def __init__(self, value, what="NkiScalar", loop=None, dtype="int32"):
        dt = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
        if dt not in _WIDTH:
            raise TypeError(f"NkiScalar: dtype must be int32 or int64, got {dtype} "
                            f"({DOC_SCALAR})")
        super().__init__(_wrap(int(value), _WIDTH[dt]), what, loop)
        self.dtype = dt

    def _kind(self):
        return "a runtime scalar (NkiScalar) computed on the device"

    def _refuse(self, how):
        raise _strict.SymbolicIndexError(
            f"{self.what} is {self._kind()}; {how} needs its value while the kernel is "
            "traced. Use it in index arithmetic, slices, nl.ds, access-pattern offsets and "
            f"fori_loop bounds; keep Python-side choices on Python ints ({DOC_SCALAR}, "
            f"{DOC_LOOPS})")

    def __bool__(self):
        if _strict._from_kernel():
            self._refuse("a Python 'if'/'while' condition (control flow on a runtime value)")
        return self.v != 0

    def _new(self, v, what):
        return NkiScalar(v, what, self.loop, self.dtype)

    def _arith(self, other, op, sym, reflected=False):
        if isinstance(other, NkiScalar) and other.dtype != self.dtype:
            raise TypeError(f"NkiScalar arithmetic needs equal dtypes: {self.what} is "
                            f"{self.dtype}, {other.what} is {other.dtype} ({DOC_SCALAR})")
        r = _strict.SymbolicIndex._arith(self, other, op, sym, reflected)
        if isinstance(r, _strict.SymbolicIndex):
            if self.dtype == "int64" and sym not in "+-*":
                raise TypeError(f"NkiScalar: '{sym}' does not exist at 64 bits (only +, -, *) "
                                f"({DOC_SCALAR})")
            return self._new(r.v, r.what)
        return r

    def __neg__(self):
        return self._new(-self.v, f"-{self.what}")

    def _cmp(self, other, op):
        if self.dtype == "int64":
            raise TypeError(f"NkiScalar: comparisons of 64-bit scalars are rejected at "
                            f"compile time ({DOC_SCALAR})")
        return RuntimeBool(_strict.SymbolicIndex._cmp(self, other, op), self)

    def __hash__(self):
        return hash(self.v)


class RuntimeBool:
    """A comparison of runtime scalars: traced, but its truth cannot steer tracing."""

    __slots__ = ("v", "idx")

    def __init__(self, v, idx):
        self.v = bool(v)
        self.idx = idx

    def __bool__(self):
        if _strict._from_kernel():
            self.idx._refuse("a comparison used as a Python condition")
        return self.v


class VirtualRegister(NkiScalar):
    """A 32-bit register on an engine sequencer (``nki.isa.VirtualRegister``): written by
    ``register_move``/``register_load``, read by ``register_store``, a ``fori_loop`` bound or
    ``while_loop`` condition, or a runtime offset. Arithmetic on it gives an
    :class:`NkiScalar` (a value, not the register). ``frozen`` registers refuse writes."""

    __slots__ = ("frozen", "initialized")

    def __init__(self, state=None, frozen=False):
        super().__init__(0 if state is None else int(state), "VirtualRegister", None, "int32")
        self.frozen = bool(frozen)
        self.initialized = state is not None

    def _kind(self):
        return "a virtual register (its value exists on the device only)"

    def _new(self, v, what):
        return NkiScalar(v, what, self.loop, self.dtype)

    def set(self, value):
        if self.frozen:
            raise ValueError("VirtualRegister: this register is read-only (frozen)")
        self.initialized = True
        if _runtime.is_text_only():         # program text only: the value is not kept
            return
        self.v = _wrap(int(value.v if isinstance(value, _strict.SymbolicIndex) else value),
                       32)

    def __repr__(self):
        return f"VirtualRegister={self.v}"


def runtime_name(x):
    """``x``'s name when it is a runtime scalar (a register, a fori_loop index, a value computed
    from them), else None."""
    return x.what if isinstance(x, NkiScalar) else None


def value(x):
    """Python int of an int or a runtime scalar (for the simulator's own use)."""
    return x.v if isinstance(x, _strict.SymbolicIndex) else int(x)


def _one(t, api):
    if t.size != 1:
        raise ValueError(f"{api}: tensor '{t._st.name}' {fmt_shape(t.shape)} must hold exactly "
                         "one element")


def load(tile, api="scalar_load"):
    """The NkiScalar read from a 1-element int32/int64 tile (``nisa.scalar_load``). The tile's
    read is the caller's instruction (it calls ``tile._read()``)."""
    _one(tile, api)
    dt = str(np.dtype(tile.dtype)) if not isinstance(tile.dtype, str) else tile.dtype
    if dt not in _WIDTH:
        raise TypeError(f"{api}: tile dtype must be int32 or int64, got {tile.dtype} "
                        f"({DOC_SCALAR})")
    v = int(np.asarray(tile._read()).reshape(-1)[0])
    return NkiScalar(v, f"{api}({tile._st.name})", None, dt)


def register_load(reg, tile):
    """``nisa.register_load``: a (<= 32-bit) scalar from a 1-element tile into ``reg``; in the
    scheduled estimate every engine of the core waits for the value (``_sched.register_wait``:
    the engine sequencers branch on it)."""
    from . import _sched

    _one(tile, "register_load")
    reg.set(int(np.asarray(tile._read()).reshape(-1)[0]))
    if _sched.ACTIVE is not None:
        _sched.ACTIVE.register_wait(tile)


def store_value(tile, x, api="scalar_store"):
    """Write the runtime scalar (or register) ``x`` into the 1-element ``tile``."""
    _one(tile, api)
    tile._write(np.asarray(value(x)).astype(tile._st.arr.dtype))
