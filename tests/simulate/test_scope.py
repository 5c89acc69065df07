"""Front-end block-scope rule: err_local_variable_used_out_of_scope (spec §3.5, §13)."""
import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl


def _scope_error(kernel, *args):
    with pytest.raises(SyntaxError, match="is referenced outside of its parent scope") as e:
        kernel(*args)
    assert e.value.nki_error == "err_local_variable_used_out_of_scope"
    assert "err-local-variable-used-out-of-scope" in str(e.value)
    return str(e.value)


def test_scope_rule_documented_examples():
    a = np.ones((128, 64), np.float32)

    @nki.jit
    def k1(x, y):
        c = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        for i in range(4):
            if i < 2:
                tmp = nl.load(x)
            else:
                tmp = nl.load(y)
            nl.store(c, tmp)
        return c
    msg = _scope_error(k1, a, a)
    assert "'tmp'" in msg and "'else' block" in msg

    @nki.jit
    def k2(x):
        ptr = nl.ndarray((128, 128), nl.float32, buffer=nl.shared_hbm)
        data = nl.zeros((nl.par_dim(128), 128), dtype=np.float32)
        for i in nl.sequential_range(4):
            i_tile = nisa.iota(i, dtype=nl.uint32).broadcast_to(data.shape)
            data = data + i_tile
        nl.store(ptr, value=data)
        return ptr
    assert "'data'" in _scope_error(k2, a)

    @nki.jit
    def k3(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        for i in nl.affine_range(2):
            t = nl.exp(nl.load(x))
        nl.store(out, t)
        return out
    assert "'for' block" in _scope_error(k3, a)


def test_scope_rule_accepts_valid_kernels():
    a = np.ones((128, 64), np.float32)

    def helper(x):                       # helpers are not analysed
        for i in range(2):
            t = nl.load(x)
        return t

    @nki.jit
    def k(x, flag=True, n=2):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        # a Python-level condition is decided while tracing (no scope), as in the NKI samples
        if flag:
            w = nl.load(x)
        else:
            w = None
        # allocate before the block, assign into it
        acc = nl.zeros(x.shape, nl.float32)
        for i in nl.affine_range(n):
            t = nl.load(x)
            acc += t
            last = i                     # non-tensor values are not tracked
        for i in nl.sequential_range(n):
            s = nl.load(x)
            nl.store(out, nl.add(s, w))
        s = nl.load(x)                   # rebinding at this level: back in scope
        if n > 1:
            u = helper(x)
        for i in nl.sequential_range(n):
            if i < 1:
                v = nl.load(x)
                nl.store(out, v)
            else:
                nl.store(out, s)         # the else branch sees the outer binding
        nl.store(out, nl.add(nl.add(s, acc), u))
        return out, last
    o, last = k(a)
    assert last == 1 and (o == 4).all()


def test_scope_rule_loop_reduce_accumulator_is_usable_after_the_loop():
    x = np.arange(4 * 8, dtype=np.float32).reshape(4, 1, 8)

    @nki.jit
    def k(a):
        out = nl.ndarray((1, 8), nl.float32, buffer=nl.shared_hbm)
        for i in nl.affine_range(4):
            acc = nl.loop_reduce(nl.load(a[i]), op=np.add, loop_indices=[i])
        nl.store(out, acc)
        return out
    np.testing.assert_array_equal(k(x), x.sum(0))
