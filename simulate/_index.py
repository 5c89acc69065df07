"""Index expressions (spec §4.1) and mask predicates (spec §5).

* ``nl.arange(n)`` is a 1-D *index variable*; it must be lifted onto a tile axis with
  ``[:, None]`` / ``[None, :]`` ... before indexing a tensor.
* ``nl.mgrid[a:b, c:d]`` gives one lifted variable per axis (unpackable; ``.p .x .y .z``).
* Affine expressions ``c0 + sum(ci * var_i)`` (ints / loop ints fold into ``c0``) are
  ``IndexExpr`` objects. Their value array has the numpy-broadcast shape of their variables.
* Comparisons of expressions give ``Predicate`` objects, combined with ``&``. Python ``if``/
  ``and``/``or``/``not`` on them raise err_control_flow_condition_depending_on_arange.
* Loop indices and ``nl.program_id`` are plain Python ints (so ``i < n`` is a Python bool).
"""

from __future__ import annotations

import dis
import itertools
import operator
import sys
import warnings

import numpy as np

from ._errors import nki_error
from ._strict import INT_TYPES
from ._runtime import current as _in_kernel_check

_ids = itertools.count()


def _is_int(v):
    """An integer index value: a Python/NumPy int or a symbolic loop index (strict mode)."""
    return isinstance(v, INT_TYPES) and not isinstance(v, (bool, np.bool_))


class IndexVar:
    """One arange placed on ``axis`` of an ``ndim``-dimensional index grid."""

    __slots__ = ("uid", "start", "n", "axis", "ndim", "_vals")

    def __init__(self, start, n, axis, ndim):
        self.uid = next(_ids)
        self.start = int(start)
        self.n = int(n)
        self.axis = axis
        self.ndim = ndim
        self._vals = None

    @property
    def shape(self):
        s = [1] * self.ndim
        s[self.axis] = self.n
        return tuple(s)

    def values(self):
        if self._vals is None:
            self._vals = np.arange(self.start, self.start + self.n, dtype=np.int64).reshape(
                self.shape)
        return self._vals


class MaskAndWarning(UserWarning):
    """A mask written ``p and q``: it means ``q`` only (use ``p & q``)."""


_AND_OPS = frozenset(("JUMP_IF_FALSE_OR_POP",))                     # Python <= 3.11
_BRANCH_OPS = frozenset(("POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE"))
_and_cache = {}


def _short_circuit_and(frame):
    """Is ``frame`` evaluating the left operand of an ``and`` (not an ``if``/``while``)?"""
    key = (frame.f_code, frame.f_lasti)
    hit = _and_cache.get(key)
    if hit is None:
        ins = list(dis.get_instructions(frame.f_code))
        at = next((k for k, i in enumerate(ins) if i.offset == frame.f_lasti), None)
        hit = False
        if at is not None:
            op = ins[at].opname
            if op in _AND_OPS:
                hit = True
            else:
                # 3.12+: ``a and b`` is COPY 1; [TO_BOOL;] POP_JUMP_IF_FALSE; an ``if`` has no COPY
                k = at + 1 if op == "TO_BOOL" else at
                if k < len(ins) and ins[k].opname in _BRANCH_OPS:
                    j = k - 1 if op != "TO_BOOL" else at - 1
                    hit = j >= 0 and ins[j].opname == "COPY" and ins[j].arg == 1
        _and_cache[key] = hit
    return hit


def _cflag():
    raise nki_error(
        "err_control_flow_condition_depending_on_arange", "syntax",
        "Control-flow depending on `nl.arange` or `nl.mgrid` is not supported.")


class IndexExpr:
    """``const + sum(coeff * var)``; non-affine expressions (``//``, ``%``) keep explicit
    values and are flagged (allowed as indices, rejected in masks)."""

    __slots__ = ("terms", "const", "_shape", "_vals", "affine", "__weakref__")

    def __init__(self, terms, const=0, vals=None, affine=True):
        self.terms = terms          # tuple of (IndexVar, int coeff)
        self.const = const
        self._shape = None
        self._vals = vals
        self.affine = affine

    # -- structure --------------------------------------------------------------------------
    @property
    def ndim(self):
        if self._vals is not None and not self.terms:
            return self._vals.ndim
        return max((v.ndim for v, _ in self.terms), default=0)

    @property
    def shape(self):
        if self._shape is None:
            if self._vals is not None:
                self._shape = tuple(self._vals.shape)
            else:
                self._shape = np.broadcast_shapes(*(v.shape for v, _ in self.terms)) \
                    if self.terms else ()
        return self._shape

    def values(self):
        """int64 array of this expression's values (broadcast shape of its variables)."""
        if self._vals is None:
            acc = None
            for v, c in self.terms:
                t = v.values() if c == 1 else v.values() * c
                acc = t if acc is None else acc + t
            if acc is None:
                acc = np.asarray(self.const, dtype=np.int64)
            elif self.const:
                acc = acc + self.const
            self._vals = acc
        return self._vals

    def bounds(self):
        """(min, max) of the values, computed without materialising them when affine."""
        if not self.affine or not self.terms:
            v = self.values()
            return int(v.min()), int(v.max())
        lo = hi = self.const
        for v, c in self.terms:
            a, b = c * v.start, c * (v.start + v.n - 1)
            lo += min(a, b)
            hi += max(a, b)
        return lo, hi

    # -- lifting a 1-D arange onto an axis -------------------------------------------------
    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        if self.ndim != 1 or not self.affine:
            raise nki_error("err_unsupported_expression_in_mask", "value",
                            "Only a 1-D nl.arange can be lifted with [:, None] / [None, :].")
        axes = [i for i, k in enumerate(key) if isinstance(k, slice)]
        if len(axes) != 1 or any(k is not None and not isinstance(k, slice) for k in key):
            raise TypeError("an nl.arange must be lifted with exactly one ':' and Nones, "
                            "e.g. nl.arange(n)[:, None]")
        s = key[axes[0]]
        if s != slice(None):
            raise TypeError("slicing an nl.arange is not supported; use nl.arange(start, stop)")
        axis, ndim = axes[0], len(key)
        terms = tuple((IndexVar(v.start, v.n, axis, ndim), c) for v, c in self.terms)
        return IndexExpr(terms, self.const)

    def __setitem__(self, key, value):
        raise nki_error("err_cannot_assign_to_index", "type",
                        "'index' tensor does not support item assignment; materialise it with "
                        "nisa.iota first")

    # -- affine arithmetic --------------------------------------------------------------------
    def _combine(self, other, sign):
        if isinstance(other, IndexExpr):
            if not (self.affine and other.affine):
                return _nonaffine(self, other, operator.add if sign > 0 else operator.sub)
            d = {}
            order = []
            for v, c in self.terms:
                d[v] = d.get(v, 0) + c
                order.append(v)
            for v, c in other.terms:
                if v not in d:
                    order.append(v)
                d[v] = d.get(v, 0) + sign * c
            # a variable whose coefficient cancels to 0 keeps its axis and extent: the
            # expression's shape is the broadcast shape of all its aranges (spec §9.16)
            terms = tuple((v, d[v]) for v in dict.fromkeys(order))
            return IndexExpr(terms, self.const + sign * other.const)
        if _is_int(other):
            if not self.affine:
                return IndexExpr((), 0, self.values() + sign * int(other), affine=False)
            return IndexExpr(self.terms, self.const + sign * int(other))
        if hasattr(other, "_is_nki_tensor"):
            return NotImplemented
        raise nki_error("err_tile_index_add_non_integer_scalar", "type",
                        f"tile_index can only add with integer scalar, got {type(other).__name__}")

    def __add__(self, o):
        return self._combine(o, 1)

    __radd__ = __add__

    def __sub__(self, o):
        return self._combine(o, -1)

    def __rsub__(self, o):
        return (-self)._combine(o, 1)

    def __neg__(self):
        if not self.affine:
            return IndexExpr((), 0, -self.values(), affine=False)
        return IndexExpr(tuple((v, -c) for v, c in self.terms), -self.const)

    def __pos__(self):
        return self

    def __mul__(self, o):
        if _is_int(o):
            o = int(o)
            if not self.affine:
                return IndexExpr((), 0, self.values() * o, affine=False)
            # ``0 * nl.arange(n)[:, None]`` is all zeros but still spans the arange's axis
            return IndexExpr(tuple((v, c * o) for v, c in self.terms), self.const * o)
        if isinstance(o, IndexExpr):
            return _nonaffine(self, o, operator.mul)
        if hasattr(o, "_is_nki_tensor"):
            return NotImplemented
        raise nki_error("err_tile_index_add_non_integer_scalar", "type",
                        "tile_index can only be multiplied by an integer scalar, got "
                        f"{type(o).__name__}")

    __rmul__ = __mul__

    def __floordiv__(self, o):
        return _nonaffine(self, o, operator.floordiv)

    def __mod__(self, o):
        return _nonaffine(self, o, operator.mod)

    def __rfloordiv__(self, o):
        return _nonaffine(o, self, operator.floordiv)

    def __rmod__(self, o):
        return _nonaffine(o, self, operator.mod)

    # -- predicates -----------------------------------------------------------------------------
    def __lt__(self, o):
        return Predicate("lt", self, o)

    def __le__(self, o):
        return Predicate("le", self, o)

    def __gt__(self, o):
        return Predicate("gt", self, o)

    def __ge__(self, o):
        return Predicate("ge", self, o)

    def __eq__(self, o):
        return Predicate("eq", self, o)

    def __ne__(self, o):
        return Predicate("ne", self, o)

    __hash__ = object.__hash__

    def __bool__(self):
        _cflag()

    def __index__(self):
        _cflag()

    def __array__(self, dtype=None, copy=None):
        v = self.values()
        return v if dtype is None else v.astype(dtype)

    def __repr__(self):
        return f"IndexExpr(shape={self.shape}, affine={self.affine})"


def _vals_of(x):
    if isinstance(x, IndexExpr):
        return x.values()
    if _is_int(x):
        return int(x)
    raise nki_error("err_tile_index_add_non_integer_scalar", "type",
                    f"tile_index arithmetic only supports integers, got {type(x).__name__}")


def _nonaffine(a, b, op):
    return IndexExpr((), 0, np.asarray(op(_vals_of(a), _vals_of(b)), dtype=np.int64),
                     affine=False)


_PRED_CACHE = {}
_CMP = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
        "eq": operator.eq, "ne": operator.ne}


class Predicate:
    """A mask predicate: comparisons of index expressions combined with ``&``."""

    __slots__ = ("op", "a", "b", "parts")

    def __init__(self, op, a, b, parts=None):
        self.op = op
        self.a = a
        self.b = b
        self.parts = parts          # for op == "and": list of Predicates

    def __and__(self, o):
        if isinstance(o, (bool, np.bool_)):
            return self if o else False
        if isinstance(o, Predicate):
            return Predicate("and", None, None, _parts(self) + _parts(o))
        return NotImplemented

    __rand__ = __and__

    def __or__(self, o):
        raise nki_error("err_unsupported_expression_in_mask", "value",
                        "NKI mask expressions must be affine expressions of static loop "
                        "indices combined with '&'; '|' is not supported.")

    __ror__ = __or__

    def __invert__(self):
        raise nki_error("err_unsupported_expression_in_mask", "value",
                        "NKI mask expressions must be affine expressions of static loop "
                        "indices combined with '&'; '~' is not supported.")

    def __bool__(self):
        if _short_circuit_and(sys._getframe(1)):
            # ``p and q`` on masks: the value is ``q`` (Python's ``and``), as in AWS's front end,
            # which runs its own documentation example ``mask=(ix < n // 2 and iy < m // 2)``
            # (test_nki_isa_nc_match_replace8.py). AWS's known issues say ``and`` is not
            # supported for masks -- use ``&`` -- so the left operand is dropped and we say so.
            warnings.warn("`and` between NKI mask predicates keeps only its right operand "
                          "(Python's `and`; NKI known issues: use `&` to combine masks)",
                          MaskAndWarning, stacklevel=2)
            return True
        _cflag()

    def check(self):
        for p in _parts(self):
            if p.op == "ne":
                raise nki_error("err_mask_not_equal_not_supported", "syntax",
                                "'not equal' mask is not supported")
            for side in (p.a, p.b):
                if isinstance(side, IndexExpr):
                    if not side.affine:
                        raise nki_error(
                            "err_unsupported_expression_in_mask", "value",
                            "NKI mask expressions must be affine expressions of static loop "
                            "indices; '%' and '//' are not affine.")
                elif not _is_int(side) and not isinstance(side, (float, np.floating)):
                    raise nki_error(
                        "err_unsupported_expression_in_mask", "value",
                        "NKI mask expressions must be affine expressions of static loop "
                        f"indices, got a {type(side).__name__}.")

    def evaluate(self):
        """Bool array (broadcast shape of the variables involved); read-only (cached)."""
        if self.op == "and":
            out = None
            for p in self.parts:
                v = p.evaluate()
                out = v if out is None else (out & v)
            return out
        a, b = self.a, self.b
        if isinstance(a, IndexExpr) and a.affine and (not isinstance(b, IndexExpr) or b.affine):
            # compare ``a - b`` with 0: one affine expression, cached by structure + offset
            # (loops rebuild the same predicate with a different constant every iteration)
            d = a - b if isinstance(b, IndexExpr) else a - int(b) if _is_int(b) else None
            if d is not None:
                key = (self.op, d.const, tuple((v.uid, c) for v, c in d.terms))
                r = _PRED_CACHE.get(key)
                if r is None:
                    if len(_PRED_CACHE) > 512:
                        _PRED_CACHE.clear()
                    r = np.asarray(_CMP[self.op](d.values(), 0))
                    r.flags.writeable = False
                    _PRED_CACHE[key] = r
                return r
        av = a.values() if isinstance(a, IndexExpr) else a
        bv = b.values() if isinstance(b, IndexExpr) else b
        return np.asarray(_CMP[self.op](av, bv))

    def __repr__(self):
        return f"Predicate({self.op})"


def _parts(p):
    return list(p.parts) if p.op == "and" else [p]


def arange(*args):
    """``nl.arange(stop)`` / ``nl.arange(start, stop)``: a 1-D index variable (no step)."""
    _in_kernel_check()
    if len(args) == 1:
        start, stop = 0, args[0]
    elif len(args) == 2:
        start, stop = args
    else:
        raise TypeError("nl.arange takes (stop) or (start, stop); express strides by "
                        "multiplying, e.g. 2*nl.arange(64)")
    start, stop = int(start), int(stop)
    return IndexExpr(((IndexVar(start, max(stop - start, 0), 0, 1), 1),), 0)


class MGridResult(tuple):
    """Result of ``nl.mgrid[...]``: unpackable, and exposes ``.p .x .y .z``."""

    @property
    def p(self):
        return self[0]

    @property
    def x(self):
        return self[1]

    @property
    def y(self):
        return self[2]

    @property
    def z(self):
        return self[3]


class _MGrid:
    def __getitem__(self, key):
        _in_kernel_check()
        if not isinstance(key, tuple):
            key = (key,)
        ndim = len(key)
        out = []
        for ax, s in enumerate(key):
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise TypeError("nl.mgrid supports only start:stop slices (no steps)")
            start = 0 if s.start is None else int(s.start)
            out.append(IndexExpr(((IndexVar(start, max(int(s.stop) - start, 0), ax, ndim),
                                   1),), 0))
        return MGridResult(out)


mgrid = _MGrid()


def ds(start, size):
    """``nl.ds(start, size)``: the slice ``start:start+size`` (start may be a loop int)."""
    _in_kernel_check()
    if isinstance(start, IndexExpr):
        raise nki_error("err_unsupported_mixing_basic_advanced_tensor_indexing", "syntax",
                        "nl.ds start must be an integer or loop index, not an nl.arange.")
    start = int(start)
    return slice(start, start + int(size), None)


def eval_mask(mask, shape):
    """Evaluate ``mask=`` for an operation whose grid/output has ``shape``.

    Returns None (no mask / always on), False (instruction disabled) or a bool array
    broadcast to ``shape``."""
    if mask is None:
        return None
    if isinstance(mask, (bool, np.bool_)):
        return None if mask else False
    if isinstance(mask, Predicate):
        mask.check()
        m = mask.evaluate()
        # a 2-D grid mask on a rank-1 partition-vector result: drop unit axes (trailing first)
        while m.ndim > len(shape) and m.shape[-1] == 1:
            m = m[..., 0]
        while m.ndim > len(shape) and m.shape[0] == 1:
            m = m[0]
        try:
            m = np.broadcast_to(m, shape)
        except ValueError:
            # rank-deficient tiles are partition-aligned: right-pad the mask's shape
            try:
                mm = m.reshape(m.shape + (1,) * (len(shape) - m.ndim)) if m.ndim < len(shape) \
                    else m
                m = np.broadcast_to(mm, shape)
            except ValueError:
                raise nki_error(
                    "err_unsupported_expression_in_mask", "value",
                    f"mask of shape {list(mask.evaluate().shape)} cannot be applied to an "
                    f"operation of shape {list(shape)}") from None
        if m.all():
            return None
        if not m.any():
            return False
        return m
    if isinstance(mask, IndexExpr):
        raise nki_error("err_unsupported_expression_in_mask", "value",
                        "NKI mask expressions must be comparisons of affine index expressions.")
    raise nki_error("err_unsupported_expression_in_mask", "value",
                    "NKI mask expressions must be affine expressions of static loop indices, "
                    f"got {type(mask).__name__}.")
