"""Shared by the benchmark scripts (run as ``python benchmarks/<name>.py``): puts the repository
on ``sys.path``, gives the per-NeuronCore hardware numbers of the simulator's table (one home:
``simulate/_hw.py``) and writes results as JSON."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from simulate import _hw  # noqa: E402

#: The targets the benchmarks sweep (canonical names of the simulator's table).
TARGETS = ("trn1", "trn2")


def hardware(target: str) -> "_hw.Target":
    """The simulator's row for ``target``: ``clock_hz``, ``tensor_peak_flops``,
    ``dma_bytes_per_s``, ``hbm_share_bytes_per_s``."""
    return _hw.get_target(target)


def write_json(path, rows, indent=1):
    """Write the benchmark's result rows to ``path`` (nothing when ``path`` is empty)."""
    if path:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=indent)
