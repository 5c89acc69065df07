"""nki_kernels.port and the namespace selection (NKI_FLASH_API): one kernel source traced through
nki.* (NKI 0.7) and the legacy neuronxcc.nki, with the program size flat in the row length under
both, and the same instruction stream (so the same estimate) through either."""
import ast
import pathlib

import numpy as np
import pytest

import nki_kernels
from host import reference
from host._launch import launch
from nki_kernels import nki as binding
from nki_kernels import port, tiles
from nki_kernels.attention import unfused as ua
from nki_kernels.fused import linear_gelu as lg
from nki_kernels.fused import softmax as sm
from nki_kernels.port import nl

pytestmark = pytest.mark.skipif(binding.BACKEND != "simulate",
                                reason="program sizes and launch records are simulator measures")

#: Modules written against nki_kernels.port (no namespace imported directly).
PORTED = ["fused/softmax.py", "fused/linear_gelu.py", "fused/_onchip.py",
          "attention/unfused.py", "attention/forward.py", "attention/score_mods.py",
          "attention/masks.py", "attention/decode_merge.py", "attention/block_sparse.py",
          "attention/block_sparse_bwd.py", "attention/decode.py", "attention/backward.py"]


def _run(api, monkeypatch, x, target="trn2", **kw):
    import simulate

    monkeypatch.setenv(binding.API_ENV_VAR, api)
    with simulate.measure(target=target) as m:
        y = launch(sm.softmax_kernel, (1,), x, **kw)
    return y, m


@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_softmax_program_flat_in_columns(api, monkeypatch):
    """Streamed rows of 4K and 64K columns (2 and 32 chunks per walk; 2 rows keep the test
    short, the program does not depend on the row count) compile to the same
    program under both namespaces: every walk is a compiled loop (nl.fori_loop in 0.7, where a
    Python loop would unroll 32 copies)."""
    sizes = {}
    for cols in (4096, 65536):
        x = np.random.default_rng(cols).standard_normal((2, cols)).astype(np.float32)
        for algorithm in sm.ALGORITHMS:
            y, m = _run(api, monkeypatch, x, algorithm=algorithm, chunk=tiles.SOFTMAX_CHUNK,
                        resident=False)
            assert m.api == api
            sizes.setdefault(algorithm, set()).add(m.program_instructions)
        assert reference.max_abs_err(y[:2], reference.online_softmax(x[:2])) < 1e-6
    assert all(len(s) == 1 for s in sizes.values()), sizes
    assert sizes["online"] == {17} and sizes["two_pass"] == {16}


def test_same_instructions_and_estimate_through_both_namespaces(monkeypatch):
    """The port issues the same instruction stream through either namespace: equal program,
    instructions, engine cycles and scheduled estimate (a 300 x 5000 bf16 streamed softmax:
    three row tiles, the last partial; chunk tail)."""
    import ml_dtypes

    x = np.random.default_rng(3).standard_normal((300, 5000)).astype(ml_dtypes.bfloat16)
    runs = {api: _run(api, monkeypatch, x, algorithm="online", chunk=2048, resident=False)
            for api in ("legacy", "nki")}
    (y0, a), (y1, b) = runs["legacy"], runs["nki"]
    assert (a.api, b.api) == ("legacy", "nki")
    assert np.array_equal(np.asarray(y0, np.float32), np.asarray(y1, np.float32))
    assert a.program_instructions == b.program_instructions
    assert a.instructions == b.instructions and a.engine_cycles == b.engine_cycles
    assert a.estimated_seconds == b.estimated_seconds


def test_auto_selects_by_target(monkeypatch):
    """auto: legacy on trn1, nki.* on trn2 and trn3 (where no legacy toolchain exists)."""
    import host

    monkeypatch.delenv(binding.API_ENV_VAR, raising=False)
    x = np.random.default_rng(4).standard_normal((4, 300)).astype(np.float32)
    for target, api in (("trn1", "legacy"), ("trn2", "nki"), ("trn3", "nki")):
        assert binding.select_api(target) == api
        import simulate

        with simulate.measure(target=target) as m:
            y = host.online_softmax(x, chunk_size=128)
        assert m.api == api, target
        assert reference.max_abs_err(y, reference.online_softmax(x)) < 1e-6


def test_api_env_var_is_checked(monkeypatch):
    monkeypatch.setenv(binding.API_ENV_VAR, "neuron")
    with pytest.raises(ValueError, match="NKI_FLASH_API: expected one of auto, nki, legacy"):
        binding.select_api("trn2")
    with pytest.raises(ValueError, match="api: expected 'nki' or 'legacy'"):
        binding.namespace("0.7")


class _Poisoned:
    def __getattr__(self, name):
        raise AssertionError(f"the legacy namespace was used in an nki.* trace ({name})")


def _poison_legacy(monkeypatch):
    """Bind the legacy namespace to objects that fail on any use, for this test."""
    poisoned = binding.Namespace("legacy", "simulate", _Poisoned(), _Poisoned(), _Poisoned())
    monkeypatch.setitem(binding._NAMESPACES, "legacy", poisoned)


def _program_sizes(api, runs):
    """``{name: program instructions}`` of each ``(name, launch)`` in ``runs`` on trn2, each
    asserted to have traced through ``api``."""
    import simulate

    sizes = {}
    for name, run in runs:
        with simulate.measure(target="trn2") as m:
            run()
        assert m.api == api
        sizes[name] = m.program_instructions
    return sizes


def test_nki_trace_uses_nothing_of_the_legacy_namespace(monkeypatch):
    """A kernel traced through nki.* touches no legacy object: with the legacy binding
    poisoned, the softmax (resident and streamed, both algorithms) still runs."""
    _poison_legacy(monkeypatch)
    x = np.random.default_rng(5).standard_normal((130, 700)).astype(np.float32)
    ref = reference.online_softmax(x)
    for kw in (dict(resident=True, chunk=700), dict(resident=False, chunk=256),
               dict(resident=False, chunk=256, algorithm="two_pass")):
        y, m = _run("nki", monkeypatch, x, **kw)
        assert m.api == "nki" and reference.max_abs_err(y, ref) < 1e-6


@pytest.mark.parametrize("rel", PORTED)
def test_ported_modules_import_no_namespace(rel):
    """Ported kernels reach NKI through nki_kernels.port only (not neuronxcc, nki, simulate, or
    the legacy names of nki_kernels.nki)."""
    path = pathlib.Path(nki_kernels.__file__).parent / rel
    mods = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mods.append(node.module or "")
        elif isinstance(node, ast.Import):
            mods.extend(a.name for a in node.names)
    bad = [m for m in mods if m.split(".")[0] in ("neuronxcc", "nki", "simulate")
           or m == "nki_kernels.nki"]
    assert not bad, f"{rel} imports {bad}"


@port.jit
def _gather_scatter_kernel(table, rows_idx):
    """Rows ``rows_idx[p]`` of ``table`` gathered (out-of-range ones skipped: they stay -1),
    then scattered into a copy of ``table`` as ``row + 100`` (the out-of-range ones skipped)."""
    from nki_kernels.port import nl

    P, F = rows_idx.shape[0], table.shape[1]
    idx = nl.ndarray((P, 2), dtype=nl.int32, buffer=nl.sbuf)
    port.dma_copy(idx, rows_idx)
    got = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(got, -1.0)
    port.dma_copy(got, port.rows(table, idx, 1), oob_skip=True)
    gathered = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.shared_hbm)
    port.dma_copy(gathered, got)
    out = nl.ndarray(table.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    whole = nl.ndarray(table.shape, dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(whole, table)
    port.dma_copy(out, whole)
    port.tensor_scalar(got, got, op0=nl.add, operand0=100.0)
    port.dma_copy(port.rows(out, idx, 1), got, oob_skip=True)
    return gathered, out


def test_rows_gather_and_scatter_through_both_namespaces(monkeypatch):
    """port.rows: an index-tile subscript in legacy, .ap(vector_offset=) in 0.7; the same
    rows gathered and scattered (out-of-range indices skipped), the same HBM bytes,
    instructions and estimate."""
    import simulate

    table = np.arange(40 * 24, dtype=np.float32).reshape(40, 24)
    idx = np.stack([np.zeros(64), np.random.default_rng(2).integers(0, 48, 64)], 1)
    idx = idx.astype(np.int32)
    keep = idx[:, 1] < 40
    runs = {}
    for api in ("legacy", "nki"):
        with simulate.measure(target="trn2") as m:
            runs[api] = launch(_gather_scatter_kernel.on(api), (1,), table, idx), m
        assert m.api == api
    (g0, o0), m0 = runs["legacy"]
    (g1, o1), m1 = runs["nki"]
    exp = np.full((64, 24), -1.0, np.float32)
    exp[keep] = table[idx[keep, 1]]
    np.testing.assert_array_equal(g0, exp)
    exp_out = table.copy()
    exp_out[idx[keep, 1]] = table[idx[keep, 1]] + 100.0
    np.testing.assert_array_equal(o0, exp_out)
    np.testing.assert_array_equal(g1, g0)
    np.testing.assert_array_equal(o1, o0)
    assert (m0.hbm_bytes_read, m0.hbm_bytes_written) == (m1.hbm_bytes_read, m1.hbm_bytes_written)
    assert m0.instructions == m1.instructions and m0.estimated_seconds == m1.estimated_seconds


@port.jit
def _transposed_rows_kernel(table):
    """Rows 3 .. 7 of ``table[1, 0]``, columns 2 .. 5, transposed into SBUF by one DMA."""
    from nki_kernels.port import nl

    got = nl.ndarray((4, 5), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(got, port.transposed_rows(table, (1, 0), 3, 5, 2, 4))
    out = nl.ndarray((4, 5), dtype=nl.float32, buffer=nl.shared_hbm)
    port.dma_copy(out, got)
    return out


def test_transposed_rows_through_both_namespaces():
    """port.transposed_rows: an arange subscript in legacy, a permuted view in 0.7; the
    same [columns, rows] tile."""
    table = np.arange(2 * 1 * 9 * 7, dtype=np.float32).reshape(2, 1, 9, 7)
    for api in ("legacy", "nki"):
        out = launch(_transposed_rows_kernel.on(api), (1,), table)
        np.testing.assert_array_equal(np.asarray(out), table[1, 0, 3:8, 2:6].T)


def test_port_loop_outside_a_trace_is_legacy():
    """Kernels not ported yet call port (through _onchip) inside their legacy nki.jit: outside
    port.tracing the namespace is the legacy binding, as before."""
    assert port.current().api == "legacy"
    assert port.current() is binding.namespace("legacy")


def test_auto_on_trn2_falls_back_to_legacy_with_only_neuronx_cc(monkeypatch):
    """auto with neuronx-cc 2.20-2.24 and no AWS nki package: trn2 stays on the legacy
    toolchain (the device), not the nki.* simulator; with the nki package, nki.*."""
    monkeypatch.delenv(binding.API_ENV_VAR, raising=False)
    monkeypatch.setattr(binding, "_choice", "auto")
    monkeypatch.setattr(binding, "BACKEND", "neuron")
    monkeypatch.setattr(binding, "_real_nki_importable", lambda: False)
    assert binding.select_api("trn2") == "legacy"
    monkeypatch.setattr(binding, "_real_nki_importable", lambda: True)
    assert binding.select_api("trn2") == "nki"
    assert binding.select_api("trn1") == "legacy"


def test_trn3_with_only_neuronx_cc_says_what_to_install(monkeypatch):
    """trn3 has no legacy toolchain: with only neuronx-cc installed, one line says what to
    install (or to use the simulator) instead of a legacy trace that cannot target it."""
    monkeypatch.delenv(binding.API_ENV_VAR, raising=False)
    monkeypatch.setattr(binding, "_choice", "auto")
    monkeypatch.setattr(binding, "BACKEND", "neuron")
    monkeypatch.setattr(binding, "_real_nki_importable", lambda: False)
    with pytest.raises(ImportError, match="trn3 runs only nki.* kernels .* pip install"):
        binding.select_api("trn3")


def test_trn1_with_only_aws_nki_says_what_to_install(monkeypatch):
    """trn1 runs only the legacy namespace: with AWS's nki installed and no neuronx-cc, the
    legacy names fell back to the simulator, so one line says what to install instead of a
    silent CPU run; NKI_FLASH_BACKEND=simulate keeps the simulator."""
    monkeypatch.delenv(binding.API_ENV_VAR, raising=False)
    monkeypatch.setattr(binding, "_choice", "auto")
    monkeypatch.setattr(binding, "BACKEND", "simulate")
    monkeypatch.setattr(binding, "_real_nki_importable", lambda: True)
    with pytest.raises(ImportError, match="trn1 runs only legacy neuronxcc.nki .* pip install"):
        binding.select_api("trn1")
    monkeypatch.setattr(binding, "_choice", "simulate")
    assert binding.select_api("trn1") == "legacy"


# -- GELU(x @ W + b): fused and the unfused three kernels -----------------------------------------

def _linear_inputs(M, K, N, seed=0):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    return (rng.standard_normal((M, K)).astype(bf16),
            (rng.standard_normal((K, N)) / np.sqrt(K)).astype(bf16),
            rng.standard_normal(N).astype(bf16))


def _linear_programs(api, monkeypatch, M, K, N, blocks, elementwise):
    """Program size of each linear_gelu kernel at one problem size (bf16); the element-wise
    kernels (bias add, GELU) on an input of shape ``elementwise`` (None: not run)."""
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    x, w, b = _linear_inputs(M, K, N)
    opts = dict(mm_dtype="bfloat16", block_m=blocks[0], block_n=blocks[1])
    runs = [("fused", lambda: launch(lg.linear_gelu_fused, (1,), x, w, b, **opts)),
            ("matmul", lambda: launch(lg.matmul_kernel, (1,), x, w, **opts))]
    if elementwise:
        z, _, b_e = _linear_inputs(*elementwise, elementwise[1])
        runs += [("bias_add", lambda: launch(lg.bias_add_kernel, (1,), z, b_e)),
                 ("gelu", lambda: launch(lg.gelu_kernel, (1,), z))]
    return _program_sizes(api, runs)


@pytest.mark.parametrize("api", ["legacy", "nki"])
@pytest.mark.parametrize("blocks", [(256, 512), (0, 0)], ids=["blocked", "streaming"])
def test_linear_gelu_program_flat_in_problem_size(api, blocks, monkeypatch):
    """Every walk over rows, columns and contraction tiles is a compiled loop under both
    namespaces: doubling M, N and K (3 -> 5 contraction tiles, 2 -> 4 row blocks, 2 -> 4
    column blocks; the element-wise kernels 2 -> 4 row and column tiles; the tails alike)
    leaves every kernel's program size unchanged."""
    ew = blocks[0] != 0        # the element-wise kernels do not depend on the blocking
    cols = tiles.ELEMENTWISE_COLS
    small = _linear_programs(api, monkeypatch, 512 + 40, 384 + 40, 1024 + 40, blocks,
                             ew and (2 * 128 + 40, 2 * cols + 40))
    large = _linear_programs(api, monkeypatch, 1024 + 40, 640 + 40, 2048 + 40, blocks,
                             ew and (4 * 128 + 40, 4 * cols + 40))
    assert small == large, (small, large)


def test_linear_gelu_same_instructions_through_both_namespaces(monkeypatch):
    """Same program and instruction counts through either namespace (the engine cycles differ
    by design: 0.7's TensorE transposes write PSUM in the input dtype, legacy's fp32; see
    port.transpose_dtype). Outputs agree to bf16 rounding."""
    import simulate

    x, w, b = _linear_inputs(200, 300, 600, seed=1)
    runs = {}
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            y = launch(lg.linear_gelu_fused, (1,), x, w, b, mm_dtype="bfloat16",
                       block_m=256, block_n=512)
        runs[api] = (np.asarray(y, np.float32), m)
    (y0, a), (y1, c) = runs["legacy"], runs["nki"]
    assert (a.api, c.api) == ("legacy", "nki")
    assert a.program_instructions == c.program_instructions
    assert a.instructions == c.instructions
    assert a.hbm_bytes_read == c.hbm_bytes_read and a.hbm_bytes_written == c.hbm_bytes_written
    assert np.abs(y0 - y1).max() <= 2e-2 * np.abs(y0).max()


def test_linear_gelu_nki_trace_uses_nothing_of_the_legacy_namespace(monkeypatch):
    """With the legacy binding poisoned, the fused kernel (blocked and streaming) and the three
    unfused kernels still run through nki.*."""
    _poison_legacy(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    x, w, b = _linear_inputs(130, 300, 200, seed=2)
    ref = reference.linear_gelu(x, w, b)
    for blocks in ((128, 512), (0, 0)):
        opts = dict(mm_dtype="bfloat16", block_m=blocks[0], block_n=blocks[1])
        y = launch(lg.linear_gelu_fused, (1,), x, w, b, **opts)
        assert reference.max_abs_err(y, ref) < 0.05
        z = launch(lg.matmul_kernel, (1,), x, w, **opts)
        y2 = launch(lg.gelu_kernel, (1,), launch(lg.bias_add_kernel, (1,), z, b))
        assert reference.max_abs_err(y2, ref) < 0.05


# -- iota / affine_select: 0.7's pattern form in both namespaces ----------------------------------

@port.jit
def _pattern_kernel(x):
    """iota of ``3 + 2p - j`` and affine_select of ``x`` where ``p - j + 5 >= 0`` (fill -7)."""
    P, F = x.shape
    out = nl.ndarray((2 * P, F), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(t, x)
    ramp = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(ramp, [[-1, F]], offset=3, channel_multiplier=2)
    port.dma_copy(out[0:P, 0:F], ramp)
    sel = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
    port.affine_select(sel, [[-1, F]], 1, t, -7.0, nl.greater_equal, offset=5)
    port.dma_copy(out[P:2 * P, 0:F], sel)
    return out


@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_iota_and_affine_select_patterns(api, monkeypatch):
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    x = np.random.default_rng(6).standard_normal((16, 40)).astype(np.float32)
    out = launch(_pattern_kernel, (1,), x)
    p, j = np.mgrid[0:16, 0:40]
    assert np.array_equal(out[:16], 3 + 2 * p - j)
    assert np.array_equal(out[16:], np.where(p - j + 5 >= 0, x, -7.0))


@port.jit
def _groups_kernel(a, b):
    """Three accumulation groups (a compiled loop), each opened by :func:`port.open_group`
    from one zero row of the kernel (:func:`port.group_zero_row`), then ``+= a^T b`` twice
    with ``accumulate=True``."""
    out = nl.ndarray((3, 128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    zero = port.group_zero_row(128)
    x = nl.ndarray((32, 128), dtype=a.dtype, buffer=nl.sbuf)
    port.dma_copy(x, a)
    y = nl.ndarray((32, 64), dtype=b.dtype, buffer=nl.sbuf)
    port.dma_copy(y, b)

    def group(i):
        ps = port.group_alloc()((128, 64), dtype=nl.float32, buffer=nl.psum)
        port.open_group(ps, zero)
        port.nc_matmul(ps, x, y, accumulate=True)
        port.nc_matmul(ps, x, y, accumulate=True)
        res = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(res, ps, engine="vector")
        port.dma_copy(out[i], res)

    port.loop(3, group)
    return out


@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_open_group_starts_from_zero_with_one_fill_per_kernel(api, monkeypatch):
    """An opened group sums from zero in both namespaces. nki.*: its PSUM tile is not filled
    (the opening matmul writes every element) and the zero row is filled once for every
    group, so VectorE runs the three copies and one fill, TensorE three openings and six
    products; legacy: a zero fill per group (``nl.zeros``, its idiom), no opening matmul."""
    import simulate

    monkeypatch.setenv(binding.API_ENV_VAR, api)
    rng = np.random.default_rng(8)
    a = rng.standard_normal((32, 128)).astype(np.float32)
    b = rng.standard_normal((32, 64)).astype(np.float32)
    with simulate.measure(target="trn2") as m:
        out = launch(_groups_kernel, (1,), a, b)
    np.testing.assert_allclose(out, np.broadcast_to(2 * a.T @ b, (3, 128, 64)), rtol=1e-5,
                               atol=1e-4)
    want = {"vector": 4, "tensor": 9} if api == "nki" else {"vector": 6, "tensor": 6}
    assert {e: m.instructions[e] for e in want} == want


@port.jit
def _runtime_iota_kernel(exact):
    """``5 + p + j + i (2^27 + 3)`` (int32 ``[2, 8]``) for the loop index i in [0, 4): a runtime
    offset beyond 2^24, read under 0.7 from an :class:`port.OffsetColumns` (``exact`` or not)."""
    out = nl.ndarray((4, 2, 8), dtype=nl.int32, buffer=nl.shared_hbm)
    idx = port.OffsetColumns(0, 4, 1, exact=exact)

    def body(i):
        t = nl.ndarray((2, 8), dtype=nl.int32, buffer=nl.sbuf)
        port.iota(t, [[1, 8]], offset=5, channel_multiplier=1, runtime=[(i, 2 ** 27 + 3)],
                  offsets=idx)
        port.dma_copy(out[i], t)

    port.loop(4, body)
    return out


def test_exact_runtime_offsets_beyond_fp32(monkeypatch):
    """Runtime offsets of an integer iota past 2^24: exact in legacy (index expressions) and,
    from an ``exact`` OffsetColumns, under nki.* (int32 sums on GpSimd); the fp32 form of 0.7
    rounds them (why ``exact`` exists: the forward's row and dropout-unit numbers)."""
    i, p, j = np.mgrid[0:4, 0:2, 0:8]
    want = 5 + p + j + i * (2 ** 27 + 3)
    got = {}
    for api, exact in (("legacy", True), ("nki", True), ("nki", False)):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        got[api, exact] = launch(_runtime_iota_kernel, (1,), exact=exact)
    np.testing.assert_array_equal(got["legacy", True], want)
    np.testing.assert_array_equal(got["nki", True], want)
    assert not np.array_equal(got["nki", False], want)


# -- standard (unfused) attention: kernels 1 and 3 ------------------------------------------------

def _unfused_programs(api, monkeypatch, B, Hq, Hkv, Nq, Nk):
    """Program size of the score and PV kernels (bf16, D 64, bottom_right causal, 1024-key
    blocks, V streamed)."""
    import ml_dtypes

    monkeypatch.setenv(binding.API_ENV_VAR, api)
    rng = np.random.default_rng(Nq)
    q = rng.standard_normal((B, Hq, Nq, 64)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((B, Hkv, Nk, 64)).astype(ml_dtypes.bfloat16)
    p = rng.random((B, Hq, Nq, Nk)).astype(ml_dtypes.bfloat16)
    grid = ua.grid(B, Hq, Hkv, api)
    return _program_sizes(api, (
        ("scores", lambda: launch(ua.attention_scores_kernel, grid, q, k,
                                  causal_offset=Nk - Nq, kv_block=1024)),
        ("pv", lambda: launch(ua.attention_pv_kernel, grid, p, k, v_resident=False))))


@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_unfused_attention_program_flat_in_sequence_length(api, monkeypatch):
    """Every walk over key blocks, query tiles, key tiles, P chunks and heads is a compiled loop:
    doubling Nq and Nk (2 -> 4 query tiles, key blocks and P chunks, the tails alike) and the
    heads (one -> four, GQA 2:1, B 2: nl.program_id in legacy, a compiled loop in nki.*) leaves
    both kernels' program sizes unchanged; the causal diagonal moves at run time."""
    small = _unfused_programs(api, monkeypatch, 1, 1, 1, 2 * 128 + 44, 2 * 1024 + 40)
    large = _unfused_programs(api, monkeypatch, 2, 2, 1, 4 * 128 + 44, 4 * 1024 + 40)
    assert small == large, (small, large)


def test_unfused_attention_nki_trace_uses_nothing_of_the_legacy_namespace(monkeypatch):
    """With the legacy binding poisoned, host.attention_unfused (GQA 4:2, batch 2, causal
    bottom_right with Nq > Nk) runs through nki.* and matches the reference."""
    import host

    _poison_legacy(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 150, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 130, 32)).astype(np.float32) for _ in range(2))
    o = host.attention_unfused(q, k, v, causal="bottom_right", mixed_precision=False)
    ref = reference.attention_forward(q, k, v, causal="bottom_right")[0]
    assert reference.max_abs_err(o, ref) < 1e-4
    assert np.all(o[..., :20, :] == 0)


# -- the flash attention forward --------------------------------------------------------------

def _forward_program(api, monkeypatch, Nq, Nk=None, target="trn2", **mask):
    """Measurement and output of the forward at ``Nq`` queries and ``Nk`` (default Nq) keys
    (bf16, D = 64, GQA 2:1, one core)."""
    import ml_dtypes
    import simulate

    import host

    Nk = Nq if Nk is None else Nk
    rng = np.random.default_rng(Nq + Nk)
    q = rng.standard_normal((1, 2, Nq, 64)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((1, 1, Nk, 64)).astype(ml_dtypes.bfloat16) for _ in range(2))
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    with simulate.measure(target=target) as m:
        o = host.flash_attention(q, k, v, lnc=1, **mask)
    assert m.api == api
    return m, o


@pytest.mark.parametrize("api", ["legacy", "nki"])
@pytest.mark.parametrize("mask,sizes", [
    ({}, ((2048, 2048), (4096, 4096))),
    ({"window": (300, 0)}, ((2048, 2048), (4096, 4096))),
    ({"causal": "bottom_right"}, ((1024, 3072), (1024, 5120))),
    ({"causal": "bottom_right", "kv_lens": [1000], "q_lens": [700]},
     ((1024, 3072), (1024, 5120))),
], ids=["dense", "window", "causal", "lens"])
def test_forward_program_flat_in_sequence_length(api, mask, sizes, monkeypatch):
    """Every loop of the forward over query tiles, key blocks and K/V pieces -- and, under
    nki.*, over the (batch, kv head) instances -- is a compiled loop: twice the tiles and key
    blocks compile to the same program under both namespaces. (A causal band's program grows
    with Nq until its FWD_Q_SPANS spans hold whole query groups, under either namespace:
    tests/kernels/test_forward.py.)"""
    small, _ = _forward_program(api, monkeypatch, *sizes[0], **mask)
    large, _ = _forward_program(api, monkeypatch, *sizes[1], **mask)
    assert small.program_instructions == large.program_instructions < 2000
    # the work does grow: TensorE runs a matmul per key block
    assert large.instructions["tensor"] > 1.5 * small.instructions["tensor"]


def test_forward_nki_trace_uses_nothing_of_the_legacy_namespace(monkeypatch):
    """With the legacy binding poisoned, the forward (dense, causal with ALiBi, windowed with
    softcap and sinks, runtime lengths, and lengths with ALiBi and dropout) still runs through
    nki.* (trn2 and trn3)."""
    _poison_legacy(monkeypatch)
    slopes = np.array([0.5, 0.25], np.float32)
    for target, mask in (("trn2", {}), ("trn2", dict(causal=True, alibi_slopes=slopes)),
                         ("trn3", dict(window=(100, 20), softcap=30.0,
                                       sinks=np.array([0.5, 1.0], np.float32))),
                         ("trn2", dict(causal="bottom_right", kv_lens=[200], q_lens=[150])),
                         ("trn2", dict(kv_lens=[170], q_lens=[300], alibi_slopes=slopes,
                                       dropout_p=0.1, seed=5))):
        m, o = _forward_program("nki", monkeypatch, 300, target=target, **mask)
        assert m.api == "nki" and np.isfinite(np.asarray(o, np.float32)).all()


def test_backward_nki_trace_uses_nothing_of_the_legacy_namespace(monkeypatch):
    """With the legacy binding poisoned, the backward (causal with ALiBi and dropout, windowed
    with softcap and sinks, dQ in HBM, runtime lengths) still runs through nki.* (trn2 and
    trn3)."""
    import ml_dtypes
    import simulate

    from nki_kernels.attention.backward import backward_grid, flash_attn_bwd

    _poison_legacy(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    rng = np.random.default_rng(8)
    q, k, v, do, o = (rng.standard_normal((1, 2, 300, 64)).astype(ml_dtypes.bfloat16)
                      for _ in range(5))
    lse = np.full((1, 2, 300), 5.0, np.float32)
    slopes, sinks = np.array([0.5, 0.25], np.float32), np.array([0.5, 1.0], np.float32)
    for target, opts in (("trn2", dict(causal="bottom_right", alibi_slopes=slopes,
                                       dropout_p=0.1, seed=np.array([3], np.int32))),
                         ("trn3", dict(window=(100, 20), softcap=30.0, sinks=sinks,
                                       dq_accumulate="hbm")),
                         ("trn2", dict(causal="bottom_right", kv_lens=np.array([250], np.int32),
                                       q_lens=np.array([200], np.int32)))):
        with simulate.measure(target=target) as m:
            outs = launch(flash_attn_bwd, backward_grid(1, 1, 1, api="nki"), q, k[:, :1],
                          v[:, :1], o, do, lse, scale=0.125, **opts)
        assert m.api == "nki"
        assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in outs)


def test_block_sparse_nki_trace_uses_nothing_of_the_legacy_namespace(monkeypatch):
    """With the legacy binding poisoned, the block-sparse forward and backward (GQA, runtime
    lengths with a band, dropout: every path whose 0.7 trace differs) still run through
    nki.*."""
    import host
    from host import block_sparse as bs

    _poison_legacy(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    rng = np.random.default_rng(6)
    q, do = (rng.standard_normal((1, 2, 300, 32)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 300, 32)).astype(np.float32) for _ in range(2))
    kw = dict(block_mask=bs.butterfly(3, 3), causal=True, kv_lens=[250], q_lens=[280],
              dropout_p=0.2, seed=3)
    o, lse = host.flash_attention(q, k, v, return_lse=True, **kw)
    grads = host.flash_attention_backward(do, q, k, v, o, lse, **kw)
    assert all(np.isfinite(x).all() for x in (o, *grads))
