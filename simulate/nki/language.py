"""``nki.language`` (``nl``) of NKI 0.7 (Neuron SDK 2.33) on the simulator's core.

Signatures follow AWS's stub ``nki/api/nki/language/__init__.py`` (aws-neuron/aws-neuron-sdk);
each function translates onto the legacy implementation in ``simulate.language`` so that
values, rules and cost are computed once. Pages cited below are the 2.33 docs:

* nki-loops: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/deep-dives/nki-loops.html
* migration: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/migration/index.html
* simulator: https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/guides/nki_simulator.html

Not here yet: ``NkiTensor.view``/``.indirect``/``vector_select``,
``shared_constant`` and ``device_print`` under their 0.7 names, ``dropout``/``rand``.
"""

from __future__ import annotations

import builtins as _builtins
import operator as _operator
import sys as _sys

from .. import _deps, _errors, _hw, _ops, _runtime, _scalar, _sched, _strict, _tensor
from .. import language as _L
from .._dtypes import (float32, float16, bfloat16, float8_e4m3, float8_e5m2, tfloat32,  # noqa: F401,E501 (public dtypes)
                       float8_e4m3fn, float8_e8m0fnu, int8, int16, int32, uint8, uint16,
                       uint32, bool_, float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4)

DOC_LOOPS = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/deep-dives/"
             "nki-loops.html")
DOC_MIGRATION = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/migration/"
                 "index.html")
DOC_BLOCK_DIMS = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/migration/"
                  "nki-block-dimension-migration-guide.html")

# -- memory regions (stub: MemoryRegion sbuf, psum, private_hbm, shared_hbm; hbm = private) ---
sbuf = _L.sbuf
psum = _L.psum
private_hbm = _L.private_hbm
hbm = _L.hbm
shared_hbm = _L.shared_hbm


def is_hbm(buffer):
    return _L._buffer_kind(buffer) in ("hbm", "shared_hbm")


def is_on_chip(buffer):
    return _L._buffer_kind(buffer) in ("sbuf", "psum")


def is_psum(buffer):
    return _L._buffer_kind(buffer) == "psum"


def is_sbuf(buffer):
    return _L._buffer_kind(buffer) == "sbuf"


# -- tile_size (stub: _TileSize) ----------------------------------------------------------------
class _TileSize(_L._TileSize):
    """``nl.tile_size`` of NKI 0.7: the legacy constants plus the 0.4.0 names
    (``psum_bank_fmax``, ``psum_bank_fmax_bytes``, ``sbuf_size_bytes``, ``sbuf_fmax``,
    ``sbuf_fmax_bytes``). ``psum_min_align``/``sbuf_min_align`` have no value in AWS's
    documentation and are not provided."""

    psum_bank_fmax = _hw.PSUM_FMAX
    psum_bank_fmax_bytes = _hw.PSUM_BANK_BYTES

    @staticmethod
    def _tgt():
        if _runtime.in_kernel():
            return _runtime.current().tgt
        return _runtime.resolve_target({})

    @property
    def sbuf_size_bytes(self):
        return self._tgt().sbuf_bytes_per_partition * _hw.NUM_PARTITIONS

    @property
    def sbuf_fmax_bytes(self):
        return self._tgt().total_available_sbuf_size

    @property
    def sbuf_fmax(self):
        return self._tgt().total_available_sbuf_size // 4


tile_size = _TileSize()


# -- SPMD ---------------------------------------------------------------------------------------
def _lnc1(axis):
    """A kernel launched without brackets runs at the default LNC=1 (nki.jit docstring: "The
    default is LNC=1"): its launch is one program, so axis 0 answers program 0 of 1 as it does
    for ``kernel[1]``, instead of the legacy rank-0 grid error."""
    return _L.program_ndim() == 0 and not isinstance(axis, bool) and axis in (0, -1)


def program_id(axis=0):
    if _lnc1(axis):
        _runtime.enter()
        return 0
    return _L.program_id(axis)


def num_programs(axes=0):
    # The stub's signature defaults to axis 0 (its docstring also mentions "if not provided,
    # the total"); we follow the signature.
    if _lnc1(axes):
        _runtime.enter()
        return 1
    return _L.num_programs(axes)


def program_ndim():
    return _L.program_ndim()


# -- loops (nki-loops page) -----------------------------------------------------------------
def _range(api, start, stop, step):
    for v in (start, stop, step):
        if isinstance(v, _strict.SymbolicIndex):
            # nki-loops: Python loops (and these aliases) unroll at tracing, so their bounds
            # must be known while tracing; runtime counts go to nl.fori_loop
            raise _strict.LoopBoundError(
                f"nl.{api}: bound {v!r} is a runtime value; NKI 0.7 unrolls {api} (an alias of "
                f"Python range) while tracing, so its bounds must be Python ints. Use "
                f"nl.fori_loop for a runtime trip count ({DOC_LOOPS})")
    return _strict.builtin_range(start, stop, step) if stop is not None else \
        _strict.builtin_range(start)


def affine_range(start, stop=None, step=1):
    """Alias of Python ``range`` (NKI 0.7, deprecated): unrolled while tracing, every iteration
    is program text (nki-loops page)."""
    return _range("affine_range", start, stop, step)


def sequential_range(start, stop=None, step=1):
    """Alias of Python ``range`` (NKI 0.7, deprecated; nki-loops page)."""
    return _range("sequential_range", start, stop, step)


def static_range(start, stop=None, step=1):
    """Alias of Python ``range`` (NKI 0.7, deprecated; nki-loops page)."""
    return _range("static_range", start, stop, step)


def dynamic_range(*args, **kwargs):
    raise NotImplementedError(
        f"nl.dynamic_range was removed in NKI 0.7 (deprecated in 0.6); use nl.fori_loop "
        f"({DOC_MIGRATION})")


class LoopIndex(_scalar.NkiScalar):
    """The index ``nl.fori_loop`` passes to its body: a runtime scalar (``NkiScalar`` /
    ``VirtualRegister`` in AWS's API, ``simulate._scalar``). It works in index arithmetic,
    slices, ``nl.ds`` and access-pattern offsets; kernel code cannot make it a Python int
    (``int()``, ``range()``, a list index, a shape) nor branch on it (``if``): the stub's
    VirtualRegister note, "using a register in Python control flow (if/while) or converting it
    with int() / range() raises TypeError" under the tracer. Refused whatever the strict
    setting."""

    __slots__ = ()

    def _kind(self):
        return "the index of an nl.fori_loop, a runtime scalar on the device"

    def _new(self, v, what):
        return LoopIndex(v, what, self.loop)


class _CompiledLoop:
    """A running compiled loop (``fori_loop``/``while_loop``): its ``LoopState`` is on the
    context's loop stack while it runs; ``begin`` starts an iteration, ``end`` closes it (the
    iteration's block scope, and the estimate's iteration boundary)."""

    def __init__(self, ctx, start, frame):
        self.ctx = ctx
        self.state = _deps.LoopState(start, False, frame.f_code.co_filename, frame.f_lineno,
                                     False)

    def __enter__(self):
        self.ctx.loop_depth += 1
        self.ctx.loops.append(self.state)
        return self

    def __exit__(self, *exc):
        self.ctx.loop_depth -= 1
        try:
            self.ctx.loops.remove(self.state)
        except ValueError:
            pass
        return False

    def begin(self, value, n):
        self.state.value = value
        self.state.first = n == 0
        self.state.iter_no = n

    def end(self):
        _runtime.end_iteration(self.state)
        _iteration_boundary(self.ctx)


def _iteration_boundary(ctx):
    """The end of an iteration of a compiled loop: a barrier in the scheduled estimate when the
    active measure assumes no overlap across iterations (``measure(compiled_loop_overlap=
    False)``)."""
    if _sched.ACTIVE is not None and not _runtime.compiled_loop_overlap():
        _sched.ACTIVE.barrier(ctx.rec.core)


def fori_loop(lower, upper, body_fun, step=1):
    """``nl.fori_loop(lower, upper, body_fun, step=1)``: a compiled (hardware) loop. The body
    is called with the index as a :class:`LoopIndex` and is one copy of program text ("a single
    copy of the body is generated and the hardware iterates over it at runtime", nki dynamic
    loops page): the program size counts it once, the run executes every iteration. A loop
    whose runtime bound (a register or loop index) gives no iteration still holds its body in
    the program: it runs once, at ``lower``, for its program text only
    (``_runtime.text_only``, effects discarded). Returns
    None; state is carried through SBUF/HBM (stub docstring)."""
    ctx = _runtime.enter()
    if not callable(body_fun):
        raise TypeError("nl.fori_loop: body_fun must be callable (i) -> None")
    if isinstance(step, _strict.SymbolicIndex) or int(step) <= 0:
        raise ValueError("nl.fori_loop: step must be a compile-time positive integer (stub)")
    lo = lower.v if isinstance(lower, _strict.SymbolicIndex) else int(lower)
    hi = upper.v if isinstance(upper, _strict.SymbolicIndex) else int(upper)
    for b in (lo, hi):
        if not -2 ** 31 <= b < 2 ** 31:
            raise ValueError("nl.fori_loop: bounds are 32-bit integers (nki-loops page)")
    r = _strict.builtin_range(lo, hi, int(step))
    if _runtime._trace["on"]:
        r = r[:1]                     # program_size(): the body is traced once
    name = getattr(body_fun, "__name__", "body")
    with _CompiledLoop(ctx, r.start if len(r) else lo, _sys._getframe(1)) as loop:
        for n, i in enumerate(r):
            loop.begin(i, n)
            _fori_body(body_fun, i, name, loop)
            loop.end()
        if not len(r) and (isinstance(lower, _strict.SymbolicIndex)
                           or isinstance(upper, _strict.SymbolicIndex)):
            # a runtime count of 0: no iteration runs, but the body is program text all the
            # same (a count of 0 known while tracing leaves nothing to iterate over)
            with _runtime.text_only(ctx):
                loop.begin(lo, 0)
                _fori_body(body_fun, lo, name, loop)
                _runtime.end_iteration(loop.state)
    return None


def _fori_body(body_fun, i, name, loop):
    if body_fun(LoopIndex(i, f"index of nl.fori_loop({name})", loop.state.uid)) is not None:
        raise TypeError("nl.fori_loop: body_fun returns None; carry loop state through "
                        "SBUF/HBM tensors (stub docstring)")


def _check_next(ret):
    if not isinstance(ret, _scalar.VirtualRegister):
        raise TypeError(f"nl.while_loop: body_fun must return the VirtualRegister holding the "
                        f"next condition, got {type(ret).__name__} (stub docstring)")
    return ret


def while_loop(init, body_fun):
    """``nl.while_loop(init, body_fun)``: a compiled loop that runs while its condition
    register is nonzero, tested before each iteration (stub: "a true while, not do-while").
    ``body_fun(r)`` gets the condition's value as a register and returns the register holding
    the next condition. Like ``fori_loop``, the body is one copy of program text: the run
    executes every iteration, the program size counts it once (a loop whose condition starts
    at 0 runs its body for its program text only). Returns None."""
    ctx = _runtime.enter()
    if not isinstance(init, _scalar.VirtualRegister):
        raise TypeError(f"nl.while_loop: init must be a VirtualRegister (nisa.register_alloc), "
                        f"got {type(init).__name__} ({DOC_LOOPS})")
    if not callable(body_fun):
        raise TypeError("nl.while_loop: body_fun must be callable (r) -> VirtualRegister")
    cond = init
    tracing = _runtime._trace["on"]
    with _CompiledLoop(ctx, 0, _sys._getframe(1)) as loop:
        if cond.v == 0:
            # no iteration runs, but the body is program text all the same
            with _runtime.text_only(ctx):
                loop.begin(0, 0)
                _check_next(body_fun(_scalar.VirtualRegister(0)))
                _runtime.end_iteration(loop.state)
            return None
        n = 0
        while cond.v != 0:
            loop.begin(n, n)
            n += 1
            arg = _scalar.VirtualRegister(cond.v)      # passed by value
            cond = _check_next(body_fun(arg))
            loop.end()
            if tracing or _runtime.is_text_only():
                # program_size(): the body once; inside a body traced for its text only the
                # register writes that would end the loop are dropped: once is all it needs
                break
    return None


# -- removed indexing (migration guide: "Update indexing syntax for mgrid and arange") ---------
def _no_arange(api):
    return NotImplementedError(
        f"nl.{api} does not exist in NKI 0.7 (removed in 0.2.0, migration guide): index "
        f"contiguous elements with integer slices (t[0:128, 0:8, 0:64] instead of "
        f"mgrid[0:128, 0:8, 0:64]; a flattened index i*64 + j becomes one slice 0:8*64), and "
        f"anything slices cannot express with an access pattern, t.ap([[stride, count], ...], "
        f"offset=...) ({DOC_MIGRATION})")


def arange(*args, **kwargs):
    raise _no_arange("arange")


class _NoMgrid:
    def __getitem__(self, key):
        raise _no_arange("mgrid")

    def __repr__(self):
        return "<nl.mgrid: removed in NKI 0.7>"


mgrid = _NoMgrid()


class _NKIObjectMeta(type):
    """Keyword arguments naming class attributes set those attributes. Kernels declare
    ``@dataclass class P(nl.NKIObject): x = None`` (an attribute without annotation, which
    ``dataclass`` does not make a field) and construct ``P(x=1)``, as AWS's nki-library does;
    the stub's ``NKIObject.__init__(self, **kwargs)`` takes them."""

    def __call__(cls, *args, **kwargs):
        import inspect
        try:
            params = inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError):
            params = {}
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return super().__call__(*args, **kwargs)
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in params}
        for k in extra:
            if not hasattr(cls, k):
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument '{k}'")
        obj = super().__call__(*args, **kwargs)
        for k, v in extra.items():
            setattr(obj, k, v)
        return obj


class NKIObject(metaclass=_NKIObjectMeta):
    """Base class of kernel dataclasses and configuration objects (stub ``NKIObject``)."""

    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            setattr(self, k, v)


#: The tensor type of NKI 0.7: the core's tensor, with the view methods of ``simulate._views``
#: (``ap``, ``slice``, ``select``, ``permute``, ``broadcast``, ``expand_dim``, ``squeeze_dim``,
#: ``reshape_dim``, ``flatten_dims``, ``reshape``, ``rearrange``, ``strides``, ``offset``, ...).
NkiTensor = _tensor.Tensor


# -- tensor creation ------------------------------------------------------------------------
def _shape07(shape, api):
    if isinstance(shape, _strict.INT_TYPES):
        shape = (shape,)
    shape = tuple(shape)
    for i, s in enumerate(shape):
        if isinstance(s, _L.par_dim) and i != 0:
            # migration guide: block dimensions (a partition dim anywhere but first) removed
            raise ValueError(
                f"nl.{api}: shape {shape} puts the partition dim (par_dim) at position {i}; NKI "
                f"0.7 has no block dimensions: the partition dim is always the first "
                f"({DOC_BLOCK_DIMS})")
    return tuple(s if isinstance(s, _strict.SymbolicIndex) else int(s) for s in shape)


def ndarray(shape, dtype, buffer=sbuf, name='', address=None):
    """New tensor (partition dim first). Fresh memory holds NaN (ints: the type's maximum),
    as AWS's nki.simulate fills new allocations to expose uninitialized reads (simulator
    guide). ``address=(partition, byte offset)`` on SBUF or PSUM places the tensor there:
    see :func:`_place_at`."""
    ctx = _runtime.enter()
    t = _L._create(ctx, _shape07(shape, "ndarray"), dtype, buffer, name, None, "ndarray", 1)
    if address is not None and is_on_chip(buffer):
        _place_at(ctx, t._st, address)
    return t


def _place_at(ctx, st, address):
    """An on-chip tensor the kernel placed itself (``address=(partition, byte offset)`` of
    the stub's ``nl.ndarray``): a direct allocation, like ``mod_alloc``. The compiler's
    allocator does not own it, so it is not counted in the live SBUF/PSUM stack (tensors the
    kernel places at the same address share that memory: nki-library's attention_cte puts
    its QK^T tiles in PSUM banks ``k % 4`` and its PV tiles in banks ``4 + k % 4``, its
    SbufManager places every SBUF buffer on a stack it manages); the placement must lie
    within the partitions and the bytes per partition of the memory (PSUM: 8 banks of 2 KiB).
    Overlaps between placed tensors are the kernel's business and not checked."""
    if isinstance(address, (tuple, list)):
        part, off = (int(address[0]), int(address[1])) if len(address) > 1 else (
            0, int(address[0]))
    else:
        part, off = 0, int(address)
    shape = st.arr.shape
    nbytes = st.di.itemsize
    for s in shape[1:]:
        nbytes *= int(s)
    psum = st.buffer == "psum"
    cap = _hw.PSUM_NUM_BANKS * _hw.PSUM_BANK_BYTES if psum else \
        ctx.tgt.sbuf_bytes_per_partition
    if part < 0 or part + int(shape[0]) > _hw.NUM_PARTITIONS or off < 0 or off + nbytes > cap:
        raise _errors.hw_error(
            "runtime",
            f"Allocated memory out of bound: tensor '{st.name}' {list(shape)} "
            f"{st.di.name} is placed at partitions {part}..{part + int(shape[0])}, bytes "
            f"{off}..{off + nbytes} per partition, but {ctx.tgt.name}'s {st.buffer.upper()} "
            f"has {_hw.NUM_PARTITIONS} partitions of {cap} bytes")
    st.pinned = True
    if psum:
        first, last = off // _hw.PSUM_BANK_BYTES, (off + nbytes - 1) // _hw.PSUM_BANK_BYTES
        st.banks = last - first + 1
        st.bpp = nbytes
        ctx.peak_banks = _builtins.max(ctx.peak_banks, last + 1)
        ctx.peak_psum = _builtins.max(ctx.peak_psum, off + nbytes)
    else:
        st.bpp = nbytes
        ctx.peak_sbuf = _builtins.max(ctx.peak_sbuf, off + nbytes)


def zeros(shape, dtype, buffer=sbuf, name=''):
    ctx = _runtime.enter()
    return _L._create(ctx, _shape07(shape, "zeros"), dtype, buffer, name, 0, "zeros", 1)


def ones(shape, dtype, buffer=sbuf, name=''):
    ctx = _runtime.enter()
    return _L._create(ctx, _shape07(shape, "ones"), dtype, buffer, name, 1, "ones", 1)


def full(shape, fill_value, dtype, buffer=sbuf, name=''):
    ctx = _runtime.enter()
    return _L._create(ctx, _shape07(shape, "full"), dtype, buffer, name, fill_value, "full", 1)


def zeros_like(x, dtype=None, buffer=None, name=''):
    return zeros(x.shape, dtype if dtype is not None else x.dtype,
                 buffer if buffer is not None else _buffer_of(x), name)


def empty_like(x, dtype=None, buffer=None, name=''):
    return ndarray(x.shape, dtype if dtype is not None else x.dtype,
                   buffer if buffer is not None else _buffer_of(x), name)


def _buffer_of(x):
    return {"sbuf": sbuf, "psum": psum, "hbm": hbm, "shared_hbm": shared_hbm}.get(
        getattr(x, "buffer", "sbuf"), sbuf)


def ds(start, size):
    """``nl.ds(start, size)``: the slice ``start:start + size``; a runtime ``start`` (a
    register, a fori_loop index) stays in the slice, as in ``t[i:i + size]``, so the view
    knows its offset is a runtime value (``Tensor._rto``)."""
    s = _L.ds(start, size)
    if isinstance(start, _scalar.NkiScalar):
        return slice(start, start + (s.stop - s.start))
    return s


# -- load / store (experimental wrappers again since 0.3.0) -------------------------------------
def load(src, dtype=None):
    return _L.load(src, dtype=dtype)


def store(dst, value):
    return _L.store(dst, value)


# -- compute wrappers (stub signatures: (x[, y], dtype=None)) ---------------------------------
def _binary(name):
    impl = getattr(_L, name)

    def f(x, y, dtype=None):
        return impl(x, y, dtype=dtype)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"``nl.{name}(x, y, dtype=None)`` (NKI 0.7), computed by the core's nl.{name}."
    return f


def _unary(name):
    impl = getattr(_L, name)

    def f(x, dtype=None):
        return impl(x, dtype=dtype)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"``nl.{name}(x, dtype=None)`` (NKI 0.7), computed by the core's nl.{name}."
    return f


def _reduce(name):
    impl = getattr(_L, name)

    def f(x, axis, dtype=None, keepdims=False):
        return impl(x, axis, dtype=dtype, keepdims=keepdims)
    f.__name__ = f.__qualname__ = name
    return f


_BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "equal",
           "not_equal", "less", "less_equal", "greater", "greater_equal", "bitwise_and",
           "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "logical_and",
           "logical_or", "logical_xor", "fmod", "mod")
_UNARY = ("abs", "square", "invert", "logical_not", "exp", "log", "sqrt", "rsqrt", "tanh",
          "sigmoid", "relu", "gelu", "gelu_apprx_sigmoid", "gelu_apprx_tanh", "gelu_dx",
          "silu", "silu_dx", "softplus", "mish", "erf", "erf_dx", "reciprocal", "copy", "sin",
          "cos", "tan", "arctan", "ceil", "floor", "trunc", "negative", "sign")
_REDUCE = ("sum", "max", "min", "mean", "prod", "var")
_g = globals()
for _n in _BINARY:
    _g[_n] = _binary(_n)
for _n in _UNARY:
    _g[_n] = _unary(_n)
for _n in _REDUCE:
    _g[_n] = _reduce(_n)
del _g, _n


def all(x, axis, dtype=None):  # noqa: A001 (NKI name)
    return _L.all(x, axis, dtype=dtype)


def where(condition, x, y, dtype=None):
    return _L.where(condition, x, y, dtype=dtype)


def transpose(x, dtype=None):
    return _L.transpose(x, dtype=dtype)


def matmul(x, y, transpose_x=False):
    return _L.matmul(x, y, transpose_x=transpose_x)


def softmax(x, axis=-1, dtype=None):
    return _L.softmax(x, axis, dtype=dtype)


def expand_dims(x, axis):
    return _L.expand_dims(x, axis)


def broadcast_to(x, shape, dtype=None):
    r = _L.broadcast_to(x, shape=shape)
    return r if dtype is None else _L.copy(r, dtype=dtype)


def shared_identity_matrix(n, dtype=uint8, dst=None):
    if dst is not None:
        raise NotImplementedError("nl.shared_identity_matrix(dst=...) is not simulated yet")
    return _L.shared_identity_matrix(n, dtype=dtype)


# Operators used as ``op=`` of nki.isa instructions (stub: nl.add, nl.maximum, ... are the
# functions above; ``bypass`` skips a tensor_scalar stage).
bypass = None


def _register_ops():
    """The 0.7 functions are accepted wherever an ``op=`` names an ALU/activation function, as
    the legacy ones they wrap (``_ops.OP_BY_OBJ``)."""
    m = _ops.OP_BY_OBJ
    for n in _BINARY + _UNARY + _REDUCE + ("all",):
        legacy = getattr(_L, n, None)
        if legacy in m:
            m[globals()[n]] = m[legacy]


_register_ops()

__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "DOC_LOOPS", "DOC_MIGRATION", "DOC_BLOCK_DIMS")]
_ = (_builtins, _operator)
