"""simulate.progress reports every grid instance of a launch."""
import numpy as np
import pytest

import simulate
import simulate.language as nl


@simulate.jit
def _copy_rows(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    i = nl.program_id(0)
    tile = nl.load(a[i * 128:(i + 1) * 128, :])
    nl.store(out[i * 128:(i + 1) * 128, :], tile)
    return out


def test_progress_reports_each_instance_in_order():
    seen = []
    a = np.arange(3 * 128 * 4, dtype=np.float32).reshape(3 * 128, 4)
    with simulate.progress(lambda done, total: seen.append((done, total))):
        out = simulate.simulate_kernel(_copy_rows[3], a)
    np.testing.assert_array_equal(out, a)
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_progress_hook_removed_after_context():
    seen = []
    a = np.zeros((128, 4), np.float32)
    with simulate.progress(lambda d, t: seen.append(d)):
        pass
    simulate.simulate_kernel(_copy_rows[1], a)
    assert seen == []


def test_progress_rejects_non_callable():
    with pytest.raises(TypeError, match="callback: expected a callable, got int"):
        with simulate.progress(3):
            pass
