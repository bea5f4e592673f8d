"""Smoke run of experiments/conv_loops.py at its quick sizes, Keras 3's CNN (nothing timed is asserted;
heavy: about a minute; the claim it measures, canonical convolutions in a split CNN step, is checked
in tests/grappler_ext/test_loop_convolutions.py)."""

import json

import pytest

from experiments import conv_loops


@pytest.mark.heavy
def test_quick_run_splits_within_the_limit_and_keeps_the_losses(tmp_path):
    conv_loops.main(["--quick", "--keras", "keras3", "--models", "cnn", "--out", str(tmp_path)])
    with open(tmp_path / "conv_loops.json", encoding="utf-8") as f:
        rows = {r["variant"]: r for r in json.load(f)["rows"]}
    assert set(rows) == set(conv_loops.VARIANTS)
    for variant in ("tf_memsafe", "tf_naive_grads", "tf_ungrown"):
        assert rows[variant]["xla_bytes"] <= rows[variant]["limit_bytes"] < rows["naive"]["xla_bytes"]
        assert rows[variant]["max_rel_diff"] < 1e-5
        assert rows[variant]["chunks"]                                   # split: its loops' chunks
