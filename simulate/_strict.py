"""Strict simulation: refuse what neuronx-cc's tracer cannot compile or the hardware leaves
undefined, even where plain Python execution would happen to work.

Switch: :func:`set_strict`, the :func:`strict` context manager, :func:`is_strict`, or the
environment variable ``NKI_SIM_STRICT`` (read at import). **On by default** (every kernel of
the package complies); ``NKI_SIM_STRICT=0`` turns it off, e.g. to run a third-party kernel that
relies on Python ints and see how far it gets.

What strict mode enforces
-------------------------
1. **Loop indices and program ids are symbolic.** Under neuronx-cc a loop variable of
   ``nl.affine_range``/``nl.sequential_range`` (and Python ``range``, which the compiler rewrites
   to ``sequential_range``) and ``nl.program_id(...)`` are traced index values, not Python ints
   (spec §4.1: "scalar affine index values" supporting ``+``, ``-`` and ``*`` by integer
   constants; comparisons make predicates). In strict mode they are :class:`SymbolicIndex`
   values that carry their concrete value for execution and

   * keep working in index arithmetic, slices, ``nl.ds``, arange expressions, masks and
     predicates, and in ``if`` on comparisons (a predicate the compiler turns into a runtime
     branch: AWS's ``flash_fwd`` does this);
   * refuse to become Python ints in kernel code: ``int(i)``, ``range(i)``, ``float(i)``, a list
     or tuple indexed by ``i``, an array shape built from ``i``. Those make a trace-time Python
     decision on a value that only exists at run time;
   * refuse arithmetic with non-integers (``err_tile_index_add_non_integer_scalar``).
2. **Python ``range`` is ``nl.sequential_range``** in kernel code (:func:`python_range_as`,
   installed while a kernel instance runs): the compiler rewrites it, so its index is symbolic
   and its body is one copy of program text. Unroll with ``nl.static_range``.
3. **Loop bounds are compile-time constants**: a symbolic value as a bound of
   ``affine_range``/``sequential_range``/``static_range`` is refused ("all require compile-time
   constant bounds", NKI dynamic-loops page).
4. **PSUM accumulation groups** (``_tensor.assign``): a TensorE accumulation (``psum += matmul``)
   onto a PSUM tile that another engine (VectorE, ScalarE, GpSimd) wrote since TensorE last
   overwrote it is refused. On hardware the first matmul of an accumulation group overwrites
   the bank and later ones accumulate (spec §9.1, nc_matmul); adding onto a value another engine
   left there is not a documented sum. ``nl.zeros(..., buffer=nl.psum)`` then ``+=`` stays legal
   (a zero-filled tile accumulates the same either way). The check is per PSUM element
   (``_tensor.PSUM_*`` codes): a foreign write to one column does not taint the others.
5. **Explicit ``accumulate=True`` (nki.* ``nc_matmul``/``nc_matmul_mx``) needs a group a matmul
   opened.** NKI 0.7's stub of ``nisa.nc_matmul`` ("Accumulation mode"): ``accumulate=True``
   is "Only valid after the PSUM location has been initialized by a matmul with
   accumulate=False", and "On NeuronCore-v2 and NeuronCore-v3, matmul accumulating into a PSUM
   location that was value-initialized by a non-matmul instruction (e.g., memset, tensor_copy)
   is not supported". So ``accumulate=True`` onto an element last written by a zero fill
   (``nl.zeros``, ``memset``), a copy or another engine is refused (onto a never-written one
   it is refused in every mode: the stub calls it undefined on all targets).
   ``accumulate=None`` after a zero fill stays legal: the compiler infers the flag, and the sum
   is the same whether the zeros start the group or not (AWS's nki-library ``attention_bwd``
   memsets ``dq_psum`` and accumulates with the flag left to the compiler). Legacy ``+=`` has
   no explicit flag and keeps rule 4 only.

Which code is "kernel code": a conversion requested from a Python frame outside this package,
NumPy, ml_dtypes and the standard library. The simulator itself (and the libraries it calls)
converts symbolic values freely.
"""
from __future__ import annotations

import builtins
import contextlib
import operator
import os
import sys
import sysconfig

import numpy as _np

from ._errors import NKIError, NKITypeError, NKIValueError

ENV_VAR = "NKI_SIM_STRICT"
DOC_LOOPS = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-dynamic-loops.html"
DOC_SEQUENTIAL = ("https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/"
                  "nki.language.sequential_range.html")
DOC_MATMUL = ("https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/"
              "nki.isa.nc_matmul.html")

_state = {"on": os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")}


def is_strict() -> bool:
    """Whether strict simulation is on."""
    return _state["on"]


def set_strict(flag: bool) -> bool:
    """Turn strict simulation on or off; returns the previous setting."""
    old = _state["on"]
    _state["on"] = bool(flag)
    return old


@contextlib.contextmanager
def strict(flag: bool = True):
    """``with simulate.strict(): ...`` runs the block with strict simulation on (or off)."""
    old = set_strict(flag)
    try:
        yield
    finally:
        set_strict(old)


class StrictError(NKIError):
    """Base of the strict-mode refusals (each is also a TypeError or ValueError)."""


class SymbolicIndexError(StrictError, NKITypeError):
    pass


class LoopBoundError(StrictError, NKIValueError):
    pass


class AccumulationGroupError(StrictError, NKIValueError):
    pass


# -- which frames are kernel code -----------------------------------------------------------
def _dir_of(path: str) -> str:
    return os.path.dirname(os.path.abspath(path)) + os.sep


_SIM_DIR = _dir_of(__file__)
_LIB_DIRS = [_dir_of(_np.__file__)]
try:
    import ml_dtypes as _mld
    _LIB_DIRS.append(_dir_of(_mld.__file__))
except ImportError:     # pragma: no cover
    pass
_LIB_DIRS = tuple(_LIB_DIRS)
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


_SIM, _LIB, _KERNEL = 0, 1, 2
_kinds: dict = {}


def _kind(name: str) -> int:
    """Whether a code file is the simulator, a library it calls, or kernel code (cached)."""
    k = _kinds.get(name)
    if k is None:
        path = name if name.startswith("<") else os.path.abspath(name)
        if path.startswith(_SIM_DIR):
            k = _SIM
        elif (path.startswith(_LIB_DIRS) or path.startswith("<frozen")
              # the standard library, but not third-party packages installed below it
              or (path.startswith(_STDLIB_DIR) and "site-packages" not in path
                  and "dist-packages" not in path)):
            k = _LIB
        else:
            k = _KERNEL
        _kinds[name] = k
    return k


def _from_kernel(depth: int = 2) -> bool:
    """True when the first non-library frame ``depth`` levels up is outside the simulator."""
    f = sys._getframe(depth)
    while f is not None:
        k = _kind(f.f_code.co_filename)
        if k != _LIB:
            return k == _KERNEL
        f = f.f_back
    return False


class SymbolicIndex:
    """A loop index or program id as the compiler sees it (strict mode only): an integer for
    the simulator, a traced value for kernel code. ``what`` names it in messages.

    Not an ``int`` subclass on purpose: CPython's ``range()`` and sequence indexing take int
    subclasses without asking them, so only a separate type can refuse them."""

    __slots__ = ("v", "what", "loop")

    def __init__(self, value, what, loop=None):
        self.v = int(value)
        self.what = what
        self.loop = loop          # uid of the NKI loop this is the index of, if any

    # -- conversions a traced value does not have ---------------------------------------------
    def _refuse(self, how):
        raise SymbolicIndexError(
            f"{self.what} is a loop index or program id, which neuronx-cc traces as a symbolic "
            f"index value, not a Python int; {how} needs its value at trace time. Use it in "
            "index arithmetic (+, -, * by an int), nl.ds, masks and predicates instead; keep "
            "Python-side choices (shapes, list indices, loop bounds) on compile-time values. "
            f"(strict simulation; {DOC_SEQUENTIAL})")

    def __index__(self):
        if _from_kernel():
            self._refuse("using it as a Python integer (range(), a list index, a shape)")
        return self.v

    def __int__(self):
        if _from_kernel():
            self._refuse("int()")
        return self.v

    def __float__(self):
        if _from_kernel():
            self._refuse("float()")
        return float(self.v)

    def __bool__(self):             # ``if i:`` is a predicate (i != 0), traced like the others
        return self.v != 0

    # -- affine algebra stays symbolic ---------------------------------------------------------
    def _arith(self, other, op, sym, reflected=False):
        if isinstance(other, SymbolicIndex):
            o, name = other.v, other.what
        elif isinstance(other, (int, _np.integer)) and not isinstance(other, (bool, _np.bool_)):
            o, name = int(other), str(int(other))
        else:
            if isinstance(other, (float, _np.floating)) and _from_kernel(3):
                raise SymbolicIndexError(
                    f"tile_index can only add with integer scalar: {self.what} {sym} "
                    f"{other!r} (strict simulation)")
            return NotImplemented
        a, b = (o, self.v) if reflected else (self.v, o)
        text = f"({name} {sym} {self.what})" if reflected else f"({self.what} {sym} {name})"
        return SymbolicIndex(op(a, b), text)

    def __add__(self, o):
        return self._arith(o, operator.add, "+")

    def __radd__(self, o):
        return self._arith(o, operator.add, "+", True)

    def __sub__(self, o):
        return self._arith(o, operator.sub, "-")

    def __rsub__(self, o):
        return self._arith(o, operator.sub, "-", True)

    def __mul__(self, o):
        return self._arith(o, operator.mul, "*")

    def __rmul__(self, o):
        return self._arith(o, operator.mul, "*", True)

    def __floordiv__(self, o):
        return self._arith(o, operator.floordiv, "//")

    def __rfloordiv__(self, o):
        return self._arith(o, operator.floordiv, "//", True)

    def __mod__(self, o):
        return self._arith(o, operator.mod, "%")

    def __rmod__(self, o):
        return self._arith(o, operator.mod, "%", True)

    def __neg__(self):
        return SymbolicIndex(-self.v, f"-{self.what}")

    def __pos__(self):
        return self

    def __abs__(self):
        return SymbolicIndex(abs(self.v), f"abs({self.what})")

    # -- comparisons: runtime predicates (plain bools here; an arange side builds a mask) -------
    def _cmp(self, other, op):
        if isinstance(other, SymbolicIndex):
            return op(self.v, other.v)
        if isinstance(other, (int, float, _np.integer, _np.floating)):
            return op(self.v, other)
        return NotImplemented

    def __lt__(self, o):
        return self._cmp(o, operator.lt)

    def __le__(self, o):
        return self._cmp(o, operator.le)

    def __gt__(self, o):
        return self._cmp(o, operator.gt)

    def __ge__(self, o):
        return self._cmp(o, operator.ge)

    def __eq__(self, o):
        return self._cmp(o, operator.eq)

    def __ne__(self, o):
        return self._cmp(o, operator.ne)

    def __hash__(self):
        return hash(self.v)

    def __repr__(self):
        return f"{self.what}={self.v}"

    __str__ = __repr__


#: Integer types the simulator accepts where the API takes an integer (index arithmetic,
#: slices, scalar operands).
INT_TYPES = (int, _np.integer, SymbolicIndex)


# -- Python range() in kernel code ---------------------------------------------------------
builtin_range = builtins.range
_range_loop = {"loop": None}      # the NKI loop that kernel code's range() stands for


class _RangeMeta(type):
    """Keeps ``isinstance(x, range)`` working while ``builtins.range`` is replaced."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, builtin_range)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, builtin_range)


class _KernelRange(metaclass=_RangeMeta):
    """``range`` while :func:`python_range_as` is active: a ``range()`` written in kernel code
    is the NKI loop (the rewrite is syntactic: a library -- the standard library, NumPy --
    calling range() on the kernel's behalf keeps the builtin)."""

    def __new__(cls, *args):
        if _kind(sys._getframe(1).f_code.co_filename) == _KERNEL:
            return _range_loop["loop"](*args)
        return builtin_range(*args)


@contextlib.contextmanager
def python_range_as(loop):
    """While strict mode is on, Python ``range(...)`` called from kernel code is ``loop(...)``.

    neuronx-cc rewrites every ``range(...)`` inside a kernel into ``nl.sequential_range(...)``
    (nki.language.sequential_range docs, Notes: "Inside a NKI kernel, any use of Python
    range(...) will be replaced with sequential_range(...)"), so its index is a traced value and
    its body is compiled once. Unrolling needs ``nl.static_range``."""
    if not _state["on"]:
        yield
        return
    _range_loop["loop"] = loop
    builtins.range = _KernelRange
    try:
        yield
    finally:
        builtins.range = builtin_range


def symbolic(value, what):
    """``value`` as a symbolic index when strict mode is on, else the plain int."""
    return SymbolicIndex(value, what) if _state["on"] else value


def refuse_scalar_operand(x) -> None:
    """A loop index or program id passed where an instruction takes a compile-time scalar."""
    if isinstance(x, SymbolicIndex):
        x._refuse("an instruction's scalar operand (an immediate) — materialise it on device "
                  "with nisa.iota(index, dtype) and pass the tile")


def check_bounds(api: str, args) -> None:
    """Refuse symbolic loop bounds (strict mode)."""
    if not _state["on"]:
        return
    for a in args:
        if isinstance(a, SymbolicIndex):
            raise LoopBoundError(
                f"{api}: loop bounds must be compile-time constants, got {a!r} (a loop index or "
                f"program id). affine_range, sequential_range and static_range all require "
                f"compile-time constant bounds; mask the extra iterations instead. (strict "
                f"simulation; {DOC_LOOPS})")


def refuse_foreign_accumulation(name: str, writer: str) -> None:
    raise AccumulationGroupError(
        f"TensorE accumulation onto PSUM tile '{name}', which {writer} wrote since TensorE last "
        "overwrote it. On hardware the first matmul of an accumulation group overwrites the "
        "bank and only later ones accumulate, so adding onto another engine's value is not a "
        "defined sum. Keep the running value in SBUF (add the fresh matmul result there), or "
        f"start the group with nl.zeros / an overwriting matmul. (strict simulation; "
        f"{DOC_MATMUL})")


def refuse_explicit_accumulation(api: str, name: str, writer: str, doc: str) -> None:
    raise AccumulationGroupError(
        f"nisa.{api}(accumulate=True) onto PSUM tensor '{name}', whose accumulation group "
        f"{writer} opened, not a matmul: the NKI 0.7 nc_matmul stub makes accumulate=True "
        "'Only valid after the PSUM location has been initialized by a matmul with "
        "accumulate=False' (accumulating onto a value memset/tensor_copy left is undefined on "
        "NeuronCore-v2/v3). Start the group with an accumulate=False matmul, or leave "
        f"accumulate=None (the compiler infers the flag). (strict simulation; {doc})")
