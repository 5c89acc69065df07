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
  made with; ``legacy_isa=True``: ``nisa.dma_copy``, where a legacy kernel used that). The
  cast, if any, is to ``dst.dtype``.
- **Compiled loops**: ``loop(n, body, carried=...)`` calls ``body(i)`` for ``i`` in ``[0, n)``
  as ``nl.fori_loop`` in 0.7 (every Python loop unrolls in 0.7) and ``nl.affine_range`` /
  ``nl.sequential_range`` (``carried=True``: a loop-carried dependence) in legacy. Either way the
  body is one copy of program text, so the program size does not grow with ``n``. ``i`` is a
  runtime index: use it in index arithmetic, slices and ``nl.ds`` only (no ``int(i)``, no
  ``if`` on it, no ``range(i)``). Loops whose trip count is a small constant may stay Python.
- **Kernels** are decorated with :func:`jit`, which keeps the plain function; the launcher
  (``host._launch.launch``) binds the namespace chosen by ``NKI_FLASH_API``
  (:func:`nki_kernels.nki.select_api`), applies that namespace's ``nki.jit`` and traces the same
  function with :func:`tracing` active (``Kernel.on(api)`` pins a launch to one namespace;
  ``kernel[grid](...)`` serves frameworks that call the jitted kernel themselves). Nothing here
  reaches the other namespace: a kernel traced through ``nki.*`` uses no ``neuronxcc`` object.

- **TensorE into PSUM**: ``nc_matmul(dst, stationary, moving, accumulate=False|True|None)``
  is ``nisa.nc_matmul(dst, ..., accumulate=)`` in 0.7 and ``dst[...] = / += nisa.nc_matmul(...)``
  in legacy. 0.7's stub makes ``True`` valid only where an ``accumulate=False`` matmul opened
  the accumulation group; onto a PSUM tile zero-filled by ``nl.zeros`` (legacy's idiom before
  ``+=``) pass ``None`` (the compiler infers the flag; AWS's nki-library ``attention_bwd``
  does this after a memset), or open the group with :func:`open_group` where the accumulating
  matmuls must say ``True``. ``nc_transpose(dst, data)`` likewise; its PSUM ``dst`` has the dtype
  :func:`transpose_dtype` gives (0.7 requires the input's dtype; the legacy kernels transposed
  into fp32 PSUM, kept so their estimates do not move).
- **Engines** are named by strings (``"vector"``, ``"scalar"``, ``"gpsimd"``):
  ``nisa.engine.vector`` in 0.7, ``nisa.vector_engine`` in legacy.

- **Predicates** (``mask=``, legacy only): the legacy kernels predicate instructions on
  loop-index comparisons (a block that may lie outside a band). 0.7 has no ``mask=``: there
  the instruction always runs. Pass ``mask`` only where running the instruction anyway is
  harmless (e.g. a block whose scores are all masked leaves the online softmax unchanged).
- **Affine patterns** (:func:`iota`, :func:`affine_select`, :func:`iota_compare`,
  :func:`iota_column`): 0.7's
  ``(pattern, offset, channel_multiplier)`` form; legacy builds the equivalent ``nl.arange``
  expression. 0.7 takes a compile-time ``offset`` only: a part that depends on a loop index
  is passed as ``runtime=`` (an index expression, a multiple of ``offsets.step``, or a linear
  form ``[(expression, int coefficient), ...]`` of step-1 expressions) with ``offsets`` an
  :class:`OffsetColumns` table built once at the kernel's start, from which 0.7 reads those
  values as data (SBUF columns at runtime positions) and adds them on VectorE in fp32 (exact
  below 2^24), or for int32 destinations of an ``exact`` table in int32 on GpSimd.
- **Indirect rows** (:func:`rows`): a gather or scatter of one HBM row per partition, named
  by an index tile: an index-tile subscript in legacy, ``.ap(vector_offset=)`` in 0.7; of a
  slice ``t[b, h]`` of a 4-D tensor (:func:`lead_rows`), in 0.7 through the flattened tensor,
  the slice's first row (:func:`lead_first_row`) added to the indices.
- **Strided HBM blocks** (:func:`row_blocks`): rows ``r0 + j * rows + p`` of an HBM matrix as
  a ``[rows, n, cols]`` access (one DMA): an ``nl.arange`` expression in legacy, a
  ``reshape_dim`` + ``permute`` view in 0.7.
- **Strided on-chip views** (:func:`view`): a ``[step, num]`` pattern over a 2-D SBUF/PSUM tile
  (a 3-D copy or reduce in one instruction): an ``nl.arange`` expression in legacy, ``.ap`` in
  0.7 (a compile-time start: :func:`unroll` loops small counts in 0.7, keeping legacy's
  ``affine_range``).
- **Programs** (:func:`for_programs`): the legacy SPMD grid gives each instance its indices by
  ``nl.program_id``; 0.7 launches ``kernel[lnc]`` only, so the kernel loops (a compiled loop)
  over the flattened grid itself, the ``lnc`` cores sharing it by ``nl.program_id(0)``
  (:func:`spmd_core`: which core, when both split one instance's work instead).
- **One program per tile** (:func:`for_tile_programs`): a legacy 1-D grid of row tiles is,
  in 0.7, one program running :func:`for_tiles` over them. :func:`for_program_parts`: a
  legacy grid whose last axis holds programs of different kinds (e.g. work chunks, then
  tails) is, in 0.7, one :func:`for_programs` loop per kind.
- **Comparisons in ``scalar_tensor_tensor``**: 0.7 takes arithmetic operators only; a
  comparison ``op0`` becomes ``tensor_scalar`` + ``tensor_tensor`` there.
- **Selections** (:func:`keep_where`): ``dst = where(predicate, dst, value)`` is ``nl.where``
  in legacy (the instruction the legacy estimates were made with) and a predicated copy in
  0.7; :func:`repeat_last` reads a ``(P, F)`` predicate as ``(P, F, n)`` (a broadcast view).
- **Refusals** (:func:`refuse_in_nki`): a feature not ported to ``nki.*`` raises
  NotImplementedError naming it, never a silent fallback.
- **Moving diagonals** (:class:`DiagonalMask`): a causal diagonal that moves with loop
  indices, over a whole tile: legacy ``affine_select`` with the index in its offset; 0.7 a
  per-row bound table made once + ``range_select`` (NeuronCore-v3+).
- **Launch grids** (:func:`launch_grid`): the grid a kernel walked by :func:`for_programs` is
  launched on: the SPMD grid in legacy, ``(1,)`` in 0.7.
- **Random numbers** (:func:`random_seed`, :func:`dropout`): ``nl.random_seed`` /
  ``nisa.dropout`` in legacy, ``nisa.set_rng_seed`` / ``nisa.dropout`` (``dst`` form) in 0.7.

Not covered yet: ``par_dim`` block dimensions, loop-carried Python values.
"""
from __future__ import annotations

import contextlib
import math
import numbers

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
    is it under one namespace's ``nki.jit`` (made once per namespace). ``api``: None (the
    launcher traces it through the namespace ``NKI_FLASH_API`` selects) or the namespace a
    launch of this object must trace through (:meth:`on`)."""

    def __init__(self, func, api=None, jitted=None):
        self.func = func
        self.api = api
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__
        self._jitted = {} if jitted is None else jitted

    def on(self, api):
        """This kernel, launched through the namespace ``api`` ("nki" or "legacy")."""
        return Kernel(self.func, api, self._jitted)

    def __eq__(self, other):
        return (isinstance(other, Kernel) and (self.func, self.api) == (other.func, other.api))

    def __hash__(self):
        return hash((self.func, self.api))

    def __getitem__(self, grid):
        """``kernel[grid](...)``: a launch by a framework that calls the jitted kernel itself
        (torch-neuronx), traced through this kernel's namespace (:meth:`on`, else the one
        ``NKI_FLASH_API`` selects); 0.7 takes ``kernel[lnc]``, the int of a one-int grid."""
        def call(*args, **kwargs):
            ns = _binding.namespace(self.api or _binding.select_api())
            key = grid[0] if ns.api == "nki" and isinstance(grid, tuple) and len(grid) == 1 \
                else grid
            with tracing(ns):
                return self.jitted(ns)[key](*args, **kwargs)

        return call

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


# -- namespace facts ---------------------------------------------------------------------------

def api():
    """``"nki"`` or ``"legacy"``: the namespace being traced."""
    return current().api


def gen3():
    """True on NeuronCore-v3 and newer (trn2, trn3)."""
    ns = current()
    return ns.nisa.get_nc_version() >= ns.nisa.nc_version.gen3


def target():
    """The generation traced for, by its instance name: "trn1" (NeuronCore-v2), "trn2" (v3)
    or "trn3" (v4; nki.* only)."""
    return {2: "trn1", 3: "trn2", 4: "trn3"}[int(current().nisa.get_nc_version())]


def predicates():
    """True when instructions take loop-index predicates (``mask=``: legacy only)."""
    return current().api == "legacy"


def refuse_in_nki(feature):
    """Raise NotImplementedError when tracing through ``nki.*``: ``feature`` (a phrase naming
    it) is not ported to NKI 0.7 yet."""
    if current().api == "nki":
        raise NotImplementedError(
            f"{feature} is not available through the nki.* namespace (NKI 0.7) yet; run it "
            f"through the legacy namespace ({_binding.API_ENV_VAR}=legacy)")


# -- data movement ----------------------------------------------------------------------------

def dma_copy(dst, src, mask=None, legacy_isa=False, oob_skip=False):
    """``dst = src`` by DMA (HBM -> SBUF or SBUF -> HBM), cast to ``dst.dtype``. Legacy issues
    ``nl.load``/``nl.store`` (``nisa.dma_copy`` with ``legacy_isa`` or ``oob_skip``); ``mask``:
    see the module docstring. ``oob_skip``: an indirect side (:func:`rows`) skips the rows
    whose index is out of bounds (``oob_mode.skip``; else they are an error)."""
    ns = current()
    oob = dict(oob_mode=ns.nisa.oob_mode.skip) if oob_skip else {}
    if ns.api == "nki":
        ns.nisa.dma_copy(dst=dst, src=src, **oob)
    elif legacy_isa or oob_skip:
        ns.nisa.dma_copy(dst=dst, src=src, mask=mask, **oob)
    elif str(getattr(src, "buffer", "")).lower().endswith("hbm"):     # hbm, shared_hbm
        dst[...] = ns.nl.load(src, dtype=dst.dtype, mask=mask)
    else:
        ns.nl.store(dst, value=src, mask=mask)


def rows(t, idx, col=0, n=None):
    """Rows ``idx[p, col]`` of the 2-D HBM tensor ``t`` ``(R, F)``, one per partition p of the
    int32 SBUF index tile ``idx`` (its first ``n`` partitions; default all): a ``(P, F)``
    indirect access for :func:`dma_copy` (a gather as ``src``, a scatter as ``dst``;
    ``oob_skip`` skips rows outside ``[0, R)``). ``col`` an int or a loop index. Legacy: the
    index-tile subscript ``t[idx[i_p, col], i_f]``; 0.7: ``t.ap([[F, P], [1, F]],
    vector_offset=idx[:, col], indirect_dim=0)``."""
    ns = current()
    P, F = (idx.shape[0] if n is None else n), t.shape[1]
    if ns.api == "nki":
        return t.ap(pattern=[[F, P], [1, F]], offset=0,
                    vector_offset=idx[0:P, ns.nl.ds(col, 1)], indirect_dim=0)
    ar = ns.nl.arange
    return t[idx[ar(P)[:, None], col], ar(F)[None, :]]


def lead_rows(t, lead, idx, col=0):
    """Rows ``idx[p, col]`` of the 2-D slice ``t[*lead]`` of the HBM tensor ``t`` (``lead``:
    indices of its leading dims, ints or index expressions), one per partition of the int32
    SBUF index tile ``idx``: a ``(P, F)`` indirect access for :func:`dma_copy`. Legacy: the
    subscript ``t[*lead, idx[i_p, col], i_f]``, ``idx`` holding rows of the slice. 0.7: an
    indirect view takes no runtime leading index (one dynamic selection per view), so this is
    :func:`rows` of t's flattened ``(all rows, F)`` view and ``idx`` holds rows of that view:
    the slice's own rows plus its first row, :func:`lead_first_row`."""
    ns = current()
    if ns.api == "nki":
        flat = t.reshape((math.prod(t.shape[:-1]), t.shape[-1]))
        return rows(flat, idx, col)
    ar = ns.nl.arange
    return t[(*lead, idx[ar(idx.shape[0])[:, None], col], ar(t.shape[-1])[None, :])]


def lead_first_row(t, lead, offsets, partitions=128, ints=False):
    """The first row of the slice ``t[*lead]`` in the flattened view :func:`lead_rows` addresses
    under 0.7, as an fp32 ``[partitions, 1]`` column (each runtime index of ``lead`` read from
    ``offsets``, an :class:`OffsetColumns` of 0, 1, ...; exact below 2^24 rows), or with
    ``ints`` an int32 one (from an ``exact`` table: summed in int32, exact at any size). None
    in legacy, where nothing is issued: the subscript carries ``lead``."""
    ns = current()
    if ns.api != "nki":
        return None
    strides = [math.prod(t.shape[k + 1:-1]) for k, _ in enumerate(lead)]
    first = ns.nl.ndarray((partitions, 1), dtype=ns.nl.int32 if ints else ns.nl.float32,
                          buffer=ns.nl.sbuf)
    iota(first, [[1, 1]], runtime=list(zip(lead, strides)), offsets=offsets)
    return first


def flat_rows(t, first, n):
    """nki.* only: rows ``first .. first + n - 1`` of the HBM tensor ``t`` flattened to ``(all
    rows, F)`` (as :func:`lead_rows` indexes it), ``first`` a runtime row: an int32 ``[1, 1]``
    SBUF tile (data). A plain access for :func:`dma_copy` (0.7 ``NkiTensor.ap(scalar_offset=,
    indirect_dim=0)``; the 2.33 stub's ``fori_loop`` example addresses an HBM tensor at a
    register this way; a tile as the offset is the ``ap`` signature's "dynamic scalar index
    tensor", its DMA cost UNCONFIRMED: the simulator charges a plain DMA of the rows and
    makes it wait for the tile's writer). Unlike an indirect access its bytes are known, so
    DMAs at different rows are independent. Legacy NKI has no runtime scalar offset of an
    HBM access (NotImplementedError)."""
    ns = current()
    if ns.api != "nki":
        raise NotImplementedError("port.flat_rows: a runtime HBM row offset is an nki.* feature")
    F = t.shape[-1]
    flat = t.reshape((math.prod(t.shape[:-1]), F))
    return flat.ap(pattern=[[F, n], [1, F]], offset=0, scalar_offset=first, indirect_dim=0)


def row_blocks(t, lead, r0, rows, n, cols):
    """``[rows, n, cols]`` access of the HBM tensor ``t``: element ``[p, j, c]`` is
    ``t[*lead, r0 + j * rows + p, c]`` (``lead`` indices of the leading dims, ``r0`` an int or
    index expression): ``n`` blocks of ``rows`` consecutive rows, block j on the free axis."""
    ns = current()
    if ns.api == "nki":
        view = t[(*lead, ns.nl.ds(r0, n * rows), slice(0, cols))]
        return view.reshape_dim(0, (n, rows)).permute((1, 0, 2))
    ar = ns.nl.arange
    ip, it, ic = ar(rows)[:, None, None], ar(n)[None, :, None], ar(cols)[None, None, :]
    return t[(*lead, r0 + ip + rows * it, ic)]


def transposed_rows(t, lead, r0, n, c0, cols):
    """``[cols, n]`` access of the HBM tensor ``t``: element ``[c, j]`` is ``t[*lead, r0 + j, c0
    + c]`` (``r0`` an int or index expression): ``n`` rows from ``r0``, their columns ``c0 ..
    c0 + cols - 1`` on the partitions."""
    ns = current()
    if ns.api == "nki":
        return t[(*lead, ns.nl.ds(r0, n), slice(c0, c0 + cols))].permute((1, 0))
    ar = ns.nl.arange
    return t[(*lead, r0 + ar(n)[None, :], c0 + ar(cols)[:, None])]


def select_block(t, idx, width=None):
    """nki.* only: the view ``t[:, i, ...]`` of an SBUF tile at the runtime index ``i`` that
    the one-element int32 tile ``idx`` holds (NKI 0.7 ``NkiTensor.select`` with a tensor
    index; the 2.33 stub: "Dynamic on-chip: dim must not be 0", one dynamic select per view).
    With ``width`` the 2-D tile ``[p, n width]`` is read as ``[p, n, width]`` first
    (``reshape_dim``), so the view is the ``width`` columns from ``width i``. Legacy NKI has
    no tensor-valued SBUF offset (NotImplementedError). Cost: no document gives one; the
    simulator makes the instruction that reads the view wait for the index's writer, with no
    register load (UNCONFIRMED)."""
    ns = current()
    if ns.api != "nki":
        raise NotImplementedError("port.select_block: a runtime SBUF offset is an nki.* "
                                  "feature")
    if width is not None:
        t = t.reshape_dim(1, (t.shape[1] // width, width))
    return t.select(1, idx)


def view(t, p0, rows, c0, pattern):
    """A strided view of the 2-D on-chip tile ``t`` ``(P, F)``: element ``[p, x_1, ...]`` is
    ``t[p0 + p, c0 + sum_k step_k x_k]`` for ``p < rows`` and one ``[step, num]`` pair per free
    dim of the view (``step`` 0: the dim repeats one element, a broadcast source). Legacy: the
    ``nl.arange`` expression (``c0`` an int or an expression of loop indices); 0.7: ``t.ap``
    (``c0`` an int: use :func:`unroll` for the loops it depends on)."""
    ns = current()
    if ns.api == "nki":
        F = t.shape[1]
        return t.ap(pattern=[[F, rows]] + [[int(s), int(n)] for s, n in pattern],
                    offset=int(p0) * F + int(c0))
    ar = ns.nl.arange
    nd = len(pattern) + 1
    free = None
    for k, (step, num) in enumerate(pattern, start=1):
        ax = ar(1 if step == 0 else num)[tuple(slice(None) if j == k else None
                                               for j in tiles.unrolled(nd))]
        term = ax if step in (0, 1) else ax * step
        free = term if free is None else free + term
    ip = ar(rows)[(slice(None),) + (None,) * (nd - 1)]
    return t[p0 + ip, c0 + free]


def dynamic_block(t, idx, parts):
    """Column ranges ``parts`` (``(c0, width)`` pairs) of ``t[:, idx, :]``, the 3-D on-chip
    tile ``t`` ``[rows, n, W]`` at a runtime block ``idx``, an int32 ``[1, 1]`` SBUF tile (data,
    e.g. read from a table): a list of ``[rows, width]``. 0.7: views, one ``t.ap(...,
    offset=c0, scalar_offset=idx, indirect_dim=1)`` each (not sliced further: an indirect
    view's indirection is not re-sliced), no instruction (the ``NkiTensor.ap`` stub shows such
    an SBUF view; its use as a compute operand is UNCONFIRMED). Legacy, which reads SBUF at data
    offsets only through the dynamic copies (neuronx-cc 2.22+; the index on a middle free dim
    is UNCONFIRMED, the documented example indexes the last): one copy of the block into a new
    tile, ``nisa.tensor_copy_dynamic_src`` (VectorE, ``DYNAMIC_COPY_MIN_II`` cycles at least in
    the simulator), sliced."""
    ns = current()
    rows, n, w = t.shape
    if ns.api == "nki":
        return [t.ap(pattern=[[n * w, rows], [1, width]], offset=c0, scalar_offset=idx,
                     indirect_dim=1) for c0, width in parts]
    ar = ns.nl.arange
    out = ns.nl.ndarray((rows, w), dtype=t.dtype, buffer=ns.nl.sbuf)
    out[...] = ns.nisa.tensor_copy_dynamic_src(t[ar(rows)[:, None], idx[0, 0], ar(w)[None, :]])
    return [out[:, c0:c0 + width] for c0, width in parts]


def dynamic_block_add(t, idx, cur, data):
    """``t[:, idx, 0:w] += data`` (``w`` the width of ``data``) where ``cur`` is that range as
    :func:`dynamic_block` gave it: 0.7 adds in place through the view (VectorE); legacy adds
    to the copy and writes the sum back, ``nisa.tensor_copy_dynamic_dst``."""
    ns = current()
    rows, w = data.shape
    if ns.api == "nki":
        tensor_tensor(cur, cur, data, ns.nl.add)
        return
    total = ns.nl.ndarray((rows, w), dtype=t.dtype, buffer=ns.nl.sbuf)
    tensor_tensor(total, cur, data, ns.nl.add)
    ar = ns.nl.arange
    ns.nisa.tensor_copy_dynamic_dst(dst=t[ar(rows)[:, None], idx[0, 0], ar(w)[None, :]],
                                    src=total)


def dma_transpose(dst, src, mask=None):
    """``dst = src^T`` (2-D, SBUF -> SBUF) on the DMA engines (gen3+)."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.dma_transpose(dst=dst, src=src)
    else:
        dst[...] = ns.nisa.dma_transpose(src, mask=mask)


def dma_transpose_blocks(dst, src, n, width, mask=None):
    """``dst[0:width, q r:(q + 1) r] = src[0:r, q width:(q + 1) width]^T`` for the ``n``
    blocks ``q`` of a 2-D SBUF ``src`` of ``r`` rows (SBUF -> SBUF, DMA engines, gen3+).

    0.7: one 3-D ``nisa.dma_transpose`` of ``reshape_dim`` views, ``(r, n, width) -> (width,
    n, r)`` (the stub's 3-D permutation), so the per-instruction DMA cost is paid once for the
    ``n`` blocks, as nki-library's ``attention_cte`` batches its P transposes (one 4-D
    ``dma_transpose`` per 512 keys). Legacy: one 2-D transpose per block (its SBUF tiles have
    no views to reshape)."""
    ns = current()
    r = src.shape[0]
    if ns.api == "nki":
        ns.nisa.dma_transpose(dst=dst[0:width, 0:n * r].reshape_dim(1, (n, r)),
                              src=src[0:r, 0:n * width].reshape_dim(1, (n, width)))
        return
    for q in tiles.unrolled(n):
        dst[0:width, q * r:(q + 1) * r] = ns.nisa.dma_transpose(
            src[0:r, q * width:(q + 1) * width], mask=mask)


# -- compiled loops ---------------------------------------------------------------------------

def _fori_loop(ns, lo, hi, body):
    """0.7's ``nl.fori_loop(lo, hi, ...)`` of ``body(i)`` (its return value dropped: a
    fori_loop body returns None), named after ``body``."""
    def step(i):
        body(i)

    step.__name__ = getattr(body, "__name__", "body")
    ns.nl.fori_loop(lo, hi, step)


def loop(n, body, carried=False, start=0):
    """``body(i)`` for ``i`` in ``[start, n)`` as a compiled loop (see the module docstring);
    ``carried`` says an iteration reads what the previous one wrote (legacy needs
    ``sequential_range`` for that; 0.7's ``fori_loop`` is sequential by definition)."""
    ns = current()
    if ns.api == "nki":
        _fori_loop(ns, start, n, body)
        return
    rng = ns.nl.sequential_range if carried else ns.nl.affine_range
    for i in (rng(start, n) if start else rng(n)):
        body(i)


def loop_between(lo, hi, body):
    """``body(i)`` for ``i`` in ``[lo, hi)`` as a sequential compiled loop whose bounds may be
    runtime registers (:func:`register`): NKI 0.7's ``nl.fori_loop`` takes ``VirtualRegister``
    bounds (the 2.33 stub; a trip count <= 0 runs no iteration). Legacy NKI has no runtime trip
    count (``dynamic_range`` is not in neuronx-cc's ``neuronxcc.nki``), so there ``lo`` and
    ``hi`` must be ints (a register is refused)."""
    ns = current()
    if ns.api == "nki":
        _fori_loop(ns, lo, hi, body)
        return
    if not all(isinstance(b, numbers.Integral) for b in (lo, hi)):
        raise NotImplementedError("port.loop_between: legacy NKI has no runtime trip count "
                                  "(a register bound is an nki.* feature)")
    for i in ns.nl.sequential_range(int(lo), int(hi)):
        body(i)


def register(tile):
    """nki.* only: a ``VirtualRegister`` holding the one int32 element of the SBUF ``tile``
    (``nisa.register_alloc`` + ``nisa.register_load``, the 2.33 stub), for a runtime loop
    bound (:func:`loop_between`)."""
    ns = current()
    if ns.api != "nki":
        raise NotImplementedError("port.register: virtual registers are an nki.* feature")
    reg = ns.nisa.register_alloc()
    ns.nisa.register_load(reg, tile)
    return reg


def unroll(n, body):
    """``body(i)`` for ``i`` in ``[0, n)``, ``n`` a small compile-time count (a handful of
    tiles or heads, not growing with a sequence length). Legacy: ``nl.affine_range`` (the loop
    the legacy kernels wrote; ``i`` an index for affine expressions); 0.7: a Python loop,
    unrolled at tracing, so ``i`` is an int and the access patterns built from it are static
    (:func:`view`)."""
    ns = current()
    if ns.api == "nki":
        for i in tiles.unrolled(n):
            body(i)
        return
    for i in ns.nl.affine_range(n):
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


def for_programs(dims, body, share=True):
    """``body(*index)`` for the grid instances ``index`` of ``dims`` (static ints, e.g. ``(B,
    Hkv)``) this program serves. Legacy: the kernel is launched on an SPMD grid whose first axes
    are ``dims`` (:func:`launch_grid`, or a kernel's own grid with more axes); ``body`` runs once
    with ``nl.program_id(0), ...``. 0.7: the kernel is launched ``kernel[lnc]``; ``body`` runs in
    a compiled loop over the flattened ``dims`` (the index unflattened row-major with ``//`` and
    ``%`` of the runtime loop index), the ``lnc`` cores taking halves of it (``share``; an odd
    count: the middle instance is run by both, which write identical results) or, without
    ``share``, each core all of it."""
    ns = current()
    if ns.api == "legacy":
        body(*(ns.nl.program_id(a) for a, _ in enumerate(dims)))
        return
    total = math.prod(dims)
    strides = [math.prod(dims[k + 1:]) for k, _ in enumerate(dims)]
    cores = int(ns.nl.num_programs(0)) if share else 1
    per = -(-total // cores)
    first = 0 if cores == 1 else ns.nl.program_id(0) * (total - per)

    def instance(i):
        flat = first + i
        body(*(flat // s if k == 0 else flat // s % n
               for k, (s, n) in enumerate(zip(strides, dims))))

    instance.__name__ = getattr(body, "__name__", "instance")
    loop(per, instance, carried=True)


def for_program_parts(lead, parts, order=None):
    """The programs of a grid ``(*lead, sum of the counts)`` whose last axis is cut into
    consecutive parts, ``parts`` a list of ``(count, body)``: instance ``(*index, start + i)``
    of a part starting at ``start`` runs ``body(*index, i)``. Legacy: the SPMD grid; each
    program runs the body of its part, chosen while tracing from its program id (how the
    legacy kernels were written). 0.7 (``kernel[lnc]``): one :func:`for_programs` loop per part
    over ``(*lead, count)``, the cores sharing each, in the order ``order`` (indices into
    ``parts``; default as listed)."""
    ns = current()
    if ns.api == "nki":
        for k in (tiles.unrolled(len(parts)) if order is None else order):
            count, body = parts[k]
            if count:
                for_programs(tuple(lead) + (count,), body)
        return
    ids = [ns.nl.program_id(a) for a in tiles.unrolled(len(lead) + 1)]
    start = 0
    for count, body in parts:
        if start <= ids[-1] < start + count:
            body(*ids[:-1], ids[-1] - start)
            return
        start += count


def for_tile_programs(total, size, body):
    """``body(i, n)`` for the tiles ``i * size ... i * size + n`` covering ``[0, total)``, one
    per program of a 1-D grid. Legacy: the kernel is launched on the grid ``(ceil(total /
    size),)`` and ``body`` runs once, with ``i = nl.program_id(0)`` (``n`` the tail's size in
    the last program). 0.7 (``kernel[1]``): :func:`for_tiles` over all of them in one program."""
    ns = current()
    if ns.api == "nki":
        for_tiles(total, size, body)
        return
    i = ns.nl.program_id(0)
    n_full, tail = divmod(total, size)
    if tail and i == n_full:
        body(n_full, tail)
    else:
        body(i, size)


def spmd_core():
    """Which of the two NeuronCores of an LNC=2 launch this is, when both run the same grid
    instance and split its work: ``nl.program_id(2)`` in legacy (the grid ``(B, Hkv,
    nl.nc(2))``), ``nl.program_id(0)`` in 0.7 (``kernel[2]``)."""
    ns = current()
    return ns.nl.program_id(0 if ns.api == "nki" else 2)


# -- compute instructions: dst first, result dtype = dst.dtype ---------------------------------

def _issue(name, dst, legacy_extra=None, mask=None, **operands):
    ns = current()
    fn = getattr(ns.nisa, name)
    if ns.api == "nki":
        fn(dst=dst, **operands)
    else:
        extra = dict(legacy_extra or {})
        if mask is not None:
            extra["mask"] = mask
        dst[...] = fn(**operands, **extra, dtype=dst.dtype)


def _engine(ns, name):
    """The engine called ``name`` ("vector", "scalar", "gpsimd") in ``ns``."""
    return getattr(ns.nisa.engine, name) if ns.api == "nki" else getattr(ns.nisa, name + "_engine")


def _engine_kw(name):
    return {} if name is None else dict(engine=_engine(current(), name))


def tensor_copy(dst, src, engine=None, mask=None):
    """``dst = src`` (SBUF/PSUM -> SBUF) on ``engine`` ("vector", "scalar", "gpsimd"; None lets
    the compiler choose)."""
    _issue("tensor_copy", dst, mask=mask, src=src, **_engine_kw(engine))


def memset(dst, value, engine=None):
    """Fill ``dst`` with the compile-time constant ``value`` (``engine``: "vector" or
    "gpsimd")."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.memset(dst=dst, value=value, **_engine_kw(engine))
    else:
        dst[...] = ns.nisa.memset(dst.shape, value, dtype=dst.dtype, **_engine_kw(engine))


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False):
    """``dst = src`` (a tile or a float) where ``predicate`` (uint8, dst's layout) is non-zero
    (zero with ``reverse_pred``), dst unchanged elsewhere (VectorE)."""
    current().nisa.tensor_copy_predicated(dst=dst, src=src, predicate=predicate,
                                          reverse_pred=reverse_pred)


def keep_where(dst, predicate, value):
    """``dst`` unchanged where ``predicate`` (uint8, dst's layout, or a :func:`repeat_last`
    view) is non-zero, the float ``value`` elsewhere (VectorE): ``nl.where(predicate, dst,
    value)`` in legacy, a predicated copy of ``value`` in 0.7."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.tensor_copy_predicated(dst=dst, src=float(value), predicate=predicate,
                                       reverse_pred=True)
    else:
        dst[...] = ns.nl.where(predicate, dst, value, dtype=dst.dtype)


def repeat_last(t, size):
    """The 2-D tile ``t`` ``(P, F)`` read as ``(P, F, size)``, each element repeated ``size``
    times on a new last axis (no copy: a broadcast view in 0.7; in legacy a ``(P, F, 1)``
    access the instruction broadcasts)."""
    ns = current()
    if ns.api == "nki":
        return t.expand_dim(2).broadcast(2, size)
    ar = ns.nl.arange
    return t[ar(t.shape[0])[:, None, None], ar(t.shape[1])[None, :, None]]


# -- affine patterns ----------------------------------------------------------------------------

_CMP_LEGACY = {"equal": "__eq__", "not_equal": "__ne__", "less": "__lt__",
               "less_equal": "__le__", "greater": "__gt__", "greater_equal": "__ge__"}


def _cmp_name(op):
    name = getattr(op, "__name__", str(op))
    if name not in _CMP_LEGACY:
        raise ValueError(f"port: cmp_op must be a comparison (nl.equal, nl.less, ...), got {op!r}")
    return name


def _affine_expr(ns, dst, pattern, offset, channel_multiplier):
    """The legacy index expression of ``offset + p * channel_multiplier + sum step_k x_k`` over
    ``dst``'s partitions and its free dims (one ``[step, num]`` pair per free dim)."""
    if len(pattern) != len(dst.shape) - 1:
        raise ValueError(f"port: the pattern needs one [step, num] pair per free dim of dst "
                         f"{tuple(dst.shape)}, got {pattern}")

    def axis(n, k):
        return ns.nl.arange(n)[tuple(slice(None) if j == k else None
                                     for j, _ in enumerate(dst.shape))]

    expr = axis(dst.shape[0], 0) * channel_multiplier + offset
    for k, (step, num) in enumerate(pattern, start=1):
        expr = expr + axis(num, k) * step
    return expr


class OffsetColumns:
    """Runtime offsets as data, for 0.7 (whose ``iota``/``affine_select`` offsets are
    compile-time): an fp32 ``[128, n]`` SBUF table, column c holding ``lo + c * step`` on every
    partition, built by one iota at the kernel's start; :meth:`col` reads the column of a
    runtime value (an index expression, a multiple of ``step`` in ``[lo, lo + n step)``) at a
    runtime position. Legacy reads offsets from the index expression itself: no table.

    fp32 combines runtime values exactly while every partial sum stays below 2^24. ``exact``
    (for linear forms that may reach 2^24 or more: flat row numbers of huge tensors, unit
    numbers): the same values also as an int32 table, from which an integer :func:`iota`
    destination gets its runtime part in int32 arithmetic (GpSimd ``tensor_tensor``, whose
    int32 add and multiply are exact, ``nki.isa.tensor_tensor``; exact to 2^31)."""

    def __init__(self, lo, n, step, exact=False):
        ns = current()
        self.lo, self.n, self.step = int(lo), int(n), int(step)
        self.table = self.ints = None
        if ns.api == "nki":
            self.table = ns.nl.ndarray((128, self.n), dtype=ns.nl.float32, buffer=ns.nl.sbuf)
            ns.nisa.iota(dst=self.table, pattern=[[self.step, self.n]], offset=self.lo)
            if exact:
                self.ints = ns.nl.ndarray((128, self.n), dtype=ns.nl.int32, buffer=ns.nl.sbuf)
                ns.nisa.iota(dst=self.ints, pattern=[[self.step, self.n]], offset=self.lo)

    def col(self, value, rows=128, ints=False):
        """``[rows, 1]``: ``value`` on every partition (fp32, or int32 with ``ints`` from an
        ``exact`` table)."""
        table = self.ints if ints else self.table
        return table[0:rows, current().nl.ds((value - self.lo) // self.step, 1)]


def _terms(runtime):
    """``runtime`` as ``[(index expression, int coefficient), ...]``."""
    if runtime is None:
        return []
    if isinstance(runtime, list):
        return [(e, int(c)) for e, c in runtime]
    return [(runtime, 1)]


def _fold_static(offset, runtime):
    """``(offset, terms)``: compile-time terms of ``runtime`` folded into the offset."""
    terms = []
    for e, c in _terms(runtime):
        if isinstance(e, numbers.Integral):
            offset = int(offset) + c * int(e)
        else:
            terms.append((e, c))
    return offset, terms


def _legacy_offset(offset, runtime):
    """The legacy index expression ``offset + sum c e`` of a runtime offset."""
    for e, c in _terms(runtime):
        offset = offset + (e if c == 1 else e * c)
    return offset


def _runtime_column(ns, terms, offsets, rows):
    """0.7: ``[rows, 1]`` fp32 holding ``sum c e`` over ``terms``, each ``e`` read from the
    :class:`OffsetColumns` ``offsets`` (one term: the table's column itself; more: VectorE
    multiply-adds, exact while the values stay below 2^24)."""
    (e0, c0), rest = terms[0], terms[1:]
    if c0 == 1 and not rest:
        return offsets.col(e0, rows)
    acc = ns.nl.ndarray((rows, 1), dtype=ns.nl.float32, buffer=ns.nl.sbuf)
    ns.nisa.tensor_scalar(dst=acc, data=offsets.col(e0, rows), op0=ns.nl.multiply,
                          operand0=float(c0))
    for e, c in rest:
        ns.nisa.tensor_scalar(dst=acc, data=offsets.col(e, rows), op0=ns.nl.multiply,
                              operand0=float(c), op1=ns.nl.add, operand1=acc)
    return acc


def _exact_column(ns, terms, offsets, rows):
    """0.7: int32 ``[rows, 1]`` holding ``sum c e`` over ``terms`` in int32 arithmetic (GpSimd
    ``tensor_tensor``: exact), each ``e`` read from the ``exact`` table of ``offsets``, each
    coefficient other than 1 an int32 iota (compile-time)."""
    nl, nisa = ns.nl, ns.nisa
    acc = None
    for e, c in terms:
        term = offsets.col(e, rows, ints=True)
        if c != 1:
            coef = nl.ndarray((rows, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.iota(dst=coef, pattern=[[0, 1]], offset=int(c))
            prod = nl.ndarray((rows, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=prod, data1=term, data2=coef, op=nl.multiply,
                               engine=nisa.engine.gpsimd)
            term = prod
        if acc is None:
            acc = term
            continue
        total = nl.ndarray((rows, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=total, data1=acc, data2=term, op=nl.add,
                           engine=nisa.engine.gpsimd)
        acc = total
    return acc


def _runtime_pattern(ns, dst, pattern, offset, channel_multiplier, terms, offsets, cmp_op):
    """0.7: ``cmp_op(pattern value + runtime, 0)`` (uint8), or with ``cmp_op`` None the fp32
    value itself, into a new tile of dst's shape."""
    nl, nisa = ns.nl, ns.nisa
    val = nl.ndarray(tuple(dst.shape), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=val, pattern=pattern, offset=offset, channel_multiplier=channel_multiplier)
    col = _runtime_column(ns, terms, offsets, dst.shape[0])
    if cmp_op is None:
        return val, col
    pred = nl.ndarray(tuple(dst.shape), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=pred, data=val, op0=nl.add, operand0=col, op1=cmp_op, operand1=0.0)
    return pred, col


def iota(dst, pattern, offset=0, channel_multiplier=0, runtime=None, offsets=None, mask=None):
    """``dst[p, x...] = offset + runtime + p * channel_multiplier + sum_k step_k x_k`` (GpSimd;
    ``pattern`` one ``[step, num]`` pair per free dim of dst; ``offset`` a compile-time int;
    ``runtime`` None, an index expression or a linear form ``[(expression, coefficient),
    ...]``, which 0.7 reads from ``offsets``, an :class:`OffsetColumns`: combined in fp32,
    or for an int32 ``dst`` and an ``exact`` table in int32)."""
    ns = current()
    if ns.api == "legacy":
        expr = _affine_expr(ns, dst, pattern, _legacy_offset(offset, runtime),
                            channel_multiplier)
        extra = {} if mask is None else dict(mask=mask)
        dst[...] = ns.nisa.iota(expr, dtype=dst.dtype, **extra)
        return
    pattern = [list(map(int, pv)) for pv in pattern]
    offset, terms = _fold_static(offset, runtime)
    if not terms:
        ns.nisa.iota(dst=dst, pattern=pattern, offset=int(offset),
                     channel_multiplier=int(channel_multiplier))
        return
    if offsets.ints is not None and dst.dtype in (ns.nl.int32, ns.nl.uint32):
        # integer positions from an exact table: the static part by the iota's own int32
        # arithmetic, the runtime part and the sum in int32 on GpSimd
        val = ns.nl.ndarray(tuple(dst.shape), dtype=ns.nl.int32, buffer=ns.nl.sbuf)
        ns.nisa.iota(dst=val, pattern=pattern, offset=int(offset),
                     channel_multiplier=int(channel_multiplier))
        add_int_column(dst, val, _exact_column(ns, terms, offsets, dst.shape[0]))
        return
    val, col = _runtime_pattern(ns, dst, pattern, int(offset), int(channel_multiplier), terms,
                                offsets, None)
    ns.nisa.tensor_scalar(dst=dst, data=val, op0=ns.nl.add, operand0=col)


def add_int_column(dst, data, col):
    """0.7: ``dst = data + col`` for int32 ``data`` and an int32 ``[rows, 1]`` ``col``
    broadcast over dst's free dims (a view: no copy), one GpSimd ``tensor_tensor`` (int32 add:
    exact, ``nki.isa.tensor_tensor``). For the integer sums of an ``exact``
    :class:`OffsetColumns` table, which only 0.7 builds."""
    ns = current()
    for d, size in enumerate(dst.shape[1:], start=1):
        col = (col if d == 1 else col.expand_dim(d)).broadcast(d, size)
    ns.nisa.tensor_tensor(dst=dst, data1=data, data2=col, op=ns.nl.add,
                          engine=ns.nisa.engine.gpsimd)


def iota_column(dst, pattern, offset=0, channel_multiplier=0, runtime=None, offsets=None,
                mask=None):
    """:func:`iota` whose runtime part the caller adds in an instruction it issues anyway (a
    ``tensor_scalar`` operand, an ``activation`` bias) instead of one more VectorE pass over
    ``dst``. Returns None when ``dst`` holds the whole value (legacy, whose index expression
    carries the runtime part; no runtime terms), else under 0.7 the fp32 ``[rows, 1]`` column
    of the runtime part, ``dst`` holding the compile-time part (one GpSimd iota)."""
    ns = current()
    if ns.api == "nki":
        static, terms = _fold_static(offset, runtime)
        if terms:
            ns.nisa.iota(dst=dst, pattern=[list(map(int, pv)) for pv in pattern],
                         offset=int(static), channel_multiplier=int(channel_multiplier))
            return _runtime_column(ns, terms, offsets, dst.shape[0])
    iota(dst, pattern, offset=offset, channel_multiplier=channel_multiplier, runtime=runtime,
         offsets=offsets, mask=mask)
    return None


def iota_compare(dst, pattern, cmp_op, operand, offset=0, channel_multiplier=0, runtime=None,
                 offsets=None):
    """``dst = cmp_op(offset + runtime + p * channel_multiplier + sum_k step_k x_k, operand)``
    (1.0 or 0.0 in ``dst.dtype``; ``operand`` a ``(P, 1)`` fp32 tile or a float; the other
    arguments as :func:`iota`). The positions go through an fp32 tile allocated here. Legacy:
    a GpSimd iota of the index expression and a VectorE compare; 0.7: the iota of the
    compile-time part and one VectorE ``tensor_scalar`` that adds the runtime column (read
    from ``offsets``) and compares, as many instructions as legacy."""
    ns = current()
    pos = ns.nl.ndarray(tuple(dst.shape), dtype=ns.nl.float32, buffer=ns.nl.sbuf)
    if ns.api == "nki":
        static, terms = _fold_static(offset, runtime)
        if terms:
            ns.nisa.iota(dst=pos, pattern=[list(map(int, pv)) for pv in pattern],
                         offset=int(static), channel_multiplier=int(channel_multiplier))
            col = _runtime_column(ns, terms, offsets, dst.shape[0])
            ns.nisa.tensor_scalar(dst=dst, data=pos, op0=ns.nl.add, operand0=col, op1=cmp_op,
                                  operand1=operand)
            return
    iota(pos, pattern, offset=offset, channel_multiplier=channel_multiplier, runtime=runtime,
         offsets=offsets)
    tensor_scalar(dst, pos, cmp_op, operand)


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op,
                  offset=0, runtime=None, offsets=None, mask=None):
    """``dst = on_true_tile`` where ``cmp_op(offset + runtime + p * channel_multiplier + sum_k
    step_k x_k, 0)`` holds, else the float ``on_false_value`` (arguments as :func:`iota`).
    GpSimd ``affine_select``; with a ``runtime`` offset under 0.7, an iota, a VectorE compare
    and a predicated copy."""
    ns = current()
    if ns.api == "legacy":
        expr = _affine_expr(ns, dst, pattern, _legacy_offset(offset, runtime),
                            channel_multiplier)
        pred = getattr(expr, _CMP_LEGACY[_cmp_name(cmp_op)])(0)
        extra = {} if mask is None else dict(mask=mask)
        dst[...] = ns.nisa.affine_select(pred, on_true_tile, on_false_value, dtype=dst.dtype,
                                         **extra)
        return
    pattern = [list(map(int, pv)) for pv in pattern]
    offset, terms = _fold_static(offset, runtime)
    if not terms:
        ns.nisa.affine_select(dst=dst, pattern=pattern, channel_multiplier=int(channel_multiplier),
                              on_true_tile=on_true_tile, on_false_value=float(on_false_value),
                              cmp_op=cmp_op, offset=int(offset))
        return
    pred, _ = _runtime_pattern(ns, dst, pattern, int(offset), int(channel_multiplier), terms,
                               offsets, cmp_op)
    if on_true_tile is not dst:
        ns.nisa.tensor_copy(dst=dst, src=on_true_tile)
    ns.nisa.tensor_copy_predicated(dst=dst, src=float(on_false_value), predicate=pred,
                                   reverse_pred=True)


def band_select_max(dst, data, sides, runtime=None, offsets=None, neg_max=None):
    """0.7 only (NeuronCore-v3+): ``dst = data`` where every side ``(bound, cmp_op)`` of a band
    holds for the key-minus-row distance, ``cmp_op(j - p + runtime + bound, 0)`` with ``cmp_op``
    ``nl.less_equal`` or ``nl.greater_equal`` (one or two sides; ``j`` the free index, ``p``
    the partition), fp32.min elsewhere; and ``neg_max = -(row max of dst)``, ``[P, 1]``.

    One VectorE ``range_select`` reading ``data`` (PSUM or SBUF) with its max reduction, in
    place of :func:`affine_select`'s iota, compare and predicated copy per side and a separate
    max: the per-row bounds ``p - runtime - bound`` are ``[P, 1]`` columns (a GpSimd iota of
    the partitions, minus the runtime offset read from ``offsets`` on VectorE), as AWS's NKI
    0.7 ``attention_cte`` masks its diagonal tiles (``range_select`` with ``reduce_res``)."""
    ns = current()
    if ns.api != "nki":
        raise RuntimeError("port.band_select_max: NKI 0.7 only (legacy: affine_select)")
    nl_, nisa = ns.nl, ns.nisa
    rows = data.shape[0]
    bounds = []
    for bound, cmp_op in sides:
        offset, terms = _fold_static(bound, runtime)
        col = nl_.ndarray((rows, 1), dtype=nl_.float32, buffer=nl_.sbuf)
        nisa.iota(dst=col, pattern=[[0, 1]], offset=-int(offset), channel_multiplier=1)
        if terms:
            nisa.tensor_scalar(dst=col, data=col, op0=nl_.subtract,
                               operand0=_runtime_column(ns, terms, offsets, rows))
        bounds.append((col, cmp_op))
    if len(bounds) == 1:
        bounds.append(bounds[0])
    range_select_max(dst, data, bounds, neg_max)


def range_select_max(dst, data, bounds, neg_max):
    """0.7 only (NeuronCore-v3+): ``dst = data`` where ``cmp_op(j, bound)`` holds for both
    ``(bound, cmp_op)`` of ``bounds`` (``bound`` fp32 ``[P, 1]`` columns, ``j`` the free
    index), fp32.min elsewhere, and ``neg_max = -(row max of dst)``: one VectorE
    ``range_select`` with its max reduction (and a GpSimd negation)."""
    ns = current()
    if ns.api != "nki":
        raise RuntimeError("port.range_select_max: NKI 0.7 only")
    nl_, nisa = ns.nl, ns.nisa
    (b0, c0), (b1, c1) = bounds
    mx = nl_.ndarray((data.shape[0], 1), dtype=nl_.float32, buffer=nl_.sbuf)
    nisa.range_select(dst=dst, on_true_tile=data, comp_op0=c0, comp_op1=c1, bound0=b0,
                      bound1=b1, reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=mx,
                      reduce_op=nl_.maximum)
    nisa.tensor_scalar(dst=neg_max, data=mx, op0=nl_.multiply, operand0=-1.0,
                       engine=_engine(ns, "gpsimd"))


# -- TensorE: results into PSUM ----------------------------------------------------------------

def nc_matmul(dst, stationary, moving, accumulate=False, mask=None):
    """``dst = stationary^T @ moving`` (``accumulate=False``) or ``dst += ...`` (``True``) on
    TensorE, ``dst`` a PSUM tile (fp32). 0.7's ``nc_matmul`` stub ("Accumulation mode"): ``True``
    is valid only where an ``accumulate=False`` matmul opened the group (:func:`open_group`);
    ``None`` lets the compiler infer the flag (first write overwrites, later ones accumulate),
    the form for a PSUM tile zero-filled by ``nl.zeros``. Legacy has no flag: ``True`` and
    ``None`` are ``+=`` (onto ``nl.zeros``, legacy's idiom)."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.nc_matmul(dst=dst, stationary=stationary, moving=moving,
                          accumulate=None if accumulate is None else bool(accumulate))
        return
    extra = {} if mask is None else dict(mask=mask)
    if accumulate is None or accumulate:
        dst[...] += ns.nisa.nc_matmul(stationary, moving, **extra)
    else:
        dst[...] = ns.nisa.nc_matmul(stationary, moving, **extra)


def group_alloc():
    """The allocator of a PSUM tile :func:`open_group` opens: ``nl.ndarray`` in 0.7 (the
    opening matmul writes every element, so a zero fill would only be overwritten: one
    instruction less), ``nl.zeros`` in legacy (its ``+=`` starts from the fill). Call it at
    the tile's own statement, ``port.group_alloc()((rows, cols), dtype=nl.float32,
    buffer=nl.psum)`` (each allocation statement is one tile, see the module docstring)."""
    ns = current()
    return ns.nl.ndarray if ns.api == "nki" else ns.nl.zeros


def group_zero_row(cols: int):
    """The zero row :func:`open_group` opens groups with: 0.7 a bf16 ``[1, cols]`` SBUF row
    of zeros, filled once (allocate it once per kernel instance, outside the loops that open
    groups); legacy None (nothing to issue)."""
    ns = current()
    if ns.api != "nki":
        return None
    return ns.nl.zeros((1, cols), dtype=ns.nl.bfloat16, buffer=ns.nl.sbuf)


def open_group(psum, zero):
    """Open ``psum`` (a 2-D fp32 PSUM tile of :func:`group_alloc`) as an accumulation group
    of zeros that ``nc_matmul(..., accumulate=True)`` may add onto. 0.7: an
    ``accumulate=False`` matmul of the one-partition zero row ``zero`` (:func:`group_zero_row`,
    at least as many columns as ``psum`` has rows and columns) over the whole tile (the
    ``nc_matmul`` stub: ``True`` is "Only valid after the PSUM location has been initialized
    by a matmul with accumulate=False"; accumulating onto a memset value is undefined on
    NeuronCore-v2/v3). Legacy: nothing (``nl.zeros`` then ``+=`` is its idiom)."""
    ns = current()
    if ns.api != "nki":
        return
    rows, cols = psum.shape
    ns.nisa.nc_matmul(dst=psum, stationary=zero[0:1, 0:rows], moving=zero[0:1, 0:cols],
                      accumulate=False)


def transpose_dtype(dtype, legacy=None):
    """dtype of the PSUM tile a TensorE :func:`nc_transpose` of ``dtype`` data writes: the same
    dtype in 0.7 (``nisa.nc_transpose``: "the output must have the input's dtype"); in legacy
    ``legacy`` (default fp32: what this package's legacy kernels allocated; their estimates were
    made with it). Allocate the tile at its own statement with this dtype."""
    if current().api == "nki":
        return dtype
    return current().nl.float32 if legacy is None else legacy


def nc_transpose(dst, data, mask=None):
    """``dst = data^T`` (partitions <-> free) on TensorE: ``data`` in SBUF (<= 128 x 128),
    ``dst`` in PSUM of dtype :func:`transpose_dtype` ``(data.dtype)``."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.nc_transpose(dst=dst, data=data)
    else:
        dst[...] = ns.nisa.nc_transpose(data, **({} if mask is None else dict(mask=mask)))


def tensor_tensor(dst, data1, data2, op, engine=None, mask=None):
    _issue("tensor_tensor", dst, mask=mask, data1=data1, data2=data2, op=op, **_engine_kw(engine))


def tensor_scalar(dst, data, op0, operand0, op1=None, operand1=None, reverse0=False,
                  engine=None, mask=None):
    extra = dict(reverse0=True) if reverse0 else {}
    _issue("tensor_scalar", dst, mask=mask, data=data, op0=op0, operand0=operand0, op1=op1,
           operand1=operand1, **extra, **_engine_kw(engine))


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, mask=None):
    """``dst = (data op0 operand0) op1 operand1`` (VectorE). 0.7 takes arithmetic operators
    only (``nisa.scalar_tensor_tensor``: "Both op0 and op1 must be arithmetic operators"): a
    comparison ``op0`` is issued there as a ``tensor_scalar`` into an fp32 tile and a
    ``tensor_tensor``."""
    ns = current()
    if ns.api == "nki" and getattr(op0, "__name__", str(op0)) in _CMP_LEGACY:
        first = ns.nl.ndarray(tuple(data.shape), dtype=ns.nl.float32, buffer=ns.nl.sbuf)
        ns.nisa.tensor_scalar(dst=first, data=data, op0=op0, operand0=operand0)
        ns.nisa.tensor_tensor(dst=dst, data1=first, data2=operand1, op=op1)
        return
    _issue("scalar_tensor_tensor", dst, mask=mask, data=data, op0=op0, operand0=operand0,
           op1=op1, operand1=operand1)


def tensor_reduce(dst, op, data, axis, negate=False, mask=None):
    """Reduce ``data`` over ``axis`` (free axes) into ``dst`` of shape ``(P, 1)``, or of data's
    shape without ``axis`` when dst has fewer dims (negated with ``negate``)."""
    extra = dict(negate=True) if negate else {}
    # a dst with fewer dims than data (a 3-D view reduced on its last axis) drops the axis
    keep = len(dst.shape) == len(data.shape)
    _issue("tensor_reduce", dst, legacy_extra=dict(keepdims=keep), mask=mask, op=op,
           data=data, axis=axis, **extra)


def reciprocal(dst, data):
    _issue("reciprocal", dst, data=data)


def activation(dst, op, data, bias=None, scale=1.0, mask=None):
    """``dst = op(data * scale + bias)`` on ScalarE (``bias`` a ``(P, 1)`` tile or None)."""
    _issue("activation", dst, mask=mask, op=op, data=data, bias=bias, scale=scale)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, mask=None):
    """:func:`activation`, and ``reduce_res`` ``(P, 1)`` = the row reduction ``reduce_op`` of
    the fp32 result, taken before ``dst`` is rounded (``nl.add``; NeuronCore-v3+ also
    ``nl.maximum``/``nl.minimum``)."""
    _issue("activation_reduce", dst, mask=mask, op=op, data=data, reduce_op=reduce_op,
           reduce_res=reduce_res, bias=bias, scale=scale)


def activation_accumulate(dst, op, data, first: bool, reduce_res=None, bias=None, scale=1.0,
                          mask=None):
    """:func:`activation` whose row sums (add) accumulate in ScalarE's reduce registers across
    instructions: ``first`` resets them (``reduce_cmd.reset_reduce``), else they add on
    (``reduce``); ``reduce_res`` ``(P, 1)`` (the last of a chain) reads them out. The stub: the
    reduction costs nothing "except reading out reduce_regs into reduce_res", so a chain of n
    pays one readout instead of n (:func:`activation_reduce`). ``reduce_cmd`` on ``activation``:
    NKI 0.7, and neuronx-cc from 2.22 (nki-api-spec §9.3)."""
    ns = current()
    cmd = ns.nisa.reduce_cmd.reset_reduce if first else ns.nisa.reduce_cmd.reduce
    _issue("activation", dst, mask=mask, op=op, data=data, bias=bias, scale=scale,
           reduce_op=ns.nl.add, reduce_res=reduce_res, reduce_cmd=cmd)


# -- random numbers ---------------------------------------------------------------------------

def random_seed(seed, mask=None):
    """Seed the RNG :func:`dropout` draws from with ``seed`` (an int32 ``[1, 1]`` tile):
    ``nl.random_seed`` in legacy, ``nisa.set_rng_seed`` (the VectorE PRNG) in 0.7."""
    ns = current()
    if ns.api == "nki":
        ns.nisa.set_rng_seed(src_seeds=seed)
    else:
        ns.nl.random_seed(seed=seed, mask=mask)


def dropout(dst, data, prob, mask=None):
    """``dst = data`` with each element zeroed with probability ``prob`` (no rescale; VectorE)."""
    _issue("dropout", dst, mask=mask, data=data, prob=prob)
# -- a moving causal diagonal; the launch grid of for_programs -------------------------------


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

