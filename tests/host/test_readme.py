"""The README's NumPy example runs as written."""
import pathlib
import re
import textwrap

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _python_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    matches = [b for b in blocks if marker in b]
    assert len(matches) == 1, f"expected one README python block containing {marker!r}"
    return matches[0]


def test_numpy_api_example_runs():
    scope: dict = {}
    exec(compile(_python_block("host.flash_attention("), "README.md", "exec"), scope)
    o, lse, dq, o_new, y, p = (scope[n] for n in ("o", "lse", "dq", "o_new", "y", "p"))
    assert o.shape == (2, 8, 300, 128) and lse.shape == (2, 8, 300)
    assert np.isneginf(lse[1, :, 113:]).all()          # padded query rows
    assert np.all(np.asarray(o[1, :, 113:], np.float32) == 0)
    assert np.isfinite(np.asarray(dq, np.float32)).all()
    assert o_new.shape == (2, 8, 1, 128)
    assert y.shape == (256, 384)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-5)


def _all_python_blocks():
    # blocks inside list items are indented: dedent them
    return [textwrap.dedent(b) for b in
            re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)]


def test_every_readme_python_block_runs_as_written():
    """Each block runs on its own, in a fresh namespace (no block borrows another's names)."""
    import sys

    blocks = _all_python_blocks()
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        if "torch" in block:
            pytest.importorskip("torch")
        if "import transformers" in block:
            pytest.importorskip("transformers")
        had_alias = "neuronxcc" in sys.modules
        try:
            exec(compile(block, f"README.md block {i}", "exec"), {"__name__": f"readme_{i}"})
        finally:
            if "register_as_neuronxcc" in block and not had_alias:
                import simulate

                simulate.unregister_neuronxcc()


def test_readme_torch_block_trains():
    pytest.importorskip("torch")
    scope: dict = {}
    exec(compile(_python_block("scaled_dot_product_attention("), "README.md", "exec"), scope)
    assert scope["o"].shape == (2, 8, 256, 64) and scope["q"].grad is not None
    assert scope["k"].grad.shape == (2, 2, 256, 64)
