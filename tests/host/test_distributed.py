"""Tests of host/distributed.py: ring attention (context parallelism) over torch.distributed.

Two ranks on localhost (gloo, loopback only) are started with torch.multiprocessing.spawn; each
runs ``ring_attention`` forward and backward on its half of the sequence and saves its shard of
o, dq, dk and dv. The concatenated shards are compared with the single-process
``host.torch_ops.flash_attention`` on the whole sequence (same kernels) and with the float64
reference. One spawn runs all cases of a kind, to pay the process start-up once.
"""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from host import reference  # noqa: E402
from host.distributed import ring_attention  # noqa: E402
from host.torch_ops import flash_attention  # noqa: E402

from _torch_helpers import FakeKernels, ring_case_inputs, ring_worker  # noqa: E402

WORLD = 2

if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ring(cases, outdir, fake, world=WORLD):
    mp.spawn(ring_worker, args=(world, _free_port(), str(outdir), fake, cases), nprocs=world,
             join=True)
    results = {}
    for case in cases:
        parts = [np.load(os.path.join(outdir, f"{case['name']}_{r}.npz")) for r in range(world)]
        results[case["name"]] = {key: np.concatenate([p[key] for p in parts], axis=2)
                                 for key in ("o", "dq", "dk", "dv")}
    return results


def _single_process(case):
    """o, dq, dk, dv of the unsharded call through host.torch_ops (same kernels), float64."""
    dtype = getattr(torch, case["dtype"])
    q, k, v, do = ring_case_inputs(case)
    qd, kd, vd = (x.to(dtype).requires_grad_() for x in (q, k, v))
    o = flash_attention(qd, kd, vd, causal=case["causal"], mixed_precision=case["mixed_precision"])
    grads = torch.autograd.grad(o, (qd, kd, vd), do.to(dtype))
    return [t.detach().double().numpy() for t in (o,) + grads]


def _reference(case):
    q, k, v, do = ring_case_inputs(case)
    dtype = getattr(torch, case["dtype"])
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))  # the inputs the ranks saw
    causal = "bottom_right" if case["causal"] else None
    o, _ = reference.attention_forward(q, k, v, causal=causal)
    return [o] + list(reference.attention_backward(do, q, k, v, causal=causal))


def _case(name, *, causal, dtype="float32", mixed_precision=False, B=1, Hq=2, Hkv=1, N=24,
          D=16, seed=0):
    return dict(name=name, causal=causal, dtype=dtype, mixed_precision=mixed_precision, B=B,
                Hq=Hq, Hkv=Hkv, N=N, D=D, seed=seed)


def test_ring_plumbing_matches_reference(tmp_path, monkeypatch, world=3):
    """Reference-backed kernels in every rank: the ring, the LSE merge and the dK/dV hops.

    With exact per-step kernels the ring result equals unsharded attention to float32 rounding
    (bfloat16: to about one rounding of the inputs' precision). Three ranks make the next and
    previous peers differ (the kernel test below runs two).
    """
    cases = [_case("full_gqa", causal=False, Hq=4, Hkv=2, N=12, B=2),
             _case("causal", causal=True, N=12, seed=1),
             _case("causal_bf16", causal=True, dtype="bfloat16", mixed_precision=True, seed=2)]
    results = _run_ring(cases, tmp_path, fake=True, world=world)
    FakeKernels().install_into(monkeypatch)
    for case in cases:
        got = results[case["name"]]
        want = _reference(case)
        single = _single_process(case)
        atol = 2e-2 if case["dtype"] == "bfloat16" else 1e-5
        for key, w, s in zip(("o", "dq", "dk", "dv"), want, single):
            np.testing.assert_allclose(got[key], w, atol=atol, rtol=0, err_msg=key)
            np.testing.assert_allclose(got[key], s, atol=atol, rtol=0, err_msg=key)


def _baseline(case):
    """The plain low-precision implementation of the tolerance rule (docs/semantics.md)."""
    q, k, v, do = ring_case_inputs(case)
    dtype = getattr(torch, case["dtype"])
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
    causal = "bottom_right" if case["causal"] else None
    mm = "float32" if (case["dtype"] == "float32" and not case["mixed_precision"]) else "bfloat16"
    kw = dict(dtype=mm, out_dtype=case["dtype"], causal=causal)
    return mm, [reference.attention_baseline_lowp(q, k, v, **kw)] + list(
        reference.attention_backward_baseline_lowp(do, q, k, v, **kw))


def test_ring_kernels_match_single_process(tmp_path):
    """The kernels on the active backend in both ranks vs unsharded attention.

    Every case meets the tolerance rule against the float64 reference (error <= 2 x the plain
    same-precision implementation's + 1e-5 fp32 / 1e-3 bf16). With float32 matmuls the ring
    also equals the single call of the same kernels to float32 rounding (atol 1e-5): the LSE
    merge is exact. (bf16 adds one rounding of each partial o and dk/dv per ring step, so it
    is compared with the reference only.)
    """
    cases = [_case("full", causal=False, Hq=4, Hkv=2, N=34, seed=3),
             _case("causal", causal=True, N=34, seed=4),
             _case("causal_bf16", causal=True, dtype="bfloat16", mixed_precision=True, N=34,
                   seed=5)]
    results = _run_ring(cases, tmp_path, fake=False)
    for case in cases:
        got = results[case["name"]]
        want = _reference(case)
        mm, base = _baseline(case)
        for key, w, b in zip(("o", "dq", "dk", "dv"), want, base):
            err = reference.max_abs_err(got[key], w)
            tol = reference.tolerance(w, b, floor=reference.atol_floor(mm))
            assert err <= tol, f"{case['name']} {key}: error {err:.3g} > tolerance {tol:.3g}"
        if case["dtype"] == "float32":
            for key, s in zip(("o", "dq", "dk", "dv"), _single_process(case)):
                np.testing.assert_allclose(got[key], s, atol=1e-5, rtol=0, err_msg=key)


def test_ring_errors_without_process_group():
    q = torch.zeros(1, 1, 4, 8)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"group: torch.distributed is not initialized"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match=r"causal: a causal ring needs equal query and key shard "
                                         r"lengths .*got Nq=4 and Nk=6"):
        ring_attention(q, torch.zeros(1, 1, 6, 8), torch.zeros(1, 1, 6, 8), causal=True)
    with pytest.raises(ValueError, match=r"q: device meta is not supported"):
        m = q.to("meta")
        ring_attention(m, m, m)


def test_rank_mismatch_messages_name_the_options_in_words():
    from host import distributed as d

    base = [1, 4, 2, 64, 64, 32, d._DTYPES.index(torch.bfloat16),
            d._CAUSALS.index("bottom_right"), 1, 0.125]
    assert d._mismatch_message(0, 1, base, list(base)) is None
    other = list(base)
    other[9] = 0.25                                    # a per-rank scale mismatch
    other[7] = d._CAUSALS.index(None)                  # one rank causal, the other not
    msg = d._mismatch_message(0, 1, base, other)
    assert "rank 0 and rank 1 differ in" in msg
    assert "scale: 0.125 here, 0.25 on rank 1" in msg
    assert "causal: 'bottom_right' here, None on rank 1" in msg
    other = list(base)
    other[6] = d._DTYPES.index(torch.float32)
    assert "dtype: bfloat16 here, float32 on rank 1" in d._mismatch_message(0, 1, base, other)
