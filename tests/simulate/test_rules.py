"""Hardware rules enforced with NKI-style errors (spec §1, §3, §13) and assignment semantics."""
import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa
from simulate import NKIError

URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/nki/api/nki.errors.html#"
A = np.ones((128, 512), np.float32)


def run(body, *arrays, target=None):
    def kernel(*hbm):
        r = body(*hbm)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, 0.0)
        return out
    opts = {} if target is None else {"platform_target": target}
    return nki.jit(kernel, **opts)(*(arrays or (A,)))


def test_partition_limit_on_creation_has_docs_url():
    with pytest.raises(ValueError) as e:
        run(lambda a: nl.zeros((256, 4), nl.float32))
    msg = str(e.value)
    assert msg.startswith("number of partitions 256 exceed architecture limitation of 128.")
    assert msg.endswith("\n" + URL + "err-num-partition-exceed-arch-limit")
    assert isinstance(e.value, NKIError)


def test_partition_limit_on_load_store_and_results():
    big = np.ones((12800,), np.float32)
    with pytest.raises(ValueError, match=r"number of partition in src\[12800, 1\] of 'load' "
                                         r"exceed architecture limitation of 128."):
        run(lambda a: nl.load(a), big)

    def st(a):
        out = nl.ndarray((1024, 64), nl.float32, buffer=nl.hbm)
        nl.store(out, nl.zeros((128, 64), nl.float32).broadcast_to((256, 64)))
    with pytest.raises(ValueError, match="exceed architecture limitation of 128"):
        run(st)


def test_onchip_tensors_need_two_dims():
    with pytest.raises(ValueError, match="Insufficient rank"):
        run(lambda a: nl.zeros((128,), nl.float32))


def test_psum_tile_must_fit_one_bank():
    with pytest.raises(RuntimeError, match="must fit one 2048-byte bank"):
        run(lambda a: nl.zeros((128, 1024), nl.float32, buffer=nl.psum))
    run(lambda a: nl.zeros((128, 1024), nl.bfloat16, buffer=nl.psum))
    run(lambda a: nl.zeros((4, nl.par_dim(128), 512), nl.float32, buffer=nl.psum))


def test_psum_bank_overflow_and_release():
    def nine(a):
        tiles = [nl.zeros((128, 128), nl.float32, buffer=nl.psum) for _ in (0,) * 9]
        return tiles
    with pytest.raises(RuntimeError, match="stack overflow: required psum banks 9 exceeds "
                                           "available psum banks 8"):
        run(nine)

    def blocks(a):
        t = nl.zeros((6, nl.par_dim(128), 512), nl.float32, buffer=nl.psum)
        u = nl.zeros((3, nl.par_dim(128), 128), nl.float32, buffer=nl.psum)
        return t, u
    with pytest.raises(RuntimeError, match="required psum banks 9"):
        run(blocks)

    def loop(a):
        for i in nl.affine_range(20):          # each iteration frees the previous tile
            t = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
            t2 = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
    run(loop)


def test_matmul_temporaries_do_not_count_against_psum():
    s = np.ones((128, 128), np.float32)

    def full(a):
        st = nl.load(a[:, 0:128])
        mv = nl.load(a)
        ps = nl.zeros((8, nl.par_dim(128), 512), nl.float32, buffer=nl.psum)
        for i in nl.affine_range(8):
            ps[i] += nisa.nc_matmul(st, mv)
    run(full)


def test_sbuf_capacity_per_target():
    def many(a):
        keep = [nl.zeros((128, 17000), nl.float32) for _ in (0,) * 3]  # 3 x 68000 B
        return keep
    with pytest.raises(RuntimeError, match="SBUF capacity exceeded") as e:
        run(many, target="trn1")
    assert "196608" in str(e.value)
    run(many, target="trn2")                                            # 204000 < 229376
    with pytest.raises(RuntimeError, match=r"Size of free dimensions 256 KB per partition on "
                                           r"SBUF buffer"):
        run(lambda a: nl.zeros((128, 65536), nl.float32), target="trn2")


def test_matmul_operand_rules():
    def mk(sshape, mshape, sbuf=True):
        def body(a):
            st = nl.zeros(sshape, nl.bfloat16)
            mv = nl.zeros(mshape, nl.bfloat16, buffer=nl.sbuf if sbuf else nl.psum)
            ps = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
            ps[0:sshape[1], 0:mshape[1]] = nisa.nc_matmul(st, mv)
        return body
    with pytest.raises(ValueError, match=r"size of dimension 1 in 'stationary\[128, 256\]' of "
                                         r"'nc_matmul' exceed architecture limitation of 128"):
        run(mk((128, 256), (128, 512)))
    with pytest.raises(ValueError, match=r"moving\[128, 1024\].*limitation of 512"):
        run(mk((128, 128), (128, 1024)))
    with pytest.raises(ValueError, match="contraction"):
        run(mk((128, 128), (64, 512)))
    with pytest.raises(TypeError, match="Expected operand 'moving' of 'nc_matmul' to be in "
                                        "address space 'sbuf', but got a tile in 'psum'"):
        run(mk((128, 128), (128, 512), sbuf=False))

    def to_sbuf(a):
        st = nl.zeros((128, 128), nl.bfloat16)
        res = nl.ndarray((128, 128), nl.float32)
        res[...] = nisa.nc_matmul(st, st)
    with pytest.raises(TypeError, match="Result buffer of matmult must be psum!"):
        run(to_sbuf)

    def bf16_psum(a):
        st = nl.zeros((128, 128), nl.bfloat16)
        res = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.psum)
        res[...] = nisa.nc_matmul(st, st)
    with pytest.raises(TypeError, match="PSUM tensor for non-transpose writes must be a 4-byte"):
        run(bf16_psum)

    def nl_matmul_limits(a):
        x = nl.zeros((128, 256), nl.bfloat16)
        y = nl.zeros((128, 512), nl.bfloat16)
        return nl.matmul(x, y, transpose_x=True)
    with pytest.raises(ValueError, match="exceed architecture limitation of 128"):
        run(nl_matmul_limits)


def test_engines_cannot_touch_hbm():
    with pytest.raises(TypeError) as e:
        run(lambda a: nl.exp(a))
    assert str(e.value).startswith("Expected operand 'x' of 'exp' to be in address space "
                                   "'psum|sbuf', but got a tile in 'hbm' instead.")
    assert e.value.nki_error == "err_unsupported_memory"
    with pytest.raises(TypeError, match="Expected operand 'src' of 'load' to be in address space "
                                        "'hbm', but got a tile in 'sbuf' instead."):
        run(lambda a: nl.load(nl.zeros((4, 4), nl.float32)))
    with pytest.raises(TypeError, match="address space 'psum|sbuf'"):
        run(lambda a: nisa.tensor_tensor(a, a, np.add))

    def assign_hbm(a):
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.hbm)
        out[...] = nl.load(a)
    with pytest.raises(TypeError, match="Use nl.store"):
        run(assign_hbm)


@pytest.mark.parametrize("lo,hi,ok", [(0, 128, True), (0, 5, True), (32, 64, True),
                                      (96, 128, True), (64, 128, True), (16, 48, False),
                                      (32, 96, False), (1, 128, False), (8, 16, False),
                                      (64, 96, True)])
def test_start_partition_alignment_on_compute(lo, hi, ok):
    def body(a):
        t = nl.zeros((128, 64), nl.float32)
        return nl.exp(t[lo:hi, :])
    if ok:
        run(body)
    else:
        with pytest.raises(ValueError, match=f"start partition {lo} .* of 'exp' is not allowed"):
            run(body)


def test_start_partition_not_checked_for_dma_and_checked_for_dst():
    def dma(a):
        t = nl.zeros((128, 64), nl.float32)
        t[5:9, :] = nl.load(a[0:4, 0:64])                  # DMA writes: any partition
        out = nl.ndarray((4, 64), nl.float32, buffer=nl.hbm)
        nl.store(out, t[5:9, :])                           # DMA reads: any partition
    run(dma)

    def dst(a):
        t = nl.zeros((128, 64), nl.float32)
        t[5:9, :] = nl.exp(nl.zeros((4, 64), nl.float32))  # compute-engine write
    with pytest.raises(ValueError, match="start partition 5"):
        run(dst)


def test_bf16_rounding_really_happens():
    @nki.jit
    def k(a):
        t = nl.ndarray((1, 1), nl.bfloat16)
        t[...] = nl.load(a)                          # 1 + 2^-10 is not representable in bf16
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out
    assert k(np.array([[1 + 2 ** -10]], np.float32))[0, 0] == 1.0

    @nki.jit
    def k2(a):
        t = nl.load(a)
        s = nl.add(t, t, dtype=nl.bfloat16)          # engines compute fp32, round on write
        out = nl.ndarray((1, 3), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, s)
        return out
    x = np.array([[1 + 2 ** -9, 3.0, 1e-3]], np.float32)
    np.testing.assert_array_equal(k2(x), (2 * x).astype(ml_dtypes.bfloat16).astype(np.float32))


def test_psum_accumulates_fp32():
    @nki.jit
    def k(a, b):
        ps = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
        st = nl.load(a)
        mv = nl.load(b)
        for _ in nl.affine_range(64):
            ps += nisa.nc_matmul(st, mv)
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.copy(ps))
        return out
    a = np.full((128, 128), 2 ** -8, ml_dtypes.bfloat16)
    b = np.full((128, 512), 1 + 2 ** -7, ml_dtypes.bfloat16)
    got = k(a, b)
    np.testing.assert_array_equal(got, np.float32(64 * 128 * 2 ** -8 * (1 + 2 ** -7)))


def test_weak_scalar_promotion():
    seen = {}

    @nki.jit
    def k(a, b):
        t = nl.load(a)
        u = nl.load(b)
        seen["fp16*float"] = (t * 1.5).dtype
        seen["fp16*np.float16"] = (t * np.float16(1.5)).dtype
        seen["int8+int"] = (u + 2).dtype
        seen["int8+fp16"] = nl.add(u, t).dtype
        seen["bf16+fp16"] = nl.add(nl.copy(t, dtype=nl.bfloat16), t).dtype
        seen["int8+uint8"] = nl.add(u, nl.copy(u, dtype=nl.uint8)).dtype
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, 0.0)
        return out
    k(np.ones((2, 2), np.float16), np.ones((2, 2), np.int8))
    assert seen == {"fp16*float": np.float32, "fp16*np.float16": np.float16,
                    "int8+int": np.int32, "int8+fp16": np.float16,
                    "bf16+fp16": np.float32, "int8+uint8": np.int16}


def test_inplace_operators_sbuf_and_views():
    @nki.jit
    def k(a):
        t = nl.load(a)
        acc = nl.zeros((4, 4), nl.float32)
        acc += t
        acc[...] += t
        acc[0:2, :] *= 3.0
        acc -= 1.0
        acc[:, 0:2] /= 2.0
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, acc)
        return out
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    ref = 2 * a
    ref[0:2] *= 3
    ref -= 1
    ref[:, 0:2] /= 2
    np.testing.assert_allclose(k(a), ref)


def test_dst_smaller_than_value_on_assignment():
    def body(a):
        t = nl.zeros((128, 1), nl.float32)
        t[...] = nl.load(a)
    with pytest.raises(ValueError, match=r"shape \[128, 1\] of parameter 'a' is smaller than "
                                         r"other parameter shapes b\[128, 512\]"):
        run(body)


def test_non_broadcastable_operands():
    def body(a):
        x = nl.zeros((128, 4), nl.float32)
        y = nl.zeros((128, 5), nl.float32)
        return nl.add(x, y)
    with pytest.raises(ValueError, match="could not be broadcast together with shapes"):
        run(body)


def test_transpose_limits():
    with pytest.raises(ValueError, match="exceed max supported number of dimensions of 2"):
        run(lambda a: nl.transpose(nl.zeros((64, 32, 2), nl.float32)))
    with pytest.raises(ValueError, match="exceed architecture limitation of 128"):
        run(lambda a: nl.transpose(nl.zeros((128, 512), nl.float32)))
