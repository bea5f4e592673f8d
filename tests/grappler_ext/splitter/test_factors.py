"""Splits through a reshape's factors: a batch or a sequence axis through Keras' [B, L, E] <-> [B * L, E].

``tf.tensordot`` (tf_keras' ``Dense`` on a 3-D input, Keras 3's ``matmul`` too) merges batch and
sequence into the rows of a matmul and splits them back.  A loop along the batch reads rows
``[s L, (s + c) L)`` of the merged rows (the outer factor: one run); a loop along the sequence
reads ``B`` runs of ``c`` rows, ``L`` apart (the inner factor).  Through the merge back both are
``c`` rows of their axis again.  Here losses over a two-layer feed-forward block that leave only
one of the two axes free, or either, forward and as a training step with the tape inside: one loop,
within the limit by XLA's figure, equal to the unsplit function.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.splitter.outcome import Code
from tests.fakes import always_split
from tests.xla_run import run_and_measure

B, L, D, E = 16, 256, 64, 1024
rng = np.random.default_rng(0)
X = tf.constant(rng.standard_normal((B, L, D)).astype(np.float32))
W1 = tf.Variable(rng.standard_normal((D, E)).astype(np.float32) / 8)
W2 = tf.Variable(rng.standard_normal((E, D)).astype(np.float32) / 30)


def dense(t, w):
    return tf.tensordot(t, w, [[2], [0]])          # [B, L, D] -> reshape [B * L, D] @ w -> [B, L, E]


def block(x):
    return dense(tf.nn.relu(dense(x, W1)), W2)     # [B, L, D]


def per_example(x):
    return tf.reduce_sum(tf.square(block(x)), axis=[1, 2])                        # [B]: either axis


def attention_like(x):
    y = block(x)                                    # a softmax over the sequence couples its rows
    return tf.reduce_sum(tf.nn.softmax(y, axis=1) * y, axis=[1, 2])             # [B]: the batch only


def per_position(x):
    y = block(x)                                    # centred over the batch couples its rows
    return tf.reduce_sum(tf.square(y - tf.reduce_mean(y, axis=0)), axis=[0, 2])  # [L]: the sequence only


def training_step(loss_of):
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_of(x))
        return (loss,) + tuple(tape.gradient(loss, [W1, W2]))
    step.__name__ = f"training_step_{loss_of.__name__}"
    return step


def split_under(limit: int, fn, x):
    """``fn(x)`` traced and run under ``limit`` (strict): its outputs, the splitter's records of that
    trace and XLA's figure for it rewritten."""
    tf_memsafe.enable(limit, strict=True)
    try:
        got, figure = run_and_measure(tf.function(fn, jit_compile=True), x)    # (the call's compile)
        records = [r for r in tf_memsafe.reports()[-1].records if r.pass_name == "splitter"]
        return got, records, figure
    finally:
        tf_memsafe.disable()


# attention_like's forward under a fifth: at a quarter, two loops (the first Dense along the sequence,
# then the reduction over its features) fit it as well, 3.7 MB of 4.8 MB.
@pytest.mark.parametrize("fn, lengths, ratio", [
    (per_example, {B, L}, 4), (attention_like, {B}, 5), (per_position, {L}, 4),
    (training_step(per_example), {B, L}, 4), (training_step(attention_like), {B}, 4),
    (training_step(per_position), {L}, 4),
], ids=lambda v: getattr(v, "__name__", ""))
def test_a_loop_through_merged_rows(fn, lengths, ratio):
    naive = tf_memsafe.memory_footprint(fn, X, rewrite=False)
    limit = naive // ratio
    got, records, after = split_under(limit, fn, X)
    loops = [r.plan for r in records if r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    assert len(loops) == 1 and loops[0].length in lengths, [r.reason for r in records]
    assert after <= limit < naive
    want = tf.function(fn, jit_compile=True)(X)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):   # float32 sums reassociated
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w))))


def test_an_axis_spread_over_two_input_axes_is_never_sliced():
    """[B * L, E] rows as the split axis (a loss over the merged rows) reach [B, L, D] across both
    axes: no rule gives a slice of them there; the region stops at the merge, and what is split
    computes what the unsplit function does."""
    def merged_rows(x):
        rows = tf.reshape(block(x), [B * L, D])
        return tf.reduce_sum(tf.square(rows - tf.reduce_mean(rows, axis=0)), axis=1)   # [B * L]

    tf_memsafe.enable(tf_memsafe.memory_footprint(merged_rows, X, rewrite=False) // 4)
    try:
        got = tf.function(merged_rows, jit_compile=True)(X)
        records = [r for r in tf_memsafe.reports()[-1].records if r.pass_name == "splitter"]
    finally:
        tf_memsafe.disable()
    # (the merge is the op named `Reshape`; tensordot's are under `Tensordot/`)
    assert not any(r.plan is not None and r.plan.length == B * L and r.code == Code.SPLIT
                   and "Reshape" in r.ops for r in records)
    want = tf.function(merged_rows, jit_compile=True)(X).numpy()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("fn", [per_example, training_step(per_position), training_step(attention_like)],
                         ids=lambda f: f.__name__)
def test_a_loop_through_merged_rows_of_run_time_sizes(fn):
    """The same block on padded batches (``input_signature`` [None, None, D]: tf.data's, Keras'):
    the merged rows are [B * L, E] with both sizes known only at run time, ``tf.tensordot``'s shapes
    read with ``tf.shape``.  Planned at nominal sizes, the loop cuts the rows by factors whose sizes
    it reads when the function runs (and computes those ``tf.shape`` reads itself); within the limit
    by XLA's figure at the shape it was sized from, equal to the unsplit function at that shape and
    at another."""
    naive_fn = tf.function(fn, jit_compile=True)
    want, naive = run_and_measure(naive_fn, X)              # (XLA's figures for the compiles the calls made)
    limit = naive // 4
    other = X[:5, :100]
    tf_memsafe.enable(limit, strict=True)
    try:
        padded = tf.function(fn, jit_compile=True, input_signature=[tf.TensorSpec([None, None, D])])
        with always_split():                    # (the smaller shape fits as written)
            first, after = run_and_measure(padded, X)
            got = [first, padded(other)]
        records = [r for r in tf_memsafe.reports()[-1].records if r.pass_name == "splitter"]
    finally:
        tf_memsafe.disable()
    assert any(r.code == Code.SPLIT and r.plan.dynamic for r in records), [r.reason for r in records]
    assert after <= limit < naive
    for value, expected in zip(got, (want, naive_fn(other))):
        for g, w in zip(tf.nest.flatten(value), tf.nest.flatten(expected)):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w))))


N = 256
FLAT = tf.constant(rng.standard_normal((1, N * N)).astype(np.float32) / 4)
V = tf.constant(rng.standard_normal(8).astype(np.float32))


@pytest.mark.parametrize("combined", ["sum", "max"], ids=["fused", "gradient_loop"])
def test_an_inputs_gradient_in_slices_of_merged_rows(combined):
    """An input read through a merge of the split axis with another ([1, N * N] reshaped to [1, N, N],
    as GPflow's VGP fills its q_sqrt) and differentiated in the loop: each slice's gradient is
    [1, chunk * N] of it, written into an array of such slices (before: declared [1, chunk], and the
    loop failed to build, the step left over the limit), in a loop computing the gradients as it
    goes (a sum) and in a gradient loop of its own (a max)."""
    def step(flat):
        with tf.GradientTape() as tape:
            tape.watch(flat)
            rows = tf.reduce_sum(tf.exp(tf.reshape(flat, [1, N, N])[..., None] * V), [2, 3])   # [1, N]
            loss = tf.reduce_sum(rows) if combined == "sum" else tf.reduce_max(rows)
        return loss, tape.gradient(loss, flat)

    limit = 2 * 10**6                                    # the [1, N, N, 8] exponentials: 8.4 MB
    got, records, after = split_under(limit, step, FLAT)
    loops = [r.plan for r in records if r.code == Code.SPLIT]
    assert loops and loops[0].length == N and loops[0].fused == (combined == "sum"), [r.reason for r in records]
    assert after <= limit
    want = tf.function(step, jit_compile=True)(FLAT)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-5, atol=1e-6)
