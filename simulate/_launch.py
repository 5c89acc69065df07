"""Launching a kernel: run it on every point of its SPMD grid in a fresh kernel context,
convert the host arguments to HBM tensors and the returned tensors back to host arrays, and
hand the launch's record to the active ``simulate.measure()`` objects.

The top of the simulator's core: it imports the contexts (``_runtime``), the tensors
(``_tensor``), the front-end block-scope check (``_scope``) and ``language`` (the NKI loop that
stands in for Python ``range`` in kernel code under strict mode); nothing below imports it.
"""

from __future__ import annotations

import inspect
import itertools
import warnings

import numpy as np

from . import _blas, _dtypes, _hw, _sched, _spill, _strict, language
from ._cost import LaunchRecord
from ._errors import nki_error, fmt_shape, ProgramSizeWarning
from ._runtime import (Ctx, Launch, _measures, _progress_hooks, _stack, _trace, core_of,
                       in_kernel, resolve_grid, resolve_target)
from ._scope import check_kernel
from ._tensor import Storage, Tensor, host_array


def _is_mutable_annotation(ann):
    if ann is inspect.Parameter.empty:
        return False
    if isinstance(ann, str):
        return "mutable_tensor" in ann
    return bool(getattr(ann, "_nki_mutable", False))


_sig_cache = {}


def _signature(func):
    try:
        return _sig_cache[func]
    except KeyError:
        pass
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        sig = None
    _sig_cache[func] = sig
    return sig


def _kernel_name(func):
    return getattr(func, "__name__", type(func).__name__)


def launch(func, grid, args, kwargs, opts):
    """Run ``func`` as a kernel on every grid point; return host results (see __init__)."""
    if in_kernel():
        if grid:
            raise nki_error("err_nested_kernel_with_spmd_grid", "syntax",
                            f"Calling kernel with spmd grid ({_kernel_name(func)}"
                            f"{list(grid)}) inside another kernel is not supported")
        r = func(*args, **kwargs)
        check_kernel(func)
        return r

    tgt = resolve_target(opts)
    # which front end launched it: "legacy" (neuronxcc.nki, simulate.*) or "nki" (simulate.nki)
    api = opts.get("_api", "legacy")
    legacy = api == "legacy"
    if legacy and tgt.nc_version >= 4:
        # neuronxcc.nki ends with Neuron SDK 2.29; trn3 came with the nki.* namespace
        # (nki-today.md §1 and §3): no legacy toolchain targets NeuronCore-v4
        raise ValueError(
            f"kernel '{_kernel_name(func)}': the legacy neuronxcc.nki API does not target "
            f"{tgt.name} (NeuronCore-v{tgt.nc_version}); trn3 runs nki.* kernels (Neuron SDK "
            "2.30+, simulate.register_as_nki()). Legacy targets: trn1, trn2.")
    sizes = resolve_grid(grid, tgt) if grid else ()
    rec = LaunchRecord(_kernel_name(func), tgt, sizes)
    rec.api = api
    L = Launch(func, tgt, sizes, rec, opts)

    # ---- bind arguments: numpy arrays become HBM tensors ----
    sig = _signature(func)
    host_of = {}                 # Storage -> (caller array)
    conv_args, conv_kwargs = [], {}
    names = []
    if sig is not None:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"kernel '{_kernel_name(func)}': {e}") from None
        params = sig.parameters
        for pname, val in bound.arguments.items():
            p = params[pname]
            mutable = _is_mutable_annotation(p.annotation)
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                val = tuple(_conv_arg(L, f"{pname}{i}", v, mutable, host_of, Storage, Tensor)
                            for i, v in enumerate(val))
            elif p.kind is inspect.Parameter.VAR_KEYWORD:
                val = {k: _conv_arg(L, k, v, mutable, host_of, Storage, Tensor)
                       for k, v in val.items()}
            else:
                val = _conv_arg(L, pname, val, mutable, host_of, Storage, Tensor)
            bound.arguments[pname] = val
            names.append(pname)
        conv_args, conv_kwargs = list(bound.args), dict(bound.kwargs)
    else:
        conv_args = [_conv_arg(L, f"arg{i}", v, False, host_of, Storage, Tensor)
                     for i, v in enumerate(args)]
        conv_kwargs = {k: _conv_arg(L, k, v, False, host_of, Storage, Tensor)
                       for k, v in kwargs.items()}

    # ---- run every instance (row-major) ----
    ret = None
    old = np.seterr(all="ignore")
    blas = _blas.single_threaded()
    blas.__enter__()
    stack = _stack()
    peak_s = peak_p = peak_b = 0
    traces, evicted = {}, False           # on-chip accesses, for a run that ran short (_spill)
    _sched.ACTIVE = rec.sched
    try:
        points = itertools.product(*(range(s) for s in sizes)) if sizes else [()]
        if _trace["on"]:
            points = itertools.islice(points, 1)
        total = int(np.prod(sizes)) if sizes else 1
        raw = grid if isinstance(grid, tuple) else (grid,)
        for pid in points:
            ctx = Ctx(L, pid)
            rec.ctx = ctx
            rec.core = core_of(raw, pid) if sizes else 0
            stack.append(ctx)
            try:
                if legacy:
                    # neuronx-cc rewrites Python range to sequential_range (legacy only: NKI
                    # 0.7 unrolls Python loops, nki-loops page)
                    with _strict.python_range_as(language._python_range):
                        ret = func(*conv_args, **conv_kwargs)
                else:
                    ret = func(*conv_args, **conv_kwargs)
            finally:
                stack.pop()
                ctx.pending = None
            if L.instance == 0 and legacy:
                # front-end block-scope rule (AST of the kernel's source, cached per function);
                # checked after the first instance so trace-time errors raised before the
                # out-of-scope read keep precedence
                check_kernel(func)
            if ctx.space is not None:
                traces.update(ctx.space.trace)
                evicted = evicted or ctx.space.evicted
            peak_s = max(peak_s, ctx.peak_sbuf)
            peak_p = max(peak_p, ctx.peak_psum)
            peak_b = max(peak_b, ctx.peak_banks)
            L.instance += 1
            for hook in _progress_hooks:
                hook(L.instance, total)
    finally:
        np.seterr(**old)
        blas.__exit__(None, None, None)
        rec.ctx = None
        _sched.ACTIVE = None
    if evicted and _spill.ORACLE is None and not _trace["on"]:
        # on-chip space ran short: run again, evicting by the accesses this run recorded (the
        # compiler's allocator sees the whole program); only that run counts
        rec.sched.finish()
        # drop this run's tensors before the second run allocates its own
        ret = conv_args = conv_kwargs = None
        L.shared.clear()
        L.params.clear()
        host_of.clear()
        _spill.ORACLE = traces
        try:
            return launch(func, grid, args, kwargs, opts)
        finally:
            _spill.ORACLE = None
    if rec.spill_refills:
        _spill.warn(rec, tgt)
    rec.estimated_seconds = rec.sched.finish()
    rec.peak_sbuf_bytes_per_partition = peak_s
    rec.peak_psum_bytes_per_partition = peak_p
    rec.peak_psum_banks = peak_b
    if rec.program_instructions > _hw.PROGRAM_INSTRUCTION_WARN:
        warnings.warn(
            f"kernel '{rec.name}': the compiled program has {rec.program_instructions} "
            f"instructions (> {_hw.PROGRAM_INSTRUCTION_WARN}); neuronx-cc's compile time and "
            "memory grow with the unrolled program (aws-neuron-sdk #1374) and it refuses "
            f"programs above {_hw.PROGRAM_INSTRUCTION_LIMIT} instructions. "
            + ("Use nl.affine_range/nl.sequential_range loops instead of Python loops or "
               "static_range." if legacy else "NKI 0.7 unrolls Python loops and the range "
               "aliases; use nl.fori_loop for long loops (nki-loops page)."),
            ProgramSizeWarning, stacklevel=3)
    for m in _measures:
        m._add(rec)

    # ---- outputs ----
    if _trace["on"]:
        return None
    return _outputs(L, ret, host_of, Tensor, host_array)


def _conv_arg(L, name, val, mutable, host_of, Storage, Tensor):
    if isinstance(val, np.ndarray):
        di = _dtypes.host_info(val.dtype)
        _dtypes.check_target(di, L.tgt, f"kernel argument '{name}'")
        if not di.is_float:
            arr = np.array(val, dtype=di.backing)
        elif val.dtype == di.out_np:
            arr = np.array(val, dtype=np.float32)        # exact widening, no rounding needed
        else:
            arr = di.round(np.array(val, dtype=np.float32))   # e.g. float64 -> float32 (RNE)
        st = Storage.new_param(arr, di, name, mutable)
        L.params[name] = st
        host_of[st] = val
        return Tensor(st)
    return val


def _outputs(L, ret, host_of, Tensor, host_array):
    params = list(L.params.values())

    def conv(x):
        if isinstance(x, Tensor):
            st = x._st
            if st.buffer not in ("hbm", "shared_hbm"):
                # AWS's known issues: top-level kernel I/O must be in HBM for kernels compiled
                # for a device (nki_jit / baremetal / nki_call). Its CPU simulation mode returns
                # an on-chip tensor's values (the range_select documentation example returns an
                # SBUF tile); so do we, for kernels declared ``@nki.jit(mode="simulation")``.
                if not L.opts.get("_simulation_mode"):
                    raise TypeError("kernel outputs must be HBM tensors (nl.shared_hbm / "
                                    f"nl.hbm); '{st.name}' lives in {st.buffer} (only a "
                                    "kernel declared @nki.jit(mode='simulation') may return "
                                    "an on-chip tensor)")
                return host_array(x)
            if not st.written:
                raise nki_error("err_tensor_output_not_written_to", "value",
                                f"Output tensor '{st.name}' {fmt_shape(st.arr.shape)} is never "
                                "written to in the kernel.")
            return host_array(x)
        if isinstance(x, tuple):
            return tuple(conv(v) for v in x)
        if isinstance(x, list):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    if ret is not None:
        # convention A: returned tensors are the outputs
        if L.immutable_writes:
            raise nki_error("err_cannot_update_immutable_parameter", "type",
                            f"Cannot update immutable parameter `{L.immutable_writes[0]}`")
        returned = set()
        _collect(ret, returned, Tensor)
        for st in params:
            if st.mutable and st.written and st not in returned:
                raise nki_error("err_mutable_parameter_not_returned", "syntax",
                                f"Mutable kernel parameter `{st.name}` not returned by `return` "
                                "statement")
        return conv(ret)

    # convention B (2.20): outputs were passed in and written in place
    wrote = [st for st in params if st.written]
    if not wrote:
        raise nki_error("err_tensor_output_not_written_to", "value",
                        f"Kernel '{L.rec.name}' has no output: it returns nothing and writes "
                        "none of its arguments.")
    for st in wrote:
        dst = host_of[st]
        src = host_array(Tensor(st))
        if dst.flags.writeable:
            if dst.shape != src.shape:
                src = src.reshape(dst.shape)
            np.copyto(dst, src.astype(dst.dtype), casting="unsafe")
    return None


def _collect(x, out, Tensor):
    if isinstance(x, Tensor):
        out.add(x._st)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _collect(v, out, Tensor)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out, Tensor)
