"""Acceptance run of AWS's nki.* tutorial kernels on the simulator's nki.* front end.

    python benchmarks/nki_acceptance.py [/path/to/nki-samples checkout] [--target trn2]

The checkout is aws-neuron/nki-samples at commit 6905a68 (nothing of it is copied here). Each
kernel file is imported unchanged after ``simulate.register_as_nki()`` and run on the inputs
AWS's own drivers use (``*_torch.py`` / ``__main__`` blocks), checked against NumPy with the
drivers' tolerance (``allclose(atol=1e-4, rtol=1e-2)``), and measured with
``simulate.measure``. A kernel that fails is reported with the error, which names the
documented rule. Files that import the legacy ``neuronxcc.nki`` (not ``nki``) are not nki.*
kernels: they are listed apart and, for reference, run on the legacy front end
(``register_as_neuronxcc``); NKI 0.4+ makes ``neuronxcc.nki.*`` in a kernel a compilation error.

``--sdk DIR`` also runs the examples of the SDK docs, ``nki/examples/**`` of aws-neuron-sdk at
81ce03ae, extracted (never copied into this repository) with::

    git -C <aws-neuron-sdk> archive 81ce03ae nki/examples | tar x -C /tmp/sdk_head

(``DIR`` = ``/tmp/sdk_head``), on ``--target``, each against NumPy or the example's own NumPy
reference, with the tolerance of the example's driver. Files that cannot run unchanged are
listed with what blocks them. jax drivers are skipped (jax is not installed here).

``--mx`` runs the MX matmul tutorial of nki-samples (``tutorials/mxfp-matmul``) on trn3: the
six cases of AWS's ``mx_toplevel.py`` driver (which imports ``torch_xla``, so the cases are
rebuilt here from its code), checked against AWS's own goldens in ``mx_cpu_utils.py``. The
kernels pass ``platform_target=`` to ``nki.jit`` and ``dtype=`` to ``nisa.tensor_copy``, both
refused by NKI 0.3+ (migration guide, tensor_copy stub), so the cases are run twice: unchanged,
and with a runner-side shim of those two 0.2 spellings (``_compat02``; AWS's files are not
edited) that shows the MX instructions themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import runpy
import sys
import time
import traceback

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import simulate  # noqa: E402

TUT = "src/nki_samples/tutorials"
MATMUL = f"{TUT}/matrix_multiplication/matrix_multiplication_nki_kernels.py"
ADD = f"{TUT}/tensor_addition"
TRANSPOSE = f"{TUT}/transpose2d/transpose2d_nki_kernels.py"
BF16 = ml_dtypes.bfloat16


def _load(path, name):
    d = os.path.dirname(path)
    if d not in sys.path:
        sys.path.insert(0, d)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _api_of(path):
    with open(path) as f:
        src = f.read()
    return "legacy" if "neuronxcc" in src else "nki"


def _case(name, call, ref, target, atol=1e-4, rtol=1e-2, expect_error=None):
    """One kernel run: ``ref`` is an array (or a tuple of arrays for several outputs) or
    None (the call checks itself); ``expect_error`` names the documented error a negative
    example must raise (it passes when it does)."""
    t0 = time.perf_counter()
    try:
        with simulate.measure(target=target) as m:
            out = call()
        if expect_error is not None:
            return dict(name=name, ok=False, err=None, api=m.api, est=m.estimated_seconds,
                        prog=m.program_instructions, hbm=None, wall=time.perf_counter() - t0,
                        why=f"ran, but the example should fail with {expect_error}")
        if ref is None:
            ok, err = True, 0.0
        else:
            outs = out if isinstance(out, tuple) else (out,)
            refs = ref if isinstance(ref, tuple) else (ref,)
            ok, err = len(outs) == len(refs), 0.0
            for o, r in zip(outs, refs):
                o = np.asarray(o).astype(np.float32)
                r = np.asarray(r).astype(np.float32)
                ok = ok and o.shape == r.shape and bool(np.allclose(o, r, atol=atol, rtol=rtol))
                if o.shape == r.shape:
                    err = max(err, float(np.max(np.abs(o - r))))
        return dict(name=name, ok=ok, err=err, api=m.api, est=m.estimated_seconds,
                    prog=m.program_instructions, hbm=m.hbm_bytes_read + m.hbm_bytes_written,
                    wall=time.perf_counter() - t0, why="" if ok else "values differ")
    except Exception as e:           # report, keep going
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{os.path.basename(fr.filename)}:{fr.lineno}" for fr in reversed(tb)
                      if "nki-samples" in fr.filename or "nki_samples" in fr.filename
                      or "sdk_head" in fr.filename or "/nki/examples/" in fr.filename), "")
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if expect_error is not None and expect_error in str(e):
            return dict(name=name, ok=True, err=None, api="nki", est=None, prog=None, hbm=None,
                        wall=time.perf_counter() - t0, why="",
                        note=f"raises {expect_error}, as the example intends")
        return dict(name=name, ok=False, err=None, api="?", est=None, prog=None, hbm=None,
                    wall=time.perf_counter() - t0, why=f"{type(e).__name__} at {where}: {msg}")


def matmul_cases(root, target, rng):
    path = os.path.join(root, MATMUL)
    mod = _load(path, "matrix_multiplication_nki_kernels")
    # AWS's driver (matrix_multiplication_torch.py): bf16, lhs 64x128 @ 128x512 for basic,
    # 4096x1024 @ 1024x2048 for the others; lhs passed transposed
    ls = rng.random((64, 128), dtype=np.float32).astype(BF16)
    rs = rng.random((128, 512), dtype=np.float32).astype(BF16)
    lhs = rng.random((4096, 1024), dtype=np.float32).astype(BF16)
    rhs = rng.random((1024, 2048), dtype=np.float32).astype(BF16)
    small_ref = (ls.astype(np.float32) @ rs.astype(np.float32)).astype(BF16).astype(np.float32)
    big_ref = (lhs.astype(np.float32) @ rhs.astype(np.float32)).astype(BF16).astype(np.float32)
    lhsT = np.ascontiguousarray(lhs.T)
    out = [_case("matmul basic (64x128x512)",
                 lambda: mod.nki_matmul_basic_(np.ascontiguousarray(ls.T), rs), small_ref, target)]
    for nm in ("tiled", "hoist_load", "block_free_dimension", "fully_optimized"):
        k = getattr(mod, f"nki_matmul_{nm}_")
        out.append(_case(f"matmul {nm} (4096x1024x2048)", lambda k=k: k(lhsT, rhs), big_ref,
                         target))
    return out


def legacy_cases(root, target, rng):
    out = []
    d = os.path.join(root, ADD)
    a = rng.random((256, 1024), dtype=np.float32).astype(np.float16)
    b = rng.random((256, 1024), dtype=np.float32).astype(np.float16)
    ref = (a + b).astype(np.float32)
    m1 = _load(os.path.join(d, "tensor_addition_nki_kernels.py"), "tensor_addition_nki_kernels")
    out.append(_case("tensor_addition nki_tensor_add", lambda: m1.nki_tensor_add(a, b), ref,
                     target))
    m2 = _load(os.path.join(d, "spmd_tensor_addition_nki_kernels.py"),
               "spmd_tensor_addition_nki_kernels")
    out.append(_case("spmd_tensor_addition nki_tensor_add", lambda: m2.nki_tensor_add(a, b),
                     ref, target))
    m3 = _load(os.path.join(d, "spmd_multiple_nc_tensor_addition_nki_kernels.py"),
               "spmd_multiple_nc_tensor_addition_nki_kernels")
    a2 = rng.random((512, 2048), dtype=np.float32).astype(np.float16)
    b2 = rng.random((512, 2048), dtype=np.float32).astype(np.float16)
    out.append(_case("spmd_multiple_nc nki_tensor_add_nc2", lambda: m3.nki_tensor_add_nc2(a2, b2),
                     (a2 + b2).astype(np.float32), target))
    m4 = _load(os.path.join(root, TRANSPOSE), "transpose2d_nki_kernels")
    P, X, Y = 5, 3, 4
    t = np.arange(P * X * Y, dtype=np.int8).reshape((P, X * Y))
    tref = np.transpose(t.reshape(P, X, Y), (0, 2, 1)).reshape(P, X * Y).astype(np.float32)
    out.append(_case("transpose2d tensor_transpose2D_kernel_",
                     lambda: m4.tensor_transpose2D_kernel_(t, (X, Y)), tref, target))
    return out


# -- the SDK docs' examples (aws-neuron-sdk nki/examples at 81ce03ae) ---------------------------
SDK_EX = "nki/examples"
#: Files that cannot run unchanged, and why (checked by hand; each is re-checked at run time
#: where the check is cheap: the import error is reported as it happens).
SDK_BLOCKED = {
    "layout-loop.py": "imports torch_neuronx.nki_jit (the pre-0.2 torch decorator, not nki.*) "
                      "and stores to out_tensor[i_p, i_f] with i_f never defined",
    "layout-dynamic-loop.py": "SyntaxError in AWS's file: nl.load( is never closed (line 25); "
                              "the loop also uses k, never defined",
}


@contextlib.contextmanager
def _env_kept(var):
    """Undo an example's module-level ``os.environ[var] = ...`` after its import (AWS's
    tensor_addition example sets NEURON_PLATFORM_TARGET_OVERRIDE=trn1 when imported)."""
    had, old = var in os.environ, os.environ.get(var)
    try:
        yield
    finally:
        if had:
            os.environ[var] = old
        else:
            os.environ.pop(var, None)


def _mamba_ref(delta, u, A, B, C):
    """NumPy form of AWS's mamba_torch.mamba_layer (exp(delta*A), delta*B*u, sequential scan,
    sum over the state dim), in float64."""
    delta, u, A, B, C = (np.asarray(x, np.float64) for x in (delta, u, A, B, C))
    dA = np.exp(delta[:, :, None, :] * A[None, :, :, None])
    dBu = delta[:, :, None, :] * B[:, None, :, :] * u[:, :, None, :]
    state = np.zeros(dA.shape[:-1])
    scan = np.empty_like(dA)
    for i in range(dA.shape[-1]):
        state = dA[..., i] * state + dBu[..., i]
        scan[..., i] = state
    return (C[:, None, :, :] * scan).sum(axis=2)


def sdk_cases(sdk_root, target, rng):
    ex = os.path.join(sdk_root, SDK_EX)
    out = []

    def load(rel):
        nm = "sdk_" + os.path.basename(rel)[:-3].replace("-", "_")
        with _env_kept("NEURON_PLATFORM_TARGET_OVERRIDE"):
            return _load(os.path.join(ex, rel), nm)

    def guarded(label, rel, body):
        try:
            mod = load(rel)
        except Exception as e:        # an import that fails is the case's result
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            out.append(dict(name=label, ok=False, err=None, api="?", est=None, prog=None,
                            hbm=None, wall=0.0, why=f"import: {type(e).__name__}: {msg}"))
            return
        body(mod)

    # matrix_multiplication: the torch driver's inputs and check (allclose atol=1e-4,
    # rtol=1e-2 against a bf16 matmul; the reference here rounds the fp32 product to bf16)
    def mm(mod):
        ls = rng.random((64, 128), dtype=np.float32).astype(BF16)
        rs = rng.random((128, 512), dtype=np.float32).astype(BF16)
        lhs = rng.random((4096, 1024), dtype=np.float32).astype(BF16)
        rhs = rng.random((1024, 2048), dtype=np.float32).astype(BF16)
        small = (ls.astype(np.float32) @ rs.astype(np.float32)).astype(BF16)
        big = (lhs.astype(np.float32) @ rhs.astype(np.float32)).astype(BF16)
        out.append(_case("matmul basic (64x128x512)",
                         lambda: mod.nki_matmul_basic_(np.ascontiguousarray(ls.T), rs), small,
                         target))
        lhsT = np.ascontiguousarray(lhs.T)
        for nm in ("tiled", "hoist_load", "block_free_dimension", "fully_optimized"):
            k = getattr(mod, f"nki_matmul_{nm}_")
            out.append(_case(f"matmul {nm} (4096x1024x2048)", lambda k=k: k(lhsT, rhs), big,
                             target))
    guarded("matrix_multiplication", "matrix_multiplication/matrix_multiplication_nki_kernels.py",
            mm)

    def add(mod):
        a = rng.random((256, 1024), dtype=np.float32).astype(np.float16)
        b = rng.random((256, 1024), dtype=np.float32).astype(np.float16)
        out.append(_case("tensor_addition (256x1024 fp16)", lambda: mod.nki_tensor_add(a, b),
                         a + b, target))
    guarded("tensor_addition", "tensor_addition/tensor_addition_nki_kernels.py", add)

    def tr(mod):
        P, X, Y = 5, 3, 4        # the file's __main__ and the torch driver
        a = np.arange(P * X * Y, dtype=np.int8).reshape((P, X * Y))
        want = np.transpose(a.reshape(P, X, Y), (0, 2, 1)).reshape(P, X * Y)
        out.append(_case("transpose2d (5x12 int8)",
                         lambda: mod.tensor_transpose2D_kernel_(a, (X, Y)), want, target,
                         atol=0, rtol=0))
    guarded("transpose2d", "transpose2d/transpose2d_nki_kernels.py", tr)

    def pool(mod):
        x = np.arange(2 * 6 * 6, dtype=np.float16).reshape(2, 6, 6)   # the file's __main__
        out.append(_case("average_pool2d (2x6x6 fp16, pool 2)",
                         lambda: mod.tensor_avgpool_kernel(x, 2),
                         mod.np_average_pool_2D(x, 2), target, atol=0, rtol=0))
    guarded("average_pool2d", "average_pool2d/average_pool2d_nki_kernels.py", pool)

    def gs(label):
        def body(mod):
            a = np.ones((4, 3), dtype=np.float16)
            out.append(_case(label, lambda: mod.nki_tensor_add_kernel(a, a), a + a, target))
        return body
    guarded("getting_started_baremetal", "getting_started_baremetal.py",
            gs("getting_started_baremetal (4x3 fp16)"))
    guarded("getting_started_torch", "getting_started_torch.py",
            gs("getting_started_torch kernel (4x3 fp16)"))

    def split(mod):
        x = np.arange(4 * 5, dtype=np.float32).reshape(4, 5).astype(BF16)
        out.append(_case("index-case-1 tensor_split (4x5 bf16)",
                         lambda: mod.tensor_split_kernel_(x), (x[:, 0::2], x[:, 1::2]), target,
                         atol=0, rtol=0))
    guarded("index-case-1", "index-case-1.py", split)

    def maxpool(mod):
        x = np.arange(2 * 6 * 6, dtype=np.float32).reshape(2, 6, 6).astype(BF16)
        want = x.astype(np.float32).reshape(2, 3, 2, 3, 2).max(axis=(2, 4))
        out.append(_case("index-case-3 maxpool (2x6x6 bf16, pool 2)",
                         lambda: mod.tensor_maxpool_kernel_(x, 2), want, target, atol=0,
                         rtol=0))
    guarded("index-case-3", "index-case-3.py", maxpool)

    def lpass(mod):
        x = np.ones((128, 512), BF16)
        out.append(_case("layout-pass exp (128x512 bf16)", lambda: mod.tensor_exp_kernel_(x),
                         np.exp(np.ones((128, 512))).astype(BF16), target))
    guarded("layout-pass", "layout-pass.py", lpass)

    def lviol(mod):
        x = np.ones((256, 512), BF16)     # the example: 256 partitions in one tile
        out.append(_case("layout-violation (256x512: must fail)",
                         lambda: mod.tensor_exp_kernel_(x), None, target,
                         expect_error="exceed architecture limitation of 128"))
    guarded("layout-violation", "layout-violation.py", lviol)

    for f, why in SDK_BLOCKED.items():
        try:
            load(f)
            why = "imports now; not run by this script: " + why
        except Exception as e:
            why = f"{type(e).__name__} on import; {why}"
        out.append(dict(name=f, ok=False, err=None, api="-", est=None, prog=None, hbm=None,
                        wall=0.0, why=why))

    def mamba(mod):
        # the file's __main__ shapes (batch 1, seq_len 2048, channels 256, state 16); its
        # inputs are all ones, here random (A < 0, as the driver asks) for a stronger check
        B, S, Ch, N = 1, 2048, 256, 16
        r = np.random.default_rng(3)
        delta = r.random((B, Ch, S), dtype=np.float32) * 0.1
        u = r.random((B, Ch, S), dtype=np.float32)
        A = -r.random((Ch, N), dtype=np.float32)
        Bm = r.random((B, N, S), dtype=np.float32)
        C = r.random((B, N, S), dtype=np.float32)
        want = _mamba_ref(delta, u, A, Bm, C)
        for v in ("mamba_v1", "mamba_v2", "mamba_v3"):
            out.append(_case(f"fused_mamba {v} (1x256x2048, state 16)",
                             lambda v=v: getattr(mod, v)(delta, u, A, Bm, C), want, target,
                             atol=1e-2, rtol=1e-2))     # mamba_torch.py's tolerance
    guarded("fused_mamba", "fused_mamba/mamba_nki_kernels.py", mamba)

    def sim_example():
        # module-level code: builds inputs, runs nki.simulate(add_kernel), asserts
        runpy.run_path(os.path.join(ex, "simulate/nki_simulate_example.py"),
                       run_name="nki_simulate_example")
    out.append(_case("simulate/nki_simulate_example.py (runs its assert)", sim_example, None,
                     target))
    return out


# -- MX matmul tutorial (nki-samples tutorials/mxfp-matmul) on trn3 -----------------------------
MX = f"{TUT}/mxfp-matmul"


@contextlib.contextmanager
def _compat02():
    """The two NKI 0.2 spellings the MX tutorial uses, accepted for the run (simulator-side
    monkeypatch, AWS's files unchanged): ``nki.jit(platform_target=...)`` (refused since 0.3:
    migration guide) and ``nisa.tensor_copy(..., dtype=d)`` with ``d == dst.dtype`` (no
    ``dtype`` in the 0.7 signature; the output dtype is dst's)."""
    import simulate.nki as front
    from simulate.nki import isa as fisa
    jit0, copy0 = front.jit, fisa.tensor_copy

    def jit(fn=None, **kw):
        kw.pop("platform_target", None)
        return jit0(fn, **kw)

    def tensor_copy(dst, src, *a, dtype=None, **kw):
        if dtype is not None and np.dtype(dtype) != np.dtype(dst.dtype):
            raise TypeError(f"compat shim: tensor_copy dtype={dtype} differs from dst.dtype")
        return copy0(dst, src, *a, **kw)
    front.jit, fisa.tensor_copy = jit, tensor_copy
    try:
        yield
    finally:
        front.jit, fisa.tensor_copy = jit0, copy0


def mx_cases(root, compat):
    """The six runs of AWS's mx_toplevel.py __main__, on trn3, checked with its
    compare_and_print_results tolerance (allclose rtol=atol=5e-2) against its goldens."""
    import ml_dtypes as mld
    d = os.path.join(root, MX)
    tag = " [0.2 shim]" if compat else ""
    out = []
    with (_compat02() if compat else contextlib.nullcontext()):
        for m in ("mx_kernels", "mx_kernel_utils"):
            sys.modules.pop(m, None)
        try:
            cpu = _load(os.path.join(d, "mx_cpu_utils.py"), "mx_cpu_utils")
            ker = _load(os.path.join(d, "mx_kernels.py"), "mx_kernels")
        except Exception as e:
            msg = str(e).strip().splitlines()[0]
            return [dict(name=f"{c}{tag}", ok=False, err=None, api="?", est=None, prog=None,
                         hbm=None, wall=0.0, why=f"mx_kernels.py import: {type(e).__name__}: "
                                                 f"{msg}")
                    for c in ("offline_quantized float8_e5m2", "offline_quantized float4_e2m1fn",
                              "on_device_quantize float4_e2m1fn @ float8_e5m2",
                              "on_device_quantize float8_e5m2 @ float8_e5m2",
                              "copy_strided tensor_copy float8_e5m2",
                              "copy_strided dma float8_e5m2")]
        import nki.language as nl
        x4 = {mld.float8_e5m2: nl.float8_e5m2_x4, mld.float8_e4m3fn: nl.float8_e4m3fn_x4,
              mld.float4_e2m1fn: nl.float4_e2m1fn_x4}
        M, K, N = 128, 128, 512
        np.random.seed(0)                 # mx_cpu_utils draws from np.random

        def offline(qd):
            _, _, st, st_s = cpu.generate_stabilized_mx_data(qd, (K, M * 4))
            _, _, mv, mv_s = cpu.generate_stabilized_mx_data(qd, (K, N * 4))
            gold = cpu.nc_matmul_mx_golden(st, mv, st_s, mv_s, qd, qd)
            out.append(_case(f"offline_quantized {qd.__name__}{tag}",
                             lambda: ker.kernel_offline_quantized_mx_matmul(
                                 st, st_s, mv, mv_s, x4[qd]), gold, "trn3",
                             atol=5e-2, rtol=5e-2))

        def on_device(qs, qm):
            _, _, st, st_s = cpu.generate_stabilized_mx_data(qs, (K, M * 4))
            mv, _, _, _ = cpu.generate_stabilized_mx_data(qm, (K, N * 4))
            mq, mq_s = cpu.quantize_mx_golden(mv, qm)
            gold = cpu.nc_matmul_mx_golden(st, mq, st_s, mq_s, qs, qm)
            mv16 = mv.astype(np.float32).astype(BF16)      # the driver's .bfloat16()
            out.append(_case(f"on_device_quantize {qs.__name__} @ {qm.__name__}{tag}",
                             lambda: ker.kernel_on_device_quantize_matmul_mx(
                                 st, st_s, mv16, x4[qs], x4[qm]), gold, "trn3",
                             atol=5e-2, rtol=5e-2))

        def strided(qd, use_tc):
            st, _, _, _ = cpu.generate_stabilized_mx_data(qd, (512, 128))
            mv, _, _, _ = cpu.generate_stabilized_mx_data(qd, (512, 512))
            gold = st.T @ mv
            st16 = st.astype(np.float32).astype(BF16)
            mv16 = mv.astype(np.float32).astype(BF16)
            out.append(_case(f"copy_strided {'tensor_copy' if use_tc else 'dma'} "
                             f"{qd.__name__}{tag}",
                             lambda: ker.kernel_copy_strided_quantize_matmul_mx(
                                 st16, mv16, x4[qd], use_tc), gold, "trn3",
                             atol=5e-2, rtol=5e-2))

        offline(mld.float8_e5m2)
        offline(mld.float4_e2m1fn)
        on_device(mld.float4_e2m1fn, mld.float8_e5m2)
        on_device(mld.float8_e5m2, mld.float8_e5m2)
        strided(mld.float8_e5m2, True)
        strided(mld.float8_e5m2, False)
    return out


def _print(rows, title):
    print(f"\n{title}")
    print(f"{'kernel':52s} {'result':6s} {'api':6s} {'max err':>9s} {'estimate':>11s} "
          f"{'program':>8s} {'HBM MB':>7s} {'wall':>6s}")
    for r in rows:
        est = f"{r['est'] * 1e6:9.2f}us" if r["est"] is not None else "-"
        err = f"{r['err']:.2e}" if r["err"] is not None else "-"
        prog = str(r["prog"]) if r["prog"] is not None else "-"
        hbm = f"{r['hbm'] / 1e6:.2f}" if r["hbm"] is not None else "-"
        print(f"{r['name']:52s} {'PASS' if r['ok'] else 'FAIL':6s} {r['api']:6s} {err:>9s} "
              f"{est:>11s} {prog:>8s} {hbm:>7s} {r['wall']:5.1f}s")
        if not r["ok"]:
            print(f"    -> {r['why']}")
        elif r.get("note"):
            print(f"    -> {r['note']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", nargs="?", default="/tmp/nki-samples-6905a68",
                    help="aws-neuron/nki-samples checkout (commit 6905a68)")
    ap.add_argument("--target", default="trn2")
    ap.add_argument("--sdk", default=None, metavar="DIR",
                    help="also run aws-neuron-sdk's nki/examples extracted under DIR "
                         "(e.g. /tmp/sdk_head)")
    ap.add_argument("--mx", action="store_true",
                    help="also run the mxfp-matmul tutorial of the checkout on trn3")
    ap.add_argument("--skip-samples", action="store_true",
                    help="skip the nki-samples matmul/legacy tutorials")
    args = ap.parse_args(argv)
    root = args.checkout
    if not os.path.isfile(os.path.join(root, MATMUL)):
        ap.error(f"{root} does not hold {MATMUL}")
    if args.sdk and not os.path.isdir(os.path.join(args.sdk, SDK_EX)):
        ap.error(f"{args.sdk} does not hold {SDK_EX}")
    rng = np.random.default_rng(0)
    simulate.register_as_nki()
    tallies = []
    if not args.skip_samples:
        files = [os.path.join(root, MATMUL), os.path.join(root, TRANSPOSE)] + [
            os.path.join(root, ADD, f) for f in sorted(os.listdir(os.path.join(root, ADD)))
            if f.endswith("_nki_kernels.py")]
        print("front end of each tutorial file (by its imports):")
        for f in files:
            print(f"  {_api_of(f):6s} {os.path.relpath(f, root)}")
        nki_rows = matmul_cases(root, args.target, rng)
        _print(nki_rows, f"nki-samples nki.* kernels (simulate.register_as_nki(), target "
                         f"{args.target})")
        tallies.append(("nki-samples nki.*", nki_rows))
    if args.sdk:
        rows = sdk_cases(args.sdk, args.target, rng)
        _print(rows, f"aws-neuron-sdk 81ce03ae nki/examples (target {args.target})")
        tallies.append(("SDK examples", rows))
    if args.mx:
        for compat in (False, True):
            rows = mx_cases(root, compat)
            _print(rows, "nki-samples mxfp-matmul tutorial (target trn3)"
                   + (", with the 0.2 shim (platform_target=, tensor_copy dtype=)"
                      if compat else ", unchanged"))
            tallies.append(("MX tutorial" + (" [0.2 shim]" if compat else " unchanged"), rows))
    if not args.skip_samples:
        simulate.register_as_neuronxcc()
        leg_rows = legacy_cases(root, args.target, rng)
        _print(leg_rows, "legacy neuronxcc.nki kernels of the same tutorials (reference only: "
               "simulate.register_as_neuronxcc(); not nki.* code)")
        tallies.append(("legacy tutorials (reference)", leg_rows))
    print()
    for name, rows in tallies:
        n_ok = sum(r["ok"] for r in rows)
        print(f"tally {name}: {n_ok}/{len(rows)} passed")
    return 0

if __name__ == "__main__":
    sys.exit(main())
