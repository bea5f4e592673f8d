"""Loops that run in one step where the program as written fits at the sizes it runs at (:mod:`.whole_at_run`).

A padded batch's attention (``[B, L, L]`` scores from ``[None, None, 16]`` inputs) is planned at nominal
sizes where it is over its limit; at the sizes it runs at, XLA compiles one program per shape, and
where the program as written fits, the loop gives way to the region as written: XLA drops the loop,
and its figure, values and gradients are the unsplit program's.  A loop that cannot give way (a stateful
draw in its region) runs in one step there.  Where it does not fit,
the loops split as planned, within the limit.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext import memory_model, shapes
from grappler_ext.splitter import Tuning, nominal, whole_at_run
from grappler_ext.splitter.outcome import Code
from grappler_ext.splitter.scaling import Row
from tests.fakes import always_split
from tests.grappler_ext.splitter.test_dynamic import (
    PADDED,
    _batch,
    _close,
    _padded,
    _records,
    attention_loss,
    attention_step,
)
from tests.xla_run import run_and_measure
from tf_memsafe import xla_flags


@pytest.fixture(scope="module")
def limit():
    return tf_memsafe.memory_footprint(tf.function(attention_loss), _batch(4, 512), rewrite=False) // 8


def trip_counts(f, x) -> list[int]:
    """For each while loop of ``f``'s optimised HLO at ``x``'s shape, the largest int constant its
    condition (and what it calls) compares with: its trip count, for these loops (``i < steps``)."""
    hlo = f.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    computations = {}
    for block in hlo.split("\n\n"):
        found = re.match(r"\s*(?:ENTRY\s+)?%([\w.\-]+)\s", block)
        if found:
            computations[found.group(1)] = block

    def constants(name, seen):
        if name in seen or name not in computations:
            return []
        seen.add(name)
        text = computations[name]
        values = [int(c) for c in re.findall(r"s32\[\] constant\((\d+)\)", text)]
        return values + [v for callee in re.findall(r"calls=%([\w.\-]+)", text) for v in constants(callee, seen)]

    return [max(constants(c, set()) or [-1]) for c in re.findall(r" while\(.*?condition=%([\w.\-]+)", hlo)]


def test_a_run_the_program_as_written_fits_runs_it_as_written(limit):
    """Where the memory model puts the program as written within 0.75 of the limit (at the batch of 8,
    lengths up to 86 here), XLA drops the loop, forward and gradient: no loop in its optimised HLO,
    XLA's figure the unsplit program's to the byte, values and gradients the unsplit ones to the bit.
    12x over, the loop splits as planned, within the limit."""
    f, records = _padded(attention_step, limit, split_always=False)
    assert records[0].code == Code.DYNAMIC_SHAPES and "1 loop gives way to the region as written" in \
        records[0].reason, records[0].reason
    assert any(r.code == Code.SPLIT for r in records)
    naive = tf.function(attention_step, jit_compile=True)
    for b, n in ((1, 1), (2, 7), (4, 64), (8, 80)):
        x = _batch(b, n)
        result, figure = run_and_measure(f, x)           # (XLA's figure for the compile the call made)
        before = tf_memsafe.memory_footprint(f, tf.TensorSpec([b, n, 16]), rewrite=False)
        counts = trip_counts(f, x)
        assert counts == [], (b, n, counts)
        assert before <= limit and figure == before, (b, n, before, figure)
        for got, want in zip(tf.nest.flatten(result), tf.nest.flatten(naive(x))):
            np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=f"[{b}, {n}]")
    for b, n in ((4, 512), (16, 256)):
        x = _batch(b, n)
        result, figure = run_and_measure(f, x)
        counts = trip_counts(f, x)
        assert counts and max(counts) > 1, (b, n)
        assert figure <= limit, (b, n, figure, limit)
        _close(result, naive(x), f"[{b}, {n}]")


def test_a_loop_with_a_stateful_draw_runs_in_one_step_where_the_program_fits(limit):
    """A region holding a stateful draw (tf_keras' dropout, redrawn by slice) keeps its loop (XLA would
    keep a stateful draw whose result nothing reads): where the program fits, the loop takes the whole
    length and runs once (or XLA inlines it); over, it splits within the limit."""
    def dropped_step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            probs = tf.nn.dropout(tf.nn.softmax(tf.einsum("bqe,bke->bqk", x, x) / 4.0, -1), 0.1)
            loss = tf.reduce_sum(tf.sin(tf.einsum("bqk,bke->bqe", probs, x)))
        return loss, tape.gradient(loss, x)

    tf_memsafe.enable(limit, strict=True, redraw_random=True)
    try:
        f = tf.function(dropped_step, jit_compile=True, input_signature=PADDED)
        f.get_concrete_function()
        records = [r for r in tf_memsafe.reports()[-1].records if r.pass_name == "splitter"]
        _, over = run_and_measure(f, _batch(4, 512))     # (XLA's figure for the compile the call made)
    finally:
        tf_memsafe.disable()
    assert "each loop runs in one step" in records[0].reason, records[0].reason
    small = _batch(4, 64)
    assert set(trip_counts(f, small)) <= {1}, trip_counts(f, small)       # (XLA may inline a loop of one step)
    loss, grad = f(small)
    assert np.isfinite(loss.numpy()) and grad.shape == (4, 64, 16)
    assert max(trip_counts(f, _batch(4, 512))) > 1 and over <= limit


def test_with_whole_at_run_off_a_run_that_fits_is_still_split(limit):
    f, records = _padded(attention_step, limit)         # (the product's pipeline, whole_at_run 0)
    assert "one step" not in records[0].reason
    for b, n in ((4, 64), (8, 80)):
        x = _batch(b, n)
        assert max(trip_counts(f, x)) > 1, (b, n)
        _close(f(x), tf.function(attention_step, jit_compile=True)(x), f"[{b}, {n}] split")


def test_a_tape_outside_takes_the_loops_gradient_and_the_forward_holds_nothing_of_the_region(limit):
    """TensorFlow builds a tape's backward outside the function as a function of its own, where ``fits``
    is an input, not a constant: it gets the loop's gradient alone, so that the forward program does not
    keep the region's [B, L, L] scores for it (12x over the limit, forward and backward keep it), and
    the gradients equal the unsplit function's, where the program fits and where it does not."""
    f, records = _padded(attention_loss, limit, split_always=False)
    assert "gives way to the region as written" in records[0].reason, records[0].reason
    naive = tf.function(attention_loss, jit_compile=True)

    def gradient(g, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = g(x)
        return tape.gradient(y, x)

    with xla_flags.dump_all_compiles(in_memory=True) as folder:                # (the pair XLA compiles for [4, 512])
        over = gradient(f, _batch(4, 512))
        figures = [total for _, total in xla_flags.memory_reports(folder)]
    assert len(figures) >= 2 and max(figures) <= limit, (figures, limit)
    _close(over, gradient(naive, _batch(4, 512)), "gradient at [4, 512]")
    _close(gradient(f, _batch(4, 64)), gradient(naive, _batch(4, 64)), "gradient at [4, 64]")


def _peak_and_table(fn, size=256):
    graph = tf.function(fn).get_concrete_function(*PADDED).graph
    at = nominal.Nominal(graph)
    with at.sizes(size):
        est, _ = memory_model.analyse(graph)
        return graph, at, whole_at_run.peak_of_program(graph, est)


@pytest.mark.parametrize("fn", [attention_loss, attention_step], ids=lambda f: f.__name__)
def test_the_count_at_other_sizes_is_the_models(fn):
    """The symbolic count, read at sizes other than the nominal ones, against the memory model run at
    those sizes: within 5 % (what differs is the model's fusion of small tensors)."""
    graph, at, peak = _peak_and_table(fn)
    assert peak is not None and len(peak.signatures) >= 2, peak
    for b, n in ((8, 256), (2, 64), (16, 1024), (1, 3000)):
        with shapes.nominal(n, at.table, {k: b for k in at.batch}):
            est, _ = memory_model.analyse(graph)
        assert est.peak_bytes * 0.95 <= peak.at({k: (b if k in at.batch else n) for k, _ in peak.nominal}) \
            <= est.peak_bytes * 1.05, (b, n)


def test_the_run_time_count_is_the_python_one():
    """The count built as ops (what XLA resolves) equals :meth:`Peak.at` at the same sizes."""
    _, at, peak = _peak_and_table(attention_step)

    @tf.function(input_signature=PADDED)
    def count(x):
        return peak.run_bytes(shapes.Symbols(at.table.names, at.table.count, {
            k: [(x, axis) for _, axis in at.table.sources[k]] for k in at.table.sources}))

    for b, n in ((3, 40), (8, 700)):
        got = float(count(tf.zeros([b, n, 16])))
        want = peak.at({k: (b if k in at.batch else n) for k, _ in peak.nominal})
        assert got == pytest.approx(want, rel=1e-9)


def test_the_kept_steps_are_those_no_other_holds_more_of_every_kind():
    rows = np.array([[3.0, 1.0], [1.0, 3.0], [2.0, 1.0], [3.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    kept = {tuple(r) for r in whole_at_run._pareto(rows)}
    assert kept == {(3.0, 1.0), (1.0, 3.0), (2.0, 2.0)}
    # More than `most` kept: their element-wise maximum, an upper bound of each.
    assert whole_at_run._pareto(rows, 2).tolist() == [[3.0, 3.0]]


def test_largest_size_and_the_note():
    # 1000 B fixed and b n^2 bytes live, planned at b = 8, n = 100: at the batch of 8, 1000 + 8 s^2 <= 81000
    # up to s = 100
    peak = whole_at_run.Peak(signatures=(Row(()), Row(((0, 1), (1, 2)))), fixed=(1000.0, 0.0),
                             steps=((0.0, 8 * 100.0**2),), nominal=((0, 8), (1, 100)))
    assert whole_at_run.largest_size(peak, lambda s: {0: min(s, 8)}, 81_000) == 100
    assert whole_at_run.largest_size(peak, lambda s: {0: min(s, 8)}, 999) == 0

    class At:
        batch = frozenset({0})

        @staticmethod
        def values(s):
            return {0: min(s, 8)}

    assert "up to about 100" in whole_at_run.note(peak, At, 81_000, 101_250)
    assert whole_at_run.note(peak, At, 0, 101_250) == ""
    assert "keep their chunks" in whole_at_run.note(None, At, 81_000, 101_250)


def test_tuning_whole_at_run_accepts_zero_and_refuses_what_is_not_a_share():
    assert Tuning(whole_at_run=0).whole_at_run == 0
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="whole_at_run"):
            Tuning(whole_at_run=bad)


_W = tf.constant(np.random.RandomState(0).randn(16, 16).astype(np.float32) / 4)


def shared_step(x):
    """A layer's output ``h`` that the attention's region recomputes and another loop (the penalty's)
    reads: the two regions share the layer."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        h = tf.tanh(tf.einsum("ble,ef->blf", x, _W))
        loss = attention_loss(h) + tf.reduce_sum(tf.sin(h) ** 2)
    return loss, tape.gradient(loss, x)


def test_a_layer_another_loop_reads_keeps_that_loops_gradient_where_the_program_does_not_fit(limit):
    """Where the program does not fit, a region's ops as written are closed to the gradient, except
    those something outside the region reads (here the penalty's loop reads the layer ``h`` the
    attention's region holds): their gradient carries that reader's share.  Closed too, the penalty's
    share of ``x``'s gradient was dropped at [4, 512] (every element wrong); where the program fits
    (XLA drops both loops), and with whole_at_run off, it was right."""
    f, records = _padded(shared_step, limit, split_always=False)
    assert sum(r.code == Code.SPLIT for r in records) == 2, [r.reason for r in records]
    naive = tf.function(shared_step, jit_compile=True)
    figures = {}
    for b, n in ((4, 64), (4, 512)):
        x = _batch(b, n)
        result, figures[b, n] = run_and_measure(f, x)    # (XLA's figure for the compile the call made)
        assert (max(trip_counts(f, x), default=0) > 1) == (n == 512), (b, n, trip_counts(f, x))
        _close(result, naive(x), f"[{b}, {n}]")
    assert figures[4, 512] <= limit, (figures, limit)


def test_where_the_loop_runs_the_region_as_written_beside_it_costs_nothing():
    """A Keras 3 ``MultiHeadAttention`` training step on padded batches, pooled into a dense head: its
    loop along the sequence computes the keys' and values' projections in its prologue.  The region as
    written, kept beside the loop for the runs where the program fits, read those projections' outputs
    ungated: where the loop ran, their gradient was a zero XLA cannot fold through the projections'
    products, computed all the same (at d = 64 and the nominal [8, 356], 7.4 MB against the 6.0 MB the
    splitter had checked, silently: a run there is judged by that check).  Gated with the region, XLA's
    figure where the loop runs is the loop's alone (whole_at_run off)."""
    from tests.integration.keras_fit import keras_of

    keras = keras_of("keras3")
    keras.utils.set_random_seed(0)
    d = 32
    layer, head = keras.layers.MultiHeadAttention(4, d // 4), keras.layers.Dense(8)

    def tokens(b, n):
        return tf.constant(np.random.default_rng(b * 1000 + n).standard_normal((b, n, d)), tf.float32)

    layer(tokens(2, 8), tokens(2, 8))
    head(tf.zeros([2, d]))
    variables = layer.trainable_variables + head.trainable_variables

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.tanh(head(tf.reduce_mean(layer(x, x), axis=1))))
        return [loss] + tape.gradient(loss, [x] + variables)

    limit = tf_memsafe.memory_footprint(tf.function(step), tokens(4, 256), rewrite=False) // 6
    figures = {}
    for name, pipeline in (("given way", contextlib.nullcontext), ("loop alone", always_split)):
        tf_memsafe.enable(limit, strict=True)
        try:
            with pipeline():
                f = tf.function(step, jit_compile=True, input_signature=[tf.TensorSpec([None, None, d])])
                f.get_concrete_function()
                records = _records(step.__name__)
                planned = next(r.plan for r in records if r.code == Code.DYNAMIC_SHAPES and r.plan is not None)
                loops = [r.plan for r in records if r.code == Code.SPLIT]
                assert loops and loops[0].prologue_ops, [r.reason for r in records]
                _, figures[name] = run_and_measure(f, tokens(*planned.inputs[0][1][:2]))    # (its compile there)
        finally:
            tf_memsafe.disable()
    assert figures["given way"] == figures["loop alone"] <= limit, (figures, limit)
