"""``nki-flash bench`` (host/bench.py) on a tiny sweep: table, CSV, JSON, plots, formulas."""
import csv
import json
import re
import subprocess
import sys

import pytest

from host import bench, reference
from nki_kernels.nki import BACKEND

needs_simulator = pytest.mark.skipif(BACKEND != "simulate",
                                     reason="the bench measures with simulate.measure")

TINY = ["--seqs", "128,256", "--block-seq", "512", "--block-groups", "1,2,0", "--gelu-k", "64",
        "--softmax-cols", "4096", "--quiet"]


def _rows(out):
    with open(out / "results.csv") as fh:
        return list(csv.DictReader(fh))


@needs_simulator
def test_tiny_sweep_writes_table_csv_json_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert bench.main_bench(["--out", str(tmp_path)] + TINY) == 0
    text = capsys.readouterr().out
    assert "study" in text and "HBM bytes" in text
    rows = _rows(tmp_path)
    kinds = {(r["study"], r["variant"]) for r in rows}
    assert kinds == {("attention", "flash"), ("attention", "unfused"), ("block", "flash"),
                     ("gelu", "fused"), ("gelu", "unfused"), ("softmax", "online"),
                     ("softmax", "two_pass")}
    for r in rows:
        assert int(r["hbm_bytes"]) == int(r["hbm_read"]) + int(r["hbm_written"]) > 0
        assert 0 < float(r["modeled_us_overlap"]) <= float(r["modeled_us_serial"])
    # standard attention moves exactly the paper's count; the formulas sit beside it
    for r in rows:
        if r["study"] == "attention" and r["variant"] == "unfused":
            N, d = int(r["N"]), int(r["D"])
            assert int(r["hbm_bytes"]) == int(r["formula_bytes"]) == 8 * N * d + 8 * N * N
        if r["study"] in ("gelu", "softmax", "block"):
            assert abs(int(r["hbm_bytes"]) / int(r["formula_bytes"]) - 1) < 0.01
    # flash: resident K/V reads everything once; one query tile per pass reads K/V 4 times
    block = {int(r["x"]): int(r["hbm_bytes"]) for r in rows if r["study"] == "block"}
    assert block[512] == reference.io_lower_bound_bytes(1, 1, 1, 512, 512, 64, 2)
    assert block[128] > block[256] > block[512]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["target"] == "trn2" and len(data["rows"]) == len(rows)
    for name in ("attention_hbm_bytes.png", "attention_modeled_time.png",
                 "flash_block_size.png", "gelu_fusion.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert re.search(r"gelu: .* unfused/fused HBM bytes = (2\.9\d|3\.0\d)x", text)


@needs_simulator
def test_plots_skipped_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = ["--out", str(tmp_path), "--studies", "gelu", "--gelu-k", "64", "--quiet"]
    assert bench.main_bench(args) == 0
    assert "plots skipped: matplotlib is not installed" in capsys.readouterr().out
    assert len(_rows(tmp_path)) == 2 and not list(tmp_path.glob("*.png"))


def test_progress_bar_is_plain_text():
    import io

    buf = io.StringIO()
    bar = bench.Progress(2, stream=buf)
    bar.step("a")
    bar.advance()
    bar.step("b")
    bar.advance()
    bar.close()
    assert "[###############...............] 1/2" in buf.getvalue()
    assert buf.getvalue().endswith("\n")


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit):
        bench.main_bench(["--seqs", "0,128"])
    assert "expected integers >= 1" in capsys.readouterr().err


def test_runs_as_module_help():
    out = subprocess.run([sys.executable, "-m", "host.bench", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--out DIR" in out and "--large" in out
