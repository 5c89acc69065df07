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
"""

from __future__ import annotations

import argparse
import importlib.util
import os
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


def _case(name, call, ref, target):
    t0 = time.perf_counter()
    try:
        with simulate.measure(target=target) as m:
            out = call()
        out = np.asarray(out).astype(np.float32)
        ok = bool(np.allclose(out, ref, atol=1e-4, rtol=1e-2))
        err = float(np.max(np.abs(out - ref)))
        return dict(name=name, ok=ok, err=err, api=m.api, est=m.estimated_seconds,
                    prog=m.program_instructions, hbm=m.hbm_bytes_read + m.hbm_bytes_written,
                    wall=time.perf_counter() - t0, why="" if ok else "values differ")
    except Exception as e:           # report, keep going
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{os.path.basename(fr.filename)}:{fr.lineno}" for fr in reversed(tb)
                      if "nki-samples" in fr.filename or "nki_samples" in fr.filename), "")
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
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


def _print(rows, title):
    print(f"\n{title}")
    print(f"{'kernel':42s} {'result':6s} {'api':6s} {'max err':>9s} {'estimate':>11s} "
          f"{'program':>8s} {'HBM MB':>7s} {'wall':>6s}")
    for r in rows:
        est = f"{r['est'] * 1e6:9.2f}us" if r["est"] is not None else "-"
        err = f"{r['err']:.2e}" if r["err"] is not None else "-"
        prog = str(r["prog"]) if r["prog"] is not None else "-"
        hbm = f"{r['hbm'] / 1e6:.2f}" if r["hbm"] is not None else "-"
        print(f"{r['name']:42s} {'PASS' if r['ok'] else 'FAIL':6s} {r['api']:6s} {err:>9s} "
              f"{est:>11s} {prog:>8s} {hbm:>7s} {r['wall']:5.1f}s")
        if not r["ok"]:
            print(f"    -> {r['why']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", nargs="?", default="/tmp/nki-samples-6905a68",
                    help="aws-neuron/nki-samples checkout (commit 6905a68)")
    ap.add_argument("--target", default="trn2")
    args = ap.parse_args(argv)
    root = args.checkout
    if not os.path.isfile(os.path.join(root, MATMUL)):
        ap.error(f"{root} does not hold {MATMUL}")
    rng = np.random.default_rng(0)
    simulate.register_as_nki()
    files = [os.path.join(root, MATMUL), os.path.join(root, TRANSPOSE)] + [
        os.path.join(root, ADD, f) for f in sorted(os.listdir(os.path.join(root, ADD)))
        if f.endswith("_nki_kernels.py")]
    print("front end of each tutorial file (by its imports):")
    for f in files:
        print(f"  {_api_of(f):6s} {os.path.relpath(f, root)}")
    nki_rows = matmul_cases(root, args.target, rng)
    _print(nki_rows, f"nki.* kernels (simulate.register_as_nki(), target {args.target})")
    simulate.register_as_neuronxcc()
    leg_rows = legacy_cases(root, args.target, rng)
    _print(leg_rows, "legacy neuronxcc.nki kernels of the same tutorials (reference only: "
           "simulate.register_as_neuronxcc(); not nki.* code)")
    n_ok = sum(r["ok"] for r in nki_rows)
    l_ok = sum(r["ok"] for r in leg_rows)
    print(f"\nnki.* tally: {n_ok}/{len(nki_rows)} passed; legacy tutorials (reference): "
          f"{l_ok}/{len(leg_rows)} passed")
    return 0 if n_ok == len(nki_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
