"""Kernels written exactly the way NKI's documentation writes them (legacy neuronxcc.nki).

This module imports the *real* package names; it must be imported only after
``simulate.register_as_neuronxcc()`` (see test_register.py), so it runs unchanged on the CPU.
"""
import math

import numpy as np

import neuronxcc.nki as nki
import neuronxcc.nki.language as nl
import neuronxcc.nki.isa as nisa
from neuronxcc.nki.language import par_dim


# --- SPMD tensor addition (tutorial "spmd_tensor_addition") ----------------------------------
@nki.jit
def nki_tensor_add_kernel_(a_input, b_input):
    """c = a + b for one 128 x 512 tile per SPMD instance."""
    c_output = nl.ndarray(a_input.shape, dtype=a_input.dtype, buffer=nl.shared_hbm)

    offset_i_x = nl.program_id(0) * 128
    offset_i_y = nl.program_id(1) * 512

    ix = offset_i_x + nl.arange(128)[:, None]
    iy = offset_i_y + nl.arange(512)[None, :]

    a_tile = nl.load(a_input[ix, iy])
    b_tile = nl.load(b_input[ix, iy])
    c_tile = a_tile + b_tile
    nl.store(c_output[ix, iy], value=c_tile)
    return c_output


def nki_tensor_add(a_input, b_input):
    grid_x = a_input.shape[0] // 128
    grid_y = a_input.shape[1] // 512
    return nki_tensor_add_kernel_[grid_x, grid_y](a_input, b_input)


# --- K-tiled matmul accumulating in PSUM (tutorial "matrix_multiplication") -----------------
@nki.jit
def nki_matmul_tiled_(lhsT, rhs):
    """result[M, N] = lhsT[K, M].T @ rhs[K, N]."""
    K, M = lhsT.shape
    K_, N = rhs.shape
    assert K == K_, "lhsT and rhs must have the same contraction dimension"
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)

    TILE_M = nl.tile_size.gemm_stationary_fmax  # 128
    TILE_K = nl.tile_size.pmax  # 128
    TILE_N = nl.tile_size.gemm_moving_fmax  # 512

    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            res_psum = nl.zeros((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                lhsT_tile = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                rhs_tile = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                lhsT_tile[...] = nl.load(lhsT[k * TILE_K:(k + 1) * TILE_K,
                                              m * TILE_M:(m + 1) * TILE_M])
                rhs_tile[...] = nl.load(rhs[k * TILE_K:(k + 1) * TILE_K,
                                            n * TILE_N:(n + 1) * TILE_N])
                res_psum += nl.matmul(lhsT_tile, rhs_tile, transpose_x=True)
            res_sb = nl.copy(res_psum, dtype=result.dtype)
            nl.store(result[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N],
                     value=res_sb)
    return result


@nki.jit
def nki_matmul_isa_(lhsT, rhs):
    """Same with nisa.nc_matmul and block-dim SBUF buffers holding all K tiles."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    nk = K // 128
    for m in nl.affine_range(M // 128):
        lhsT_tiles = nl.ndarray((nk, par_dim(128), 128), dtype=lhsT.dtype, buffer=nl.sbuf)
        for k in nl.affine_range(nk):
            lhsT_tiles[k] = nl.load(lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
        for n in nl.affine_range(N // 512):
            res_psum = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(nk):
                rhs_tile = nl.load(rhs[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                res_psum += nisa.nc_matmul(lhsT_tiles[k, :, :], rhs_tile)
            nl.store(result[m * 128:(m + 1) * 128, n * 512:(n + 1) * 512],
                     value=nisa.tensor_copy(res_psum))
    return result


# --- row softmax with a masked partial last tile -------------------------------------------
@nki.jit
def softmax_rows_kernel(x):
    """out[i, :] = softmax(x[i, :]); rows tiled by 128, the last tile masked."""
    N, D = x.shape
    out = nl.ndarray((N, D), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(128)[:, None]
    i_f = nl.arange(D)[None, :]
    for t in nl.affine_range((N + 127) // 128):
        rows = t * 128 + i_p
        x_tile = nl.load(x[rows, i_f], mask=(rows < N))
        row_max = nisa.tensor_reduce(np.max, data=x_tile, axis=(1,), negate=True,
                                     mask=(rows < N))
        row_sum = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        exp_tile = nisa.activation_reduce(op=nl.exp, data=x_tile, bias=row_max,
                                          reduce_op=nl.add, reduce_res=row_sum,
                                          mask=(rows < N))
        inv_sum = nisa.reciprocal(row_sum, mask=(rows < N))
        y = nl.multiply(exp_tile, inv_sum, mask=(rows < N))
        nl.store(out[rows, i_f], value=y, mask=(rows < N))
    return out


# --- layernorm with bn_stats / bn_aggr (tutorial "layernorm", v2) ---------------------------
@nki.jit
def nki_layernorm_kernel_v2(input_tensor, epsilon, gamma_vector, beta_vector):
    output_tensor = nl.ndarray(input_tensor.shape, dtype=input_tensor.dtype,
                               buffer=nl.shared_hbm)
    num_rows = input_tensor.shape[0]
    hidden_size = input_tensor.shape[1]
    assert hidden_size % nl.tile_size.bn_stats_fmax == 0 or hidden_size < 512

    i_p_io = nl.arange(nl.tile_size.pmax)[:, None]
    i_f_io = nl.arange(hidden_size)[None, :]
    i_p_param = nl.arange(1)[:, None]

    shift_scale_tensor = nl.ndarray((1, 2 * hidden_size), dtype=gamma_vector.dtype)
    shift_scale_tensor[i_p_param, i_f_io] = nl.load(
        gamma_vector.reshape((1, hidden_size))[i_p_param, i_f_io])
    shift_scale_tensor[i_p_param, hidden_size + i_f_io] = nl.load(
        beta_vector.reshape((1, hidden_size))[i_p_param, i_f_io])

    bn_fmax = min(nl.tile_size.bn_stats_fmax, hidden_size)
    num_bn_stats = hidden_size // bn_fmax
    i_f_bn = nl.arange(bn_fmax)[None, :]
    i_f_stats = nl.arange(6)[None, :]

    for i in nl.affine_range(math.ceil(num_rows / nl.tile_size.pmax)):
        rows = i * nl.tile_size.pmax + i_p_io
        input_sb = nl.load(input_tensor[rows, i_f_io], mask=(rows < num_rows))

        stats_results = nl.ndarray((nl.tile_size.pmax, 6 * num_bn_stats), dtype=np.float32)
        for j in nl.affine_range(num_bn_stats):
            stats_results[i_p_io, j * 6 + i_f_stats] = nisa.bn_stats(
                input_sb[i_p_io, j * bn_fmax + i_f_bn], mask=(rows < num_rows),
                dtype=np.float32)
        mean_var = nisa.bn_aggr(stats_results, mask=(rows < num_rows))
        mean = mean_var[i_p_io, 0]
        var = mean_var[i_p_io, 1]
        rstd = nisa.activation(op=nl.rsqrt, data=var, bias=nl.full((128, 1), epsilon,
                                                                     nl.float32),
                               mask=(rows < num_rows))
        normed = nisa.tensor_scalar(data=input_sb, op0=np.subtract, operand0=mean,
                                    op1=np.multiply, operand1=rstd, mask=(rows < num_rows))
        gamma = shift_scale_tensor[i_p_param, i_f_io].broadcast_to((nl.tile_size.pmax,
                                                                   hidden_size))
        beta = shift_scale_tensor[i_p_param, hidden_size + i_f_io].broadcast_to(
            (nl.tile_size.pmax, hidden_size))
        output_sb = nl.add(nl.multiply(normed, gamma, mask=(rows < num_rows)), beta,
                           mask=(rows < num_rows))
        nl.store(output_tensor[rows, i_f_io], value=output_sb, mask=(rows < num_rows))
    return output_tensor


# --- 2.20-style kernel: output passed by reference -----------------------------------------
def legacy_add_kernel(a_input, b_input, c_output):
    ix = nl.arange(a_input.shape[0])[:, None]
    iy = nl.arange(a_input.shape[1])[None, :]
    nl.store(c_output[ix, iy], nl.load(a_input[ix, iy]) + nl.load(b_input[ix, iy]))
