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
from nki_kernels.fused import softmax as sm

pytestmark = pytest.mark.skipif(binding.BACKEND != "simulate",
                                reason="program sizes and launch records are simulator measures")

#: Modules written against nki_kernels.port (no namespace imported directly).
PORTED = ["fused/softmax.py"]


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


def test_nki_trace_uses_nothing_of_the_legacy_namespace(monkeypatch):
    """A kernel traced through nki.* touches no legacy object: with the legacy binding
    poisoned, the softmax (resident and streamed, both algorithms) still runs."""
    poisoned = binding.Namespace("legacy", "simulate", _Poisoned(), _Poisoned(), _Poisoned())
    monkeypatch.setitem(binding._NAMESPACES, "legacy", poisoned)
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
           or m in ("nki_kernels.nki", "nki_kernels.fused._onchip")]
    assert not bad, f"{rel} imports {bad}"


def test_port_loop_outside_a_trace_is_legacy():
    """Kernels not ported yet call port.for_tiles through _onchip: outside port.tracing the
    namespace is the legacy binding, as before."""
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
