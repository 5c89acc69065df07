"""One kernel source, two NKI namespaces: the few operations where ``nki.*`` (NKI 0.7) and the
legacy ``neuronxcc.nki`` differ, in one place.

A ported kernel imports ``nl`` and its instructions from here, never from a namespace::

    from nki_kernels import port
    from nki_kernels.port import nl

    @port.jit
    def kernel(x):
        y = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
        port.dma_copy(t[0:rows, 0:512], x[...])                    # HBM -> SBUF
        port.tensor_scalar(t, t, op0=nl.multiply, operand0=2.0)   # VectorE, writes dst
        ...

What is the same in both namespaces is used as it is, through ``nl`` (a proxy of the namespace
being traced): dtypes, buffers, ``nl.ndarray``/``nl.zeros``/``nl.full`` of 2-D (partition
first) tiles, ``nl.ds``, the operators (``nl.add``, ``nl.maximum``, ``nl.exp``, ...), basic slices
of tensors, and index arithmetic on a loop index (``i * size + c``, in slices and ``nl.ds``).
Allocate tiles with ``nl.ndarray`` at the statement that owns them, not through a shared helper:
each allocation statement is one tile (one rotating buffer in the compiler and in the
simulator's schedule, which keys buffers on the allocating line). What differs goes through
this module:

- **Instructions write ``dst``** (the 0.7 form, migration guide): ``tensor_scalar(dst, data,
  ...)`` is ``nisa.tensor_scalar(dst=dst, ...)`` in 0.7 and ``dst[...] = nisa.tensor_scalar(...,
  dtype=dst.dtype)`` in legacy, so the result dtype is always ``dst.dtype``. ``dst`` may be a
  slice of a tile (``t[0:rows, 0:1]``); it has the result's shape.
- **Loads and stores** are ``dma_copy(dst, src)`` into preallocated tiles: ``nisa.dma_copy`` in
  0.7, ``nl.load``/``nl.store`` in legacy (the instructions this package's legacy estimates were
  made with). The cast, if any, is to ``dst.dtype``.
- **Compiled loops**: ``loop(n, body, carried=...)`` calls ``body(i)`` for ``i`` in ``[0, n)``
  as ``nl.fori_loop`` in 0.7 (every Python loop unrolls in 0.7) and ``nl.affine_range`` /
  ``nl.sequential_range`` (``carried=True``: a loop-carried dependence) in legacy. Either way the
  body is one copy of program text, so the program size does not grow with ``n``. ``i`` is a
  runtime index: use it in index arithmetic, slices and ``nl.ds`` only (no ``int(i)``, no
  ``if`` on it, no ``range(i)``). Loops whose trip count is a small constant may stay Python.
- **Kernels** are decorated with :func:`jit`, which keeps the plain function; the launcher
  (``host._launch.launch``) binds the namespace chosen by ``NKI_FLASH_API``
  (:func:`nki_kernels.nki.select_api`), applies that namespace's ``nki.jit`` and traces the same
  function with :func:`tracing` active. Nothing here reaches the other namespace: a kernel
  traced through ``nki.*`` uses no ``neuronxcc`` object.

- **TensorE into PSUM**: ``nc_matmul(dst, stationary, moving, accumulate=False|True)`` is
  ``nisa.nc_matmul(dst, ..., accumulate=)`` in 0.7 and ``dst[...] = / += nisa.nc_matmul(...)``
  in legacy (``True`` only onto PSUM a matmul or a zero fill has written: 0.7 leaves it
  undefined otherwise). ``nc_transpose(dst, data)`` likewise; its PSUM ``dst`` has the dtype
  :func:`transpose_dtype` gives (0.7 requires the input's dtype; the legacy kernels transposed
  into fp32 PSUM, kept so their estimates do not move).
- **Engines** are named by strings (``"vector"``, ``"scalar"``, ``"gpsimd"``):
  ``nisa.engine.vector`` in 0.7, ``nisa.vector_engine`` in legacy.

- **Index patterns**: ``iota`` and ``affine_select`` take 0.7's ``(pattern, offset,
  channel_multiplier)``; legacy gets the equivalent ``nl.arange`` expression. 0.7 offsets are
  compile-time ints, so a mask whose diagonal moves with a loop index is a
  :class:`DiagonalMask` (legacy: ``affine_select`` with the index in its offset; 0.7: a bound
  table made once + ``range_select``, NeuronCore-v3+).
- **SPMD grids**: 0.7 launches ``kernel[lnc]`` only (one number). A kernel that legacy runs on
  a grid walks it with :func:`for_programs` (``nl.program_id`` in legacy, one compiled loop in
  0.7) and is launched on :func:`launch_grid`.

Not covered yet (the later kernels' needs): ``par_dim`` block dimensions, loop-carried Python
values.
"""
from __future__ import annotations

import contextlib
import math
import operator

from nki_kernels import nki as _binding
from nki_kernels import tiles

_ACTIVE = []


def current():
    """The :class:`nki_kernels.nki.Namespace` being traced (legacy outside :func:`tracing`, which
    is what the kernels not ported yet trace through)."""
    return _ACTIVE[-1] if _ACTIVE else _binding.namespace("legacy")


@contextlib.contextmanager
def tracing(ns):
    """Trace kernels through the namespace ``ns`` inside the block."""
    _ACTIVE.append(ns)
    try:
        yield ns
    finally:
        _ACTIVE.pop()


class _Language:
    """``nl`` of the namespace being traced (attribute lookups resolve at trace time)."""

    def __getattr__(self, name):
        return getattr(current().nl, name)

    def __repr__(self):
        return f"<nki_kernels.port.nl -> {current().nl.__name__}>"


nl = _Language()


class Kernel:
    """A kernel written against this module: ``func`` is the plain function; :meth:`jitted`
    is it under one namespace's ``nki.jit`` (made once per namespace)."""

    def __init__(self, func):
        self.func = func
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__
        self._jitted = {}

    def jitted(self, ns):
        key = (ns.api, ns.backend)
        if key not in self._jitted:
            self._jitted[key] = ns.nki.jit(self.func)
        return self._jitted[key]

    def __repr__(self):
        return f"<nki_kernels.port.Kernel {self.__name__}>"


def jit(func):
    """Mark ``func`` as a kernel traced through either namespace (see :class:`Kernel`)."""
    return Kernel(func)


# -- data movement ----------------------------------------------------------------------------

def dma_copy(dst, src):
    """``dst = src`` by DMA (HBM -> SBUF or SBUF -> HBM), cast to ``dst.dtype``."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.dma_copy(dst=dst, src=src)
    elif str(getattr(src, "buffer", "")).lower().endswith("hbm"):     # hbm, shared_hbm
        dst[...] = ns.nl.load(src, dtype=dst.dtype)
    else:
        ns.nl.store(dst, value=src)


# -- compiled loops ---------------------------------------------------------------------------

def loop(n, body, carried=False, start=0):
    """``body(i)`` for ``i`` in ``[start, n)`` as a compiled loop (see the module docstring);
    ``carried`` says an iteration reads what the previous one wrote (legacy needs
    ``sequential_range`` for that; 0.7's ``fori_loop`` is sequential by definition)."""
    ns = current()
    if ns.api == "nki":
        def step(i):
            body(i)

        step.__name__ = getattr(body, "__name__", "body")
        ns.nl.fori_loop(start, n, step)
        return
    rng = ns.nl.sequential_range if carried else ns.nl.affine_range
    for i in (rng(start, n) if start else rng(n)):
        body(i)


def for_tiles(total, size, body, carried=False):
    """Call ``body(i, n)`` for the tiles ``i * size ... i * size + n`` covering ``[0, total)``:
    a compiled :func:`loop` over the full tiles, then one statically sized tail.

    ``total`` and ``size`` are static ints. ``i`` is the tile index: a runtime loop index for the
    full tiles (a Python int when there is only one, and for the tail); the tile starts at
    ``i * size``. ``n`` is always a Python int (``size``, or ``total % size`` for the tail), so
    partial tiles are plain static slices (no masks). ``carried``: see :func:`loop`.
    """
    n_full, tail = divmod(total, size)
    if n_full == 1:
        body(0, size)
    elif n_full > 1:
        def full_tile(i):
            body(i, size)

        full_tile.__name__ = getattr(body, "__name__", "body")
        loop(n_full, full_tile, carried=carried)
    if tail:
        body(n_full, tail)


# -- compute instructions: dst first, result dtype = dst.dtype ---------------------------------

def _issue(name, dst, legacy_extra=None, **operands):
    ns = current()
    fn = getattr(ns.nisa, name)
    if ns.api == "nki":
        fn(dst=dst, **operands)
    else:
        dst[...] = fn(**operands, **(legacy_extra or {}), dtype=dst.dtype)


def _engine(ns, name):
    """The engine called ``name`` ("vector", "scalar", "gpsimd") in ``ns``."""
    return getattr(ns.nisa.engine, name) if ns.api == "nki" else getattr(ns.nisa, name + "_engine")


def tensor_copy(dst, src, engine=None):
    """``dst = src`` (SBUF/PSUM -> SBUF) on ``engine`` ("vector", "scalar", "gpsimd"; None lets
    the compiler choose)."""
    if engine is None:
        _issue("tensor_copy", dst, src=src)
    else:
        _issue("tensor_copy", dst, src=src, engine=_engine(current(), engine))


# -- TensorE: results into PSUM ----------------------------------------------------------------

def nc_matmul(dst, stationary, moving, accumulate=False):
    """``dst = stationary^T @ moving`` (``accumulate=False``) or ``dst += ...`` (``True``) on
    TensorE, ``dst`` a PSUM tile (fp32). Start every accumulation group with ``False``, or on a
    PSUM tile zero-filled by ``nl.zeros``: 0.7 leaves ``True`` on an unwritten location
    undefined."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.nc_matmul(dst=dst, stationary=stationary, moving=moving,
                          accumulate=bool(accumulate))
    elif accumulate:
        dst[...] += ns.nisa.nc_matmul(stationary, moving)
    else:
        dst[...] = ns.nisa.nc_matmul(stationary, moving)


def transpose_dtype(dtype):
    """dtype of the PSUM tile a TensorE :func:`nc_transpose` of ``dtype`` data writes: the same
    dtype in 0.7 (``nisa.nc_transpose``: "the output must have the input's dtype"), fp32 in
    legacy (what this package's legacy kernels allocated; their estimates were made with it).
    Allocate the tile at its own statement with this dtype."""
    return dtype if current().api == "nki" else current().nl.float32


def nc_transpose(dst, data):
    """``dst = data^T`` (partitions <-> free) on TensorE: ``data`` in SBUF (<= 128 x 128),
    ``dst`` in PSUM of dtype :func:`transpose_dtype` ``(data.dtype)``."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.nc_transpose(dst=dst, data=data)
    else:
        dst[...] = ns.nisa.nc_transpose(data)


def tensor_tensor(dst, data1, data2, op):
    _issue("tensor_tensor", dst, data1=data1, data2=data2, op=op)


def tensor_scalar(dst, data, op0, operand0, op1=None, operand1=None):
    _issue("tensor_scalar", dst, data=data, op0=op0, operand0=operand0, op1=op1,
           operand1=operand1)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1):
    _issue("scalar_tensor_tensor", dst, data=data, op0=op0, operand0=operand0, op1=op1,
           operand1=operand1)


def tensor_reduce(dst, op, data, axis):
    """Reduce ``data`` over ``axis`` (free axes) into ``dst`` of shape ``(P, 1)``."""
    _issue("tensor_reduce", dst, legacy_extra=dict(keepdims=True), op=op, data=data, axis=axis)


def reciprocal(dst, data):
    _issue("reciprocal", dst, data=data)


def activation(dst, op, data, bias=None, scale=1.0):
    """``dst = op(data * scale + bias)`` on ScalarE (``bias`` a ``(P, 1)`` tile or None)."""
    _issue("activation", dst, op=op, data=data, bias=bias, scale=scale)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0):
    """:func:`activation`, and ``reduce_res`` ``(P, 1)`` = the row reduction (``nl.add``) of
    the fp32 result, taken before ``dst`` is rounded."""
    _issue("activation_reduce", dst, op=op, data=data, reduce_op=reduce_op,
           reduce_res=reduce_res, bias=bias, scale=scale)


# ============================================================================================
# Added for attention/unfused.py: GpSimdE index patterns, a moving-diagonal mask, the SPMD grid
# ============================================================================================

_COMPARE = {"equal": operator.eq, "not_equal": operator.ne, "greater": operator.gt,
            "greater_equal": operator.ge, "less": operator.lt, "less_equal": operator.le}


def _legacy_pattern(ns, P, pattern, offset, channel_multiplier):
    """The legacy index expression of 0.7's ``(pattern, offset, channel_multiplier)`` over a
    ``(P, num_1, ...)`` tile: ``offset + p * channel_multiplier + sum_k i_k * step_k``, built
    from ``nl.arange`` (``offset`` may be a loop-index expression there)."""
    nd = len(pattern) + 1

    def axis(n, k):
        return ns.nl.arange(n)[(None,) * k + (slice(None),) + (None,) * (nd - 1 - k)]

    expr = axis(P, 0) * channel_multiplier + offset
    for k, (step, num) in enumerate(pattern, start=1):
        expr = expr + axis(num, k) * step
    return expr


def iota(dst, pattern, offset=0, channel_multiplier=0):
    """``dst[p, i_1, ...] = offset + p * channel_multiplier + sum_k i_k * step_k`` (GpSimdE,
    int32 math cast to ``dst.dtype``; ``dst`` in SBUF), ``pattern`` 0.7's ``[[step_k, num_k],
    ...]``, one pair per free dim of ``dst``. ``offset`` is a compile-time int in 0.7."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.iota(dst=dst, pattern=pattern, offset=offset,
                     channel_multiplier=channel_multiplier)
    else:
        dst[...] = ns.nisa.iota(_legacy_pattern(ns, dst.shape[0], pattern, offset,
                                                channel_multiplier), dtype=dst.dtype)


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op,
                  offset=0):
    """``dst = on_true_tile`` where ``cmp_op(offset + p * channel_multiplier + sum_k i_k *
    step_k, 0)`` holds, else the float ``on_false_value`` (GpSimdE; SBUF in and out; pattern as
    in :func:`iota`). ``offset`` is a compile-time int in 0.7; legacy also takes a loop-index
    expression (see :class:`DiagonalMask` for a runtime offset in both)."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.affine_select(dst=dst, pattern=pattern, channel_multiplier=channel_multiplier,
                              on_true_tile=on_true_tile, on_false_value=on_false_value,
                              cmp_op=cmp_op, offset=offset)
    else:
        expr = _legacy_pattern(ns, on_true_tile.shape[0], pattern, offset, channel_multiplier)
        dst[...] = ns.nisa.affine_select(pred=_COMPARE[cmp_op.__name__](expr, 0),
                                         on_true_tile=on_true_tile,
                                         on_false_value=on_false_value, dtype=dst.dtype)


class DiagonalMask:
    """Keep ``data[p, j]`` where ``j <= p + offset`` and write fp32.min elsewhere, for a diagonal
    that moves with loop indices: ``offset = step * r + base``, ``r`` a runtime index
    expression in ``[lo, hi)`` (``step``, ``base``, ``lo``, ``hi`` static ints).

    Legacy: :meth:`select` is one :func:`affine_select` whose offset is the index expression.
    0.7: ``affine_select``/``iota`` offsets are compile-time ints, so the mask holds the
    per-partition bounds ``p + step * r + base`` of every ``r``: one fp32 :func:`iota` table
    ``(rows, hi - lo)`` made with the mask (construct it once, outside the loops), and
    :meth:`select` is one ``range_select`` (VectorE; NeuronCore-v3+, i.e. trn2/trn3) of the free
    index against column ``r - lo`` (no reduction). Nothing is allocated in legacy.
    """

    def __init__(self, rows, step, lo, hi, base=0):
        self.step, self.lo, self.base = step, lo, base
        self.bounds = None
        if current().api == "nki":
            self.bounds = nl.ndarray((rows, hi - lo), dtype=nl.float32, buffer=nl.sbuf)
            iota(self.bounds, [[step, hi - lo]], offset=step * lo + base, channel_multiplier=1)

    def select(self, dst, data, r):
        """``dst = data`` on or below the diagonal of ``r``, fp32.min above (``data`` a
        ``(P, F)`` SBUF tile, cast to ``dst.dtype``: -inf in bf16/fp16)."""
        ns = current()
        P, F = data.shape
        if self.bounds is None:
            affine_select(dst, [[-1, F]], 1, data, tiles.FP32_MIN, ns.nl.greater_equal,
                          offset=self.step * r + self.base)
            return
        bound = self.bounds[0:P, nl.ds(r - self.lo, 1)]
        ns.nisa.range_select(dst=dst, on_true_tile=data, comp_op0=ns.nl.less_equal,
                             comp_op1=ns.nl.less_equal, bound0=bound, bound1=bound,
                             reduce_cmd=ns.nisa.reduce_cmd.idle)


def launch_grid(dims, api):
    """The launch grid of a kernel that walks ``dims`` with :func:`for_programs`, traced
    through ``api``: the SPMD grid ``dims`` in legacy; ``(1,)`` in 0.7 (``kernel[lnc]``)."""
    return tuple(dims) if api == "legacy" else (1,)


def for_programs(dims, body):
    """``body(*index)`` for every point of the grid ``dims`` (static ints). Legacy: the kernel is
    launched on the SPMD grid ``dims`` (:func:`launch_grid`) and this program's point is
    ``nl.program_id(0), ...``. 0.7 launches ``kernel[lnc]`` only: the points are one compiled
    :func:`loop` over ``prod(dims)``, the index unflattened row-major with ``//`` and ``%`` of the
    runtime loop index."""
    ns = current()
    if ns.api == "legacy":
        body(*(ns.nl.program_id(a) for a, _ in enumerate(dims)))
        return
    strides = [math.prod(dims[k + 1:]) for k, _ in enumerate(dims)]

    def point(i):
        body(*(i // s if k == 0 else i // s % n
               for k, (s, n) in enumerate(zip(strides, dims))))

    point.__name__ = getattr(body, "__name__", "body")
    loop(math.prod(dims), point)
