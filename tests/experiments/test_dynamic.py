"""Smoke run of experiments/dynamic.py at its --quick sizes (nothing timed is asserted; heavy)."""

import json

import pytest

from experiments import dynamic


@pytest.mark.heavy
def test_quick_run_is_exact_and_within_the_limit(tmp_path):
    """``heavy`` (about 25 s; ``python -m tests -m heavy`` runs it).  What it checks runs by default:
    a kernel matvec traced with ``[None, 3]``, split, equal to the unsplit function at every length and
    within the limit by XLA's figure, in tests/grappler_ext/splitter/test_dynamic.py
    (``test_forward_equals_unsplit_at_every_length[kernel_matvec]``,
    ``test_xla_figure_at_a_concrete_length_is_within_the_limit``) and
    tests/tf_memsafe/test_hostile_inputs.py (``test_a_dynamic_dimension_is_split_and_exact_at_every_size``);
    a training step with the tape inside split along a run-time size, equal to the unsplit one, in
    test_dynamic.py (``test_gradients_inside_equal_unsplit[matvec_loss]``) and, its variables'
    gradients applied by ``fit``, tests/integration/test_padded_batches.py
    (``test_fit_on_padded_batches_is_split_within_the_limit[keras3]``); the same functions traced for
    each static shape, split within the limit, throughout tests/grappler_ext/splitter."""
    dynamic.main(["--quick", "--out", str(tmp_path)])
    with open(tmp_path / "dynamic.json", encoding="utf-8") as f:
        results = json.load(f)
    rows = results["rows"]
    assert results["quick"] and results["limit_bytes"] == dynamic.QUICK_LIMIT
    keys = {(r["workload"], r["n"], r["method"]) for r in rows}
    for workload in ("kernel_matvec", "kernel_regression"):
        for n in dynamic.QUICK_SIZES:
            assert {(workload, n, "dynamic"), (workload, n, "static")} <= keys
    for r in rows:
        assert r["max_rel_diff"] < 1e-5, r
        if r["method"] != "naive":
            assert r["within_limit"], r
