"""Host overhead of the torch entry points: wall time per call at small shapes.

The torch path is ``nki_flash::attention_fwd`` / ``attention_bwd`` custom ops around the NumPy
API. This times, per call, on CPU tensors (kernels on the bundled simulator):

* ``host.flash_attention`` on NumPy arrays (the kernels alone, no torch);
* ``torch_ops.flash_attention`` eager (custom op dispatch, tensor <-> array conversion);
* the same under ``torch.compile(fullgraph=True, backend="eager")`` (the compiled graph
  calling the op), after a warm-up call that compiles;
* forward + backward (autograd through ``attention_bwd``), eager and compiled.

The simulator dominates every number (it runs the kernels in Python); the differences are the
host overhead of each path. The conversions copy nothing for contiguous CPU tensors of the
kernels' dtypes (``Tensor.numpy()`` / ``torch.from_numpy`` share memory).

    python benchmarks/torch_overhead.py [--n 128] [--d 64] [--repeats 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import torch  # noqa: E402

import host  # noqa: E402
from host import torch_ops  # noqa: E402


def timed(fn, repeats):
    fn()                                   # warm-up (compiles where it applies)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    shape = (1, a.heads, a.n, a.d)
    q, k, v = (torch.randn(shape, generator=g, requires_grad=True) for _ in range(3))
    qn, kn, vn = (x.detach().numpy() for x in (q, k, v))

    def fwd_numpy():
        host.flash_attention(qn, kn, vn, causal=True, mixed_precision=False)

    def fwd_eager():
        with torch.no_grad():
            torch_ops.flash_attention(q, k, v, causal=True, mixed_precision=False)

    compiled = torch.compile(
        lambda q, k, v: torch_ops.flash_attention(q, k, v, causal=True, mixed_precision=False),
        fullgraph=True, backend="eager")

    def fwd_compiled():
        with torch.no_grad():
            compiled(q, k, v)

    def fb_eager():
        torch_ops.flash_attention(q, k, v, causal=True, mixed_precision=False).sum().backward()

    def fb_compiled():
        compiled(q, k, v).sum().backward()

    rows = [("forward, NumPy API (kernels only)", fwd_numpy),
            ("forward, torch eager (custom op)", fwd_eager),
            ("forward, torch.compile(fullgraph)", fwd_compiled),
            ("forward + backward, torch eager", fb_eager),
            ("forward + backward, torch.compile", fb_compiled)]
    print(f"B=1 H={a.heads} N={a.n} D={a.d} float32 causal, median of {a.repeats} calls "
          f"(simulator backend)")
    base = None
    for name, fn in rows:
        t = timed(fn, a.repeats)
        base = t if base is None else base
        print(f"  {name:38s} {t * 1e3:8.2f} ms   ({t / base:5.2f}x the NumPy API)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
