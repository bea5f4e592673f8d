"""Smoke run of experiments/random_key.py at its quick shapes (nothing timed is asserted): the bare draw and
Keras 3's ``fit`` (its ``Dropout`` layer alone is checked in tests/grappler_ext/test_random_key.py)."""

import json

import pytest

from experiments import random_key


@pytest.mark.heavy
def test_quick_run_rewrites_the_keys_and_keeps_every_value(tmp_path):
    """``heavy`` (about a minute, left out of the default run).  The keys rewritten with every value
    kept: tests/grappler_ext/test_random_key.py (the draw and Keras' ``Dropout``) and
    tests/tf_memsafe/test_keyed_draws.py (a dropout model trained as without)."""
    cases = ["uniform", "keras3_fit"]
    random_key.main(["--quick", "--repeats", "1", "--cases", *cases, "--out", str(tmp_path)])
    with open(tmp_path / "random_key.json", encoding="utf-8") as f:
        results = json.load(f)
    rows = {(r["case"], r["variant"]): r for r in results["rows"]}
    assert results["quick"] and len(rows) == len(cases) * len(random_key.VARIANTS)
    for case in cases:
        # Only random_key changes these programs, and nothing drawn changes: the values, the losses.
        assert "random_key x" in rows[case, "tf_memsafe"]["rewrites"]
        assert "random_key" not in rows[case, "no_random_key"]["rewrites"] and rows[case, "naive"]["rewrites"] == ""
        assert all(rows[case, v]["max_rel_diff"] == 0.0 for v in random_key.VARIANTS)
