"""Smoke run of experiments/overhead.py at its --quick sizes (nothing timed is asserted)."""

import csv
import dataclasses
import json

import pytest
import tensorflow as tf

from experiments import overhead
from grappler_ext.splitter import LoopPlan, RootSplit


@pytest.mark.heavy
def test_quick_run_writes_csv_json_and_plot(tmp_path):
    """``heavy`` (40-60 s, left out of the default run).  kNN's and kernel regression's loops within a
    tenth of their figures, exact, gradients rebuilt: the splitter's tests; the script's rows, its
    hand-written loops and its plot run by default in test_modes_option_selects_forward_or_training_rows."""
    code = overhead.main(["--quick", "--out", str(tmp_path), "--repeats", "1",
                          "--workloads", "knn", "kernel_matvec"])
    assert code == 0
    with open(tmp_path / "overhead.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by = {(r["workload"], r["mode"], r["case"]): r for r in rows}
    # kNN has no training step; kernel matvec's is kernel regression with an Adam update.
    chosen = [("knn", "forward"), ("kernel_matvec", "forward"), ("kernel_matvec", "training")]
    assert set(by) == {(*w, c) for w in chosen for c in ("fits", "limit/10", "limit/100")}
    for workload, mode in chosen:
        fits = by[workload, mode, "fits"]
        # Limit = 2 x the naive footprint: nothing is split.  The kernel sums are left exactly as written;
        # kNN's top-k goes through its blocks' maxima (blocked_top_k: a speed rewrite, bit-identical).
        assert fits["split"] == "", fits
        if workload == "knn":
            assert fits["status"] in ("unchanged", "rewritten") and int(fits["rewrites"]) <= 1, fits
        else:
            assert fits["status"] == "unchanged" and fits["rewrites"] == "0", fits
            assert fits["rewritten_bytes"] == fits["naive_bytes"]
        assert fits["within_limit"] == "True"
        assert float(fits["err_rewritten"]) == 0.0
    for workload in ("knn", "kernel_matvec"):
        for case in ("limit/10", "limit/100"):
            row = by[workload, "forward", case]
            assert row["within_limit"] == "True", row
            assert int(row["rewritten_bytes"]) <= int(row["limit_bytes"]) < int(row["naive_bytes"])
            assert row["status"] == "rewritten" and int(row["rewrites"]) >= 1, row
            assert row["hand_chunk_source"] == "splitter" and int(row["hand_bytes"]) <= int(row["limit_bytes"])
            # The splitter's loop and the hand-written one compute what the naive program computes.
            assert float(row["err_rewritten"]) < 1e-5 and float(row["err_hand"]) < 1e-5
    # At 1/100 the splitter currently picks an `Exp` region it cannot fit (best effort, 12 MB against a 197 KB
    # limit, while at 1/10 it fits): the row must at least be rewritten and say why it is over the limit.
    row = by["kernel_matvec", "training", "limit/100"]
    assert row["status"] == "rewritten" and int(row["rewrites"]) >= 1, row
    assert row["within_limit"] == "True" or "limit cannot be met" in row["warnings"], row
    # The training step at 1/10 of its footprint: split, its gradient rebuilt, within the limit.
    row = by["kernel_matvec", "training", "limit/10"]
    assert row["within_limit"] == "True", row
    assert int(row["rewritten_bytes"]) <= int(row["limit_bytes"]) < int(row["naive_bytes"])
    assert row["status"] == "rewritten" and int(row["rewrites"]) >= 1, row
    assert "gradient inside the function rebuilt" in row["split"], row
    # The hand-written step over the splitter's chunks needs about twice the limit (4.2 MB, the splitter's
    # 1.1 MB): it may take a smaller chunk that fits instead.
    assert row["hand_chunk_source"] in ("splitter", "fallback") and int(row["hand_bytes"]) <= int(row["limit_bytes"])
    # Two Adam steps from the same initial state: losses, variables and moments.  float32, and Adam's first
    # steps divide each gradient by its own magnitude, which magnifies rounding in near-zero components.
    assert float(row["err_rewritten"]) < 1e-4 and float(row["err_hand"]) < 1e-4
    data = json.loads((tmp_path / "overhead.json").read_text())
    assert len(data["rows"]) == 9
    assert (tmp_path / "overhead.png").stat().st_size > 10_000


def test_modes_option_selects_forward_or_training_rows(tmp_path):
    """``--modes forward`` leaves the training rows out.  (The quick run above has both kinds of row
    and checks its training rows; this test selected them, 30-36 s of the suite, 8 s so.)"""
    assert overhead.main(["--quick", "--out", str(tmp_path), "--repeats", "1", "--workloads", "logsumexp",
                          "--modes", "forward"]) == 0
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert [(r["workload"], r["mode"], r["case"]) for r in rows] == [
        ("logsumexp", "forward", c) for c in ("fits", "limit/10", "limit/100")]
    for row in rows:
        assert row["within_limit"], row
        assert row["status"] == ("unchanged" if row["case"] == "fits" else "rewritten"), row


def test_results_without_a_mode_read_as_forward_rows():
    """experiments/results/overhead.json predates training rows: report.py still reads it."""
    row = {f.name: None for f in dataclasses.fields(overhead.Row) if f.name != "mode"}
    assert overhead.Row(**row).mode == "forward"


def test_plan_rows_reads_the_splitters_plan():
    def plan(kind, axes, length, chunk):
        return LoopPlan((RootSplit("root", "TopKV2", kind, axes),), length, chunk, chunk, 0)

    assert overhead.plan_rows(plan("concat", (0, None), 20000, 520), 20000) == (520, 38, 240)
    assert overhead.plan_rows(plan("concat", (0, None), 8000, 500), 8000) == (500, 16, 0)
    # Another axis: as many chunks over the rows (39 here).
    assert overhead.plan_rows(plan("sum", (1, None), 20000, 520), 3900) == (100, 39, 0)
    # The same axis of another input, or of another length: as many chunks too.
    assert overhead.plan_rows(plan("sum", (None, 0), 1000, 200), 1000) == (200, 5, 0)
    assert overhead.plan_rows(plan("concat", (0, None), 2000, 200), 1000) == (100, 10, 0)


def test_fallback_plan_fits_the_hand_written_loop_in_the_limit():
    """Without a splitter record, the hand-written kNN loop gets a chunk that fits 1/10 of the naive bytes."""
    w = next(w for w in overhead.workloads(quick=True) if w.name == "knn")
    args = tuple(tf.constant(a) for a in w.args)
    limit = overhead.naive_footprint(w.fn, args) // 10
    chunk, steps, tail, footprint = overhead.fallback_plan(w, args, limit)
    assert chunk * steps + tail == w.args[0].shape[0] and footprint <= limit
