"""The ``nki-flash`` command: the main job's report, JSON output, exit status, bad input."""
import json

import numpy as np
import pytest

import host
from host import cli
from nki_kernels.nki import BACKEND

SMALL = ["run", "--batch", "1", "--heads", "4", "--kv-heads", "2", "--seq", "200", "--dim", "64",
         "--quiet"]
needs_sim = pytest.mark.skipif(BACKEND != "simulate", reason="measurements need the simulator")


@needs_sim
def test_run_reports_check_io_and_modeled_time(capsys, tmp_path):
    out_json = tmp_path / "report.json"
    assert cli.main(SMALL + ["--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text
    assert "1.000x the IO lower bound" in text
    assert "unfused attention would move" in text
    assert "trn1" in text and "trn2" in text
    report = json.loads(out_json.read_text())
    assert report["passed"] is True
    assert report["max_abs_err_o"] <= report["tolerance_o"]
    for target in ("trn1", "trn2"):
        entry = report["targets"][target]
        lo, hi = entry["modeled_seconds"]
        assert 0 < lo <= hi
        assert entry["hbm_bytes_read"] + entry["hbm_bytes_written"] == report["io_lower_bound_bytes"]
        assert 0 < entry["utilization"][0] <= entry["utilization"][1] <= 1
        # program size and SBUF peak per kernel (issue 11 item 3, issue 12 item 4)
        (row,) = entry["kernels"]
        assert row["name"] == "flash_attention_fwd" and row["launches"] == 1
        assert 0 < row["program_instructions"] == entry["program_instructions"]
        assert entry["program_instructions"] <= entry["executed_instructions"]
        assert 0 < row["peak_sbuf_bytes_per_partition"] <= entry["sbuf_capacity_bytes_per_partition"]
    assert "kernel flash_attention_fwd: program" in text and "peak SBUF" in text


@needs_sim
def test_run_with_masks_and_padding(capsys):
    args = ["run", "--batch", "2", "--heads", "2", "--kv-heads", "1", "--seq-q", "70",
            "--seq-k", "150", "--dim", "32", "--causal", "top_left", "--window", "40", "-1",
            "--kv-lens", "150,90", "--q-lens", "70,33", "--dtype", "float16", "--quiet",
            "--targets", "trn2"]
    assert cli.main(args) == 0
    assert "PASS" in capsys.readouterr().out


@needs_sim
def test_run_decode(capsys):
    args = ["run", "--decode", "--batch", "2", "--heads", "8", "--kv-heads", "2", "--tokens", "3",
            "--seq", "300", "--cache-len", "300,45", "--dim", "64", "--quiet", "--targets", "trn2"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "decode" in text and "PASS" in text
    assert "the IO lower bound" in text and "HBM-BW util" in text


@needs_sim
def test_run_decode_paged(capsys):
    args = ["run", "--decode", "--paged", "--page-size", "16", "--batch", "2", "--heads", "4",
            "--kv-heads", "2", "--tokens", "2", "--seq", "100", "--cache-len", "100,17",
            "--dim", "32", "--quiet", "--targets", "trn2"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "paged (page_size 16, 9 pages)" in text and "PASS" in text


def test_run_fails_with_status_1_when_the_check_fails(monkeypatch, capsys):
    real = host.flash_attention

    def wrong(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return (np.asarray(o, np.float32) + 1.0).astype(o.dtype), lse

    monkeypatch.setattr(host, "flash_attention", wrong)
    assert cli.main(SMALL + ["--targets", "trn2"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_run_rejects_bad_input_with_a_named_argument(capsys):
    assert cli.main(["run", "--heads", "3", "--kv-heads", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "nki-flash: error:" in err and "3" in err and "2" in err


def test_run_rejects_non_positive_sizes():
    with pytest.raises(SystemExit):
        cli.main(["run", "--seq", "0"])
