"""Smoke run of experiments/compile_time.py: one layer at one short length (nothing timed is asserted;
heavy)."""

import json

import pytest

from experiments import compile_time


@pytest.mark.heavy
def test_quick_run_rewrites_the_masks_and_keeps_the_output(tmp_path):
    """``heavy`` (about 20 s: each method in a process of its own; ``python -m tests -m heavy`` runs
    it).  What it asserts runs by default in tests/grappler_ext/test_constant_cumsum.py: Keras 3's
    ``MultiHeadAttention(use_causal_mask=True)`` with dropout at L = 128 under the whole pipeline,
    constant_cumsum's two rewrites and no other, none with that pass disabled, the output the one as
    written to the bit (``test_keras3_causal_attention_in_the_products_pipeline_is_changed_by_this_pass_alone``;
    with the pass alone, ``test_keras_causal_attention_exact_and_without_a_scan[keras3]``)."""
    compile_time.main(["--quick", "--layers", "keras3_mha", "--lengths", "128", "--out", str(tmp_path)])
    with open(tmp_path / "compile_time.json", encoding="utf-8") as f:
        results = json.load(f)
    rows = {r["method"]: r for r in results["rows"]}
    assert results["quick"] and sorted(rows) == sorted(compile_time.METHODS)
    assert all(r["first_call_s"] is not None and r["layer"] == "keras3_mha" and r["length"] == 128
               for r in rows.values())
    # Only constant_cumsum changes these programs: both running sums of the causal mask.
    assert rows["tf_memsafe"]["rewrites"] == "constant_cumsum x2"
    assert rows["naive"]["rewrites"] == rows["no_constant_cumsum"]["rewrites"] == ""
    assert rows["tf_memsafe"]["max_rel_diff"] == 0.0 and rows["no_constant_cumsum"]["max_rel_diff"] == 0.0
