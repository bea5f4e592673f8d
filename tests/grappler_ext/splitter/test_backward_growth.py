"""Starved gradient loops grown into the room XLA's figure leaves (``grappler_ext.splitter.backward_growth``).

A loop computing its gradients as it goes, starved by the memory model's plan, is built again in its
place in the chunk XLA's figures for it alone give in that room: the plan is not made again, and
where the program so grown is over the limit, the growth is undone, back to the plan as it was.
Where it grew by little against the room, in a function checked at each shape it runs at, the grown
program's figure is predicted and measured where it runs instead of at the nominal sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.pipeline import Pipeline
from grappler_ext.splitter import Splitter, Tuning, driver, search
from grappler_ext.splitter.outcome import Code
from tests.fakes import FakeMeasurer
from tests.grappler_ext.splitter.test_dynamic import _close, _records, dense_step
from tf_memsafe import hook, run_check
from tf_memsafe.memory import XlaMeasurer

LIMIT = 4_000_000
# (planned from its gradients' count, dense_step's loop of 2 rows of 41 is starved from two steps)
STARVED_FROM_TWO = Tuning(fused_starved_steps=2)


def _traced(measurer, monkeypatch, tuning: Tuning = STARVED_FROM_TWO, signature=(None, 64, 16)):
    """``dense_step`` traced for batches of run-time size under ``LIMIT``: the function, the splitter's
    records, and how many plans it built."""
    plans = []
    original = driver._Run.split_large

    def counted(self, *args):
        plans.append(1)
        return original(self, *args)

    monkeypatch.setattr(driver._Run, "split_large", counted)
    tf_memsafe.enable(LIMIT, strict=True)
    try:
        with hook.use_pipeline(Pipeline([Splitter(measurer, tuning=tuning)])):
            f = tf.function(dense_step, jit_compile=True, input_signature=[tf.TensorSpec(signature)])
            f.get_concrete_function()
            records = _records("dense_step")
    finally:
        tf_memsafe.disable()
    return f, records, len(plans)


def _equal_to_naive(f, what):
    naive = tf.function(dense_step, jit_compile=True)
    for b in (3, 20):
        x = tf.constant(np.random.RandomState(b).randn(b, 64, 16).astype(np.float32))
        _close(f(x), naive(x), f"{what} at [{b}, 64, 16]")


def test_a_starved_loop_is_built_again_in_its_place_not_the_plan_again(monkeypatch):
    """One plan: the starved loop built again in larger chunks where it stood, its record replaced
    (one loop, its grown chunk), the growth said after it; forward and gradients exact."""
    f, records, plans = _traced(XlaMeasurer(), monkeypatch)
    codes = [r.code for r in records]
    (split,) = [r for r in records if r.code == Code.SPLIT]
    (grown,) = [r for r in records if r.code == Code.GROWN]
    assert plans == 1, codes
    assert split.plan.fused and split.plan.backward_chunk > grown.plan.starved_chunks[0], [r.reason for r in records]
    assert codes.index(Code.SPLIT) < codes.index(Code.GROWN), codes
    assert grown.plan.figure_after <= LIMIT, grown.reason
    _equal_to_naive(f, "grown in place")


def test_a_loop_grown_over_the_limit_is_undone_to_the_plan_as_it_was(monkeypatch):
    """XLA's figure for the program grown is over the limit: the growth undone, the starved loop as the
    plan built it (its chunk in the program XLA compiles), no plan made again; exact."""
    growing, xla = [], XlaMeasurer()
    regrow = search.RegionSearch.regrow

    def marked(self, stash):
        growing.append(stash.tensor.name)
        return regrow(self, stash)

    monkeypatch.setattr(search.RegionSearch, "regrow", marked)
    f, records, plans = _traced(FakeMeasurer(program=lambda g: 10 * LIMIT if growing else xla.program_bytes(g)),
                                monkeypatch)
    (split,) = [r for r in records if r.code == Code.SPLIT]
    (not_grown,) = [r for r in records if r.code == Code.NOT_GROWN]
    assert plans == 1 and growing, [r.reason for r in records]
    assert split.plan.backward_chunk == not_grown.plan.starved_chunks[0], (split.reason, not_grown.reason)
    assert not_grown.plan.figure_after == 10 * LIMIT and "over the limit" in not_grown.reason, not_grown.reason
    x = tf.constant(np.random.RandomState(0).randn(20, 64, 16).astype(np.float32))
    hlo = f.experimental_get_compiler_ir(x)(stage="hlo")
    assert f"f32[{split.plan.backward_chunk},64,512]" in hlo
    _equal_to_naive(f, "growth undone")


def test_a_loop_that_cannot_be_built_again_in_place_has_the_plan_made_again(monkeypatch):
    """Where the loop cannot be built again in its place (a later loop replaced an input of its region,
    its build failed: ``regrow`` answers ``None``), the plan is made again with the room, as before:
    grown all the same, exact."""
    monkeypatch.setattr(search.RegionSearch, "regrow", lambda self, stash: None)
    f, records, plans = _traced(XlaMeasurer(), monkeypatch)
    (split,) = [r for r in records if r.code == Code.SPLIT]
    (grown,) = [r for r in records if r.code == Code.GROWN]
    assert plans == 2 and split.plan.backward_chunk > grown.plan.starved_chunks[0], [r.reason for r in records]
    _equal_to_naive(f, "planned again")


@pytest.mark.parametrize("signature, by_model", [([None, 64, 16], False), ([None, None, 16], True)],
                         ids=["rows-steady", "rows-grow-with-the-run"])
def test_a_small_growth_is_predicted_and_checked_where_the_function_runs(monkeypatch, signature, by_model):
    """XLA's figure before the growth plus twice what the loop alone grew by is within the limit, and
    the function has run-time sizes (each shape it runs at is checked before it runs): the grown
    program is not compiled whole again at the nominal sizes; its figure is predicted, and the nominal
    sizes are not taken as judged, so the first call is checked, at the nominal shape here: there XLA's
    figure is within the prediction's bound and the limit, and a smaller call after it is not checked
    again.  Exact.  A loop along the batch is grown by its own figures; one along the second run-time
    dimension, whose rows grow with the batch, by the model's count, and then measured alone at both
    chunks at the nominal sizes."""
    measurer, alone = FakeMeasurer(), []
    grown_alone = search.RegionSearch._grown_alone
    monkeypatch.setattr(search.RegionSearch, "_grown_alone", lambda self, *a: alone.append(a) or grown_alone(self, *a))
    f, records, plans = _traced(measurer, monkeypatch, Tuning(fused_starved_steps=2, growth_aim=0.3), signature)
    (split,) = [r for r in records if r.code == Code.SPLIT]
    (grown,) = [r for r in records if r.code == Code.GROWN]
    (sized,) = [r.plan for r in records if r.code == Code.DYNAMIC_SHAPES and r.plan is not None]
    growth = grown.plan
    assert plans == 1 and len(measurer.calls) == 1, [r.reason for r in records]       # (the figure before it)
    assert bool(alone) == by_model, alone
    assert growth.figure_after is None and growth.figure_before < growth.predicted_after, grown.reason
    assert split.plan.backward_chunk > growth.starved_chunks[0] and "checked at each shape" in grown.reason
    assert sized.within and not sized.measured
    concrete = f.get_concrete_function()
    watch = getattr(concrete.graph, run_check.WATCH_ATTR)
    (at,) = watch.planned
    naive = tf.function(dense_step, jit_compile=True)
    tf_memsafe.enable(LIMIT, strict=True)          # (its calls checked)
    try:
        for shape in (at, (3, *at[1:])):
            x = tf.constant(np.random.RandomState(shape[0]).randn(*shape).astype(np.float32))
            _close(f(x), naive(x), f"predicted growth at {list(shape)}")
    finally:
        tf_memsafe.disable()
    (check,) = watch.checks
    bound = growth.figure_before + 2 * (growth.predicted_after - growth.figure_before)
    assert check.shapes == (at,) and check.bytes <= min(bound, LIMIT), (check.render(), growth)
