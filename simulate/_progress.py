"""``simulate.progress(callback)``: per-instance progress of SPMD launches (our addition).

Like :func:`simulate.measure`, it is not part of ``neuronxcc.nki``. While the context is active,
``callback(done, total)`` is called after each grid instance of every kernel launch finishes, so a
host tool can show a progress bar over the grid.
"""
from __future__ import annotations

import contextlib

from . import _runtime


@contextlib.contextmanager
def progress(callback):
    """Call ``callback(instances_done, instances_total)`` after every grid instance.

    Parameters
    ----------
    callback : callable
        Receives two ints; ``instances_total`` is the product of the launch grid (1 for an
        un-gridded launch). Exceptions from the callback propagate out of the launch.
    """
    if not callable(callback):
        raise TypeError(f"callback: expected a callable, got {type(callback).__name__}")
    _runtime._progress_hooks.append(callback)
    try:
        yield callback
    finally:
        _runtime._progress_hooks.remove(callback)
