"""Loops that compute their gradients as they go (issue 30): with the tape inside the function and a
split region whose one output is a scalar combined by a sum or a mean (the loss itself), each slice
is computed and differentiated in the same step, as a hand-written gradient accumulation does,
instead of a forward loop and a backward loop that computes every slice again.

Sizes (float64): single-head attention at L = 1024, d = 16 holds [1024, 1024] scores = 8 MB, and
the step holds several such; the limit of 2 MB makes the splitter cut the queries into slices.
Every case compares the loss and every gradient with the step as written, at 1e-10.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.pipeline import Pipeline
from grappler_ext.splitter import DEFAULT_TUNING, Code, Splitter, analysis, loop, mechanism
from tests.xla_run import run_and_measure
from tf_memsafe import hook
from tf_memsafe.memory import XlaMeasurer

LIMIT = 2 * 10**6
L, D, H = 1024, 16, 4
RNG = np.random.default_rng(0)
X = tf.constant(RNG.standard_normal((L, D)))
TARGET = tf.constant(RNG.standard_normal((L, D)))
INITIAL = [RNG.standard_normal((D, D)) / 4 for _ in range(3)]
HEADS = [RNG.standard_normal((D, H, D)) / 4 for _ in range(3)]          # multi_head's [D, H, D] maps
KERNEL = [RNG.standard_normal((D, D)) / 4, RNG.standard_normal((512, D)),  # kernel_regression's map,
          RNG.standard_normal((512, 1)) / 512]                            # centres and weights


def splitter_only():
    return hook.use_pipeline(Pipeline([Splitter(XlaMeasurer())]))


def loops():
    return [r.plan for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "splitter" and r.action == "rewritten"]


def attention(x, weights, causal=False):
    q, k, v = (x @ w for w in weights)
    scores = tf.matmul(q, k, transpose_b=True) / 4.0                              # [L, L]
    if causal:
        scores = tf.where(tf.linalg.band_part(tf.ones_like(scores), -1, 0) > 0, scores, -1e9)
    return tf.nn.softmax(scores, -1) @ v                                           # [L, D]


def mse(x, t, weights):
    return tf.reduce_mean(tf.square(attention(x, weights) - t))


def causal_mse(x, t, weights):
    return tf.reduce_mean(tf.square(attention(x, weights, causal=True) - t))


def regularised(x, t, weights):
    """The loss read through more scalar ops (a penalty added, scaled): the region's scalar output
    still reaches the loss."""
    return 3.0 * tf.reduce_sum(tf.square(attention(x, weights) - t)) + 0.1 * tf.reduce_sum(weights[0] ** 2)


def kernel_both_ways(x, t, weights):
    """K(x W, x W) read by rows and whole (x W sliced and whole in the same region)."""
    e = x @ weights[0][:, :4]                                                       # [L, 4]
    d = tf.reduce_sum(tf.square(e[:, None, :] - e[None, :, :]), -1)                 # [L, L]
    return tf.reduce_mean(tf.square(tf.exp(-d / 8.0) @ (x @ weights[1]) - t))


def multi_head(x, t, weights):
    """Heads by einsum: keys and values [L, H, D] projected from x [L, D] (four times its bytes: the
    loop's prologue computes them before the loop)."""
    q, k, v = (tf.einsum("ld,dhe->lhe", x, w) for w in weights)
    probs = tf.nn.softmax(tf.einsum("lhe,mhe->hlm", q, k) / 4.0, -1)               # [H, L, L]
    out = tf.einsum("hlm,mhe->lhe", probs, v)
    return tf.reduce_mean(tf.square(tf.reduce_sum(out, 1) - t))


def kernel_regression(x, weights):
    """exp(-D(x W, Z)) w against tanh(x)'s first column: [L, 512, D] differences."""
    projection, centres, w = weights
    d = tf.reduce_sum(tf.square((x @ projection)[:, None, :] - centres[None, :, :]), -1)   # [L, 512]
    return tf.reduce_mean(tf.square(tf.exp(-d / 16.0) @ w - tf.tanh(x[:, :1])))


def step_fn(loss, weights):
    def step(x, t):
        with tf.GradientTape() as tape:
            value = loss(x, t, weights)
        return value, tape.gradient(value, weights)
    return step


def variables(initial=None):
    return [tf.Variable(w) for w in (INITIAL if initial is None else initial)]


def assert_close(got, expected, rtol=1e-10):
    for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected), strict=True):
        if e is None:                                   # a weight the loss does not read
            assert g is None
            continue
        g, e = np.asarray(g), np.asarray(e)
        assert np.linalg.norm(g - e) <= rtol * np.linalg.norm(e), np.linalg.norm(g - e) / np.linalg.norm(e)


def run_both(loss, args, specs=None, limit=LIMIT, initial=None):
    initial = initial or (HEADS if loss is multi_head else INITIAL)
    limit = 4 * limit if loss is multi_head else limit            # four heads' scores
    expected = tf.function(step_fn(loss, variables(initial)), jit_compile=True)(*args)
    tf_memsafe.enable(limit, strict=True)
    with splitter_only():
        split = tf.function(step_fn(loss, variables(initial)), jit_compile=True, input_signature=specs)
        got, footprint = run_and_measure(split, *args)      # (XLA's figure for the compile the call made)
    return got, expected, footprint


@pytest.mark.parametrize("loss", [mse, causal_mse, regularised, kernel_both_ways, multi_head],
                         ids=lambda f: f.__name__)
def test_one_loop_computes_the_loss_and_its_gradients(loss):
    got, expected, footprint = run_both(loss, (X, TARGET))
    plans = [p for p in loops() if p.roots[0].op_type in ("Mean", "Sum")]
    assert plans and all(p.fused for p in plans), [p.render() for p in loops()]
    assert "its gradients computed in the same loop" in plans[0].render()
    assert footprint <= (4 * LIMIT if loss is multi_head else LIMIT), [p.render() for p in loops()]
    assert_close(got, expected)


MLP = [RNG.standard_normal((16, 512)) / 4, RNG.standard_normal((512, 16)) / 16]


def mlp(x, t, weights):
    """A hidden layer of 512 a row: [1024, 512] float64, 4 MB, and its gradient as large."""
    return tf.reduce_mean(tf.square(tf.tanh(x @ weights[0]) @ weights[1] - t))


def test_its_chunk_is_planned_from_its_gradients_without_compiling_the_loop_alone(monkeypatch):
    """A loop computing its gradients as it goes is planned by the model's count of a slice's forward
    tensors and of their gradients in the backward as traced, not five forward slices' worth (the
    backward loop's factor): it is not starved, so no loop is compiled alone to grow it.  Before, the
    model gave it 16 rows (64 steps), grown by three compiles of the loop alone (each a trace of its
    body and an XLA compile: a Keras ViT's step spent 30 s of its 61 s of rewriting in four)."""
    compiled = []
    figure = mechanism.loop_figure
    monkeypatch.setattr(mechanism, "loop_figure", lambda *a, **k: compiled.append(a[3]) or figure(*a, **k))
    got, expected, footprint = run_both(mlp, (X, TARGET), initial=MLP)
    (plan,) = loops()
    records = [r for rep in tf_memsafe.reports() for r in rep.records if r.pass_name == "splitter"]
    assert plan.fused and L // plan.backward_chunk < DEFAULT_TUNING.fused_starved_steps, plan.render()
    assert compiled == [] and not [r for r in records if r.code in (Code.GROWN, Code.NOT_GROWN)], compiled
    assert footprint <= LIMIT
    assert_close(got, expected)


def test_the_prologue_is_differentiated_after_the_loop():
    run_both(multi_head, (X, TARGET))
    assert any(p.fused and p.prologue_ops for p in loops()), [p.render() for p in loops()]


def heads_over_centred(x, t, weights):
    """``multi_head`` on x centred over its rows (which couples the rows: computed before the loop),
    added back to x: the loop reads x and, in its prologue, a tensor computed from x outside it."""
    x = tf.tanh(x)
    centred = x - tf.reduce_mean(x, axis=0)
    q, k, v = (tf.einsum("ld,dhe->lhe", centred, w) for w in weights)
    probs = tf.nn.softmax(tf.einsum("lhe,mhe->hlm", q, k) / 4.0, -1)               # [H, L, L]
    return tf.einsum("hlm,mhe->le", probs, v) + x - t                               # [L, D]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_loops"])
def test_the_prologue_carries_each_input_its_own_gradient(fused):
    """The prologue's gradients go back to each input the others held fixed: x's share through the
    centred tensor is not added to x's own (it was before: 4 and 15 % off), whether the loop computes the
    loss and its gradients together (a mean) or has a gradient loop of its own (a max)."""
    def step(weights):
        def fn(x, t):
            with tf.GradientTape() as tape:
                tape.watch(x)
                rows = tf.reduce_mean(tf.square(heads_over_centred(x, t, weights)), 1)     # [L]
                value = tf.reduce_mean(rows) if fused else tf.reduce_max(rows)
            return value, tape.gradient(value, [x] + weights)
        return fn

    expected = tf.function(step(variables(HEADS)), jit_compile=True)(X, TARGET)
    tf_memsafe.enable(4 * LIMIT, strict=True)
    with splitter_only():
        got = tf.function(step(variables(HEADS)), jit_compile=True)(X, TARGET)
    plans = loops()
    assert any(p.prologue_ops and p.fused == fused for p in plans), [p.render() for p in plans]
    assert_close(got, expected)


def test_a_length_known_at_run_time_masks_the_last_slice():
    """A [None, D] input planned at a nominal length; called at lengths that are no multiple of the
    chunk: the rows past the end contribute neither to the loss nor to any gradient."""
    def step(weights):
        def fn(x):
            with tf.GradientTape() as tape:
                value = kernel_regression(x, weights)
            return value, tape.gradient(value, weights)
        return fn

    for n in (1000, 777):
        hook.clear_reports()
        expected = tf.function(step(variables(KERNEL)), jit_compile=True)(X[:n])
        tf_memsafe.enable(2 * LIMIT, strict=True)       # [n, 512, 16] differences: 64 kB a row
        with splitter_only():
            got = tf.function(step(variables(KERNEL)), jit_compile=True,
                              input_signature=[tf.TensorSpec([None, D], tf.float64)])(X[:n])
        plans = loops()
        assert plans and plans[0].fused and plans[0].dynamic, [p.render() for p in plans]
        assert_close(got, expected)
        tf_memsafe.disable()


BIAS = tf.Variable(RNG.standard_normal((H, D)) / 4)


def batched_heads(x, t, weights):
    """multi_head over a batch: [B, L, D] inputs, keys and values [B, L, H, D] (the prologue's) with a
    bias, as Keras' EinsumDense adds one (an ``Add`` whose gradient reads its inputs' shapes)."""
    q, k, v = (tf.tanh(tf.einsum("bld,dhe->blhe", x, w)) + BIAS for w in weights)
    probs = tf.nn.softmax(tf.einsum("blhe,bmhe->bhlm", q, k) / 4.0, -1)              # [B, H, L, L]
    return tf.reduce_mean(tf.square(tf.reduce_sum(tf.einsum("bhlm,bmhe->blhe", probs, v), 2) - t))


def test_a_padded_batch_fuses_its_loop_and_keeps_its_prologue():
    """Batch and length both known only at run time (a padded tf.data batch): the loop along the
    sequence, whose chunk is scaled to the run's sizes, still computes the loss's gradients as it goes
    and still recomputes the keys and values in its gradient, from products of the run-time sizes.
    Exact at two shapes of the one trace, neither a multiple of the other."""
    batch = tf.constant(RNG.standard_normal((3, 512, D)))
    target = tf.constant(RNG.standard_normal((3, 512, D)))
    spec = tf.TensorSpec([None, None, D], tf.float64)
    tf_memsafe.enable(8 * 10**6, strict=True)                # [2, 4, 512, 512] scores are 16.8 MB
    with splitter_only():
        split = tf.function(step_fn(batched_heads, variables(HEADS)), jit_compile=True, input_signature=[spec, spec])
        got = [split(batch[:b, :n], target[:b, :n]) for b, n in ((2, 512), (3, 301))]
    plans = [p for p in loops() if p.roots[0].op_type == "Mean"]
    assert plans and plans[0].dynamic and plans[0].fused and plans[0].prologue_ops, [p.render() for p in loops()]
    naive = tf.function(step_fn(batched_heads, variables(HEADS)), jit_compile=True)
    for (b, n), g in zip(((2, 512), (3, 301)), got):
        assert_close(g, naive(batch[:b, :n], target[:b, :n]))


def test_a_metric_beside_the_loss_is_computed_in_the_same_loop():
    """Keras' train_step computes the metrics from the same logits: an accuracy (an argmax compared
    with the targets, counted as floats) is a second floating scalar of the loop, whose gradient is
    zero by construction (no float path reaches the inputs), so the loop still computes the loss's
    gradients as it goes, the accuracy beside it."""
    weights = variables()

    def step(x, t):
        with tf.GradientTape() as tape:
            out = attention(x, weights)
            value = tf.reduce_mean(tf.square(out - t))
        hits = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(out, -1), tf.argmax(t, -1)), tf.float64))
        return value, hits, tape.gradient(value, weights)

    expected = tf.function(step, jit_compile=True)(X, TARGET)
    tf_memsafe.enable(LIMIT, strict=True)
    with splitter_only():
        got = tf.function(step, jit_compile=True)(X, TARGET)
    plans = [p for p in loops() if len(p.roots) == 2]
    assert plans and plans[0].fused, [p.render() for p in loops()]
    assert_close(got, expected)


def test_adam_steps_update_the_variables_as_written():
    import tf_keras as keras

    def train(weights):
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(weights)

        def step(x, t):
            with tf.GradientTape() as tape:
                value = mse(x, t, weights)
            optimizer.apply_gradients(zip(tape.gradient(value, weights), weights))
            return value
        return tf.function(step, jit_compile=True)

    naive_weights, split_weights = variables(), variables()
    naive = train(naive_weights)
    expected = [float(naive(X, TARGET)) for _ in range(3)]
    tf_memsafe.enable(LIMIT, strict=True)
    with splitter_only():
        split = train(split_weights)
        got = [float(split(X, TARGET)) for _ in range(3)]
    assert loops() and loops()[0].fused
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    assert_close([w.numpy() for w in split_weights], [w.numpy() for w in naive_weights])


class TestInputsNoGradientAsksFor:
    """A MoCo loss' negative queue: a non-trainable variable the logits read whole, [32, 8192].  The
    gradient inside asks for the encoder's weights only; the fused loop carried the queue's gradient,
    a sum as large as the queue, and the planner counted it held (a MoCo step at K = 65536: "best
    effort ... by the backward", 68.9 MB under 59 MB; 39 MB without it)."""

    B, D, K = 64, 32, 8192

    def setup_method(self):
        rng = np.random.default_rng(7)
        self.x = tf.constant(rng.standard_normal((self.B, 48)))
        self.w = tf.Variable(rng.standard_normal((48, self.D)) / 8)
        self.queue = tf.Variable(rng.standard_normal((self.D, self.K)) / 8, trainable=False)

    def loss(self, x):
        logits = tf.matmul(tf.matmul(x, self.w), self.queue)
        return tf.reduce_mean(tf.reduce_logsumexp(logits, axis=1) - logits[:, 0])

    def step(self, x):
        with tf.GradientTape() as tape:
            loss = self.loss(x)
        return loss, tape.gradient(loss, self.w)

    def test_its_gradient_is_not_computed_nor_counted(self):
        expected, naive = run_and_measure(tf.function(self.step, jit_compile=True), self.x)   # (the calls'
        tf_memsafe.enable(naive // 3, strict=True)                                              # compiles)
        with splitter_only():
            fn = tf.function(self.step, jit_compile=True)
            got, after = run_and_measure(fn, self.x)
            graph = fn.get_concrete_function(self.x).graph
        plan = loops()[0]
        assert plan.fused and plan.best_effort is None and after <= naive // 3, (plan.render(), after, naive)
        # (no sum of the queue's shape carried through the loop)
        carried = [t for op in graph.get_operations() if op.type in ("While", "StatelessWhile") for t in op.outputs]
        assert sum(t.shape == [self.D, self.K] for t in carried) <= 1        # the queue itself, read whole
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("inputs", ["x", "weights"])
def test_a_tape_outside_differentiates_the_gradients_the_loop_computed(inputs):
    """A gradient penalty: the step returns its loss and gradients, and a tape outside the function
    differentiates their squares (second order).  TensorFlow's gradient of the fused loop stacked its
    intermediates in TensorLists crossing from the forward program to the backward one, and XLA
    refused the call ("Support for TensorList crossing the XLA/TF boundary"); the loop is now built
    again in the backward program, and the outer gradients equal the step's as written.  That second
    order is not split: the backward is over the limit, and the tape check says so."""
    weights = variables()

    def step(x, t):
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = mse(x, t, weights)
        return value, tape.gradient(value, x if inputs == "x" else weights)

    def outer(fn):
        with tf.GradientTape() as tape:
            value, grads = fn(X, TARGET)
            penalty = value + sum(tf.reduce_sum(g ** 2) for g in tf.nest.flatten(grads))
        return penalty, tape.gradient(penalty, weights)

    expected = outer(tf.function(step, jit_compile=True))
    tf_memsafe.enable(LIMIT, strict=True)
    with splitter_only(), pytest.warns(RuntimeWarning, match="called under a GradientTape outside it runs"):
        got = outer(tf.function(step, jit_compile=True))
    assert any(p.fused for p in loops()), [p.render() for p in loops()]
    assert_close(got, expected)


class TestMustNotFuse:
    """Where a slice's gradient needs what only the backward knows, the loop stays a forward loop
    with a gradient loop of its own."""

    def test_an_output_that_keeps_the_split_axis(self):
        """The attention's [L, D] output goes on through a cumulative sum along the queries, which
        stops the region: the loop's output is no scalar, its upstream gradient a [L, D] tensor."""
        def loss(x, t, weights):
            return tf.reduce_mean(tf.square(tf.math.cumsum(attention(x, weights), 0) - t))

        got, expected, _ = run_both(loss, (X, TARGET))
        plans = loops()
        assert plans and not any(p.fused for p in plans), [p.render() for p in plans]
        assert_close(got, expected)

    def test_a_maximum(self):
        """A max's upstream goes to the slices holding the maximum, known only once all are seen."""
        def loss(x, t, weights):
            return tf.reduce_max(tf.square(attention(x, weights) - t))

        got, expected, _ = run_both(loss, (X, TARGET))
        plans = loops()
        assert plans and not any(p.fused for p in plans), [p.render() for p in plans]
        assert_close(got, expected)

    def test_a_scalar_the_gradients_do_not_read(self):
        """A metric over the attention beside a loss of the weights alone: its gradient is never
        taken, so computing it in the loop would only cost time."""
        weights = variables()

        def step(x, t):
            with tf.GradientTape() as tape:
                value = tf.reduce_sum(weights[0] ** 2)
            metric = tf.reduce_mean(tf.square(attention(x, weights) - t))
            return value, metric, tape.gradient(value, weights[0])

        expected = tf.function(step, jit_compile=True)(X, TARGET)
        tf_memsafe.enable(LIMIT, strict=True)
        with splitter_only():
            got = tf.function(step, jit_compile=True)(X, TARGET)
        plans = loops()
        assert plans and not any(p.fused for p in plans), [p.render() for p in plans]
        assert_close(got, expected)

    def test_a_tape_outside_the_function(self):
        """The function computes the loss only; its gradient is another function's business."""
        weights = variables()
        tf_memsafe.enable(LIMIT, strict=True)
        with splitter_only():
            fn = tf.function(lambda x, t: mse(x, t, weights), jit_compile=True)
            with tf.GradientTape() as tape:
                value = fn(X, TARGET)
            grads = tape.gradient(value, weights)
        plans = loops()
        assert plans and not any(p.fused for p in plans), [p.render() for p in plans]
        expected = step_fn(mse, weights)(X, TARGET)
        assert_close((value, grads), expected)



def test_a_prologue_waits_for_every_input_it_is_ordered_after():
    """The predicate a prologue's conditional waits on reads each tensor it is ordered after, not
    only the first (a decoder's first sliced input is the function's token ids: its cross-attention
    keys and values were computed for every layer at the program's start)."""
    from grappler_ext import graph_query
    from grappler_ext.splitter import loop

    with tf.Graph().as_default():
        tokens = tf.compat.v1.placeholder(tf.int32, [8])
        hidden = tf.compat.v1.placeholder(tf.float32, [8, 4])
        mask = tf.compat.v1.placeholder(tf.bool, [8])
        predicate = loop._opaque_true([tokens, hidden, mask])
        assert {tokens.op, hidden.op, mask.op} <= graph_query.ancestors([predicate])


@pytest.mark.parametrize("equation,index,perm", [
    ("aecd,abcd->acbe", 0, (0, 2, 1, 3)),       # Keras attention's keys [B, S, N, H], read as [B, N, S, H]
    ("acbe,aecd->abcd", 1, (0, 2, 1, 3)),       # and its values
    ("lhe,mhe->hlm", 1, (1, 0, 2)),             # multi_head's keys [L, H, D], read as [H, L, D]
    ("bij,bjk->bik", 1, None),                  # batch first already
    ("ld,dhe->lhe", 1, None),                   # no batch axis: three axes besides
    ("aecd,abcd->cabe", 0, None),               # batch axes in another order in the output
])
def test_an_einsum_operand_is_wanted_batch_first(equation, index, perm):
    graph = tf.Graph()
    with graph.as_default():
        rank = [len(s) for s in equation.split("->")[0].split(",")]
        a, b = (tf.compat.v1.placeholder(tf.float32, [2] * r) for r in rank)
        op = tf.einsum(equation, a, b).op
    assert loop._batch_first(op, index) == perm


def _transposes(graph_def) -> list[list[int]]:
    """The permutations of every Transpose in the functions of ``graph_def`` (loop bodies, branches)."""
    found = []
    for f in graph_def.library.function:
        consts = {n.name: n for n in f.node_def if n.op == "Const"}
        for n in f.node_def:
            if n.op == "Transpose":
                perm = consts.get(n.input[1].split(":")[0])
                if perm is not None:
                    found.append(tf.make_ndarray(perm.attr["value"].tensor).tolist())
    return found


def test_the_prologue_hands_its_einsum_operands_over_batch_first():
    """multi_head's keys and values [L, H, D] leave the prologue as [H, L, D], the order its einsums read
    them in (XLA copied them into it for the loop before, beside the prologue's own); the body turns
    them back, which XLA folds into the dots.  Values and gradients as written."""
    tf_memsafe.enable(4 * LIMIT, strict=True)
    with splitter_only():
        split = tf.function(step_fn(multi_head, variables(HEADS)), jit_compile=True)
        got = split(X, TARGET)
    expected = tf.function(step_fn(multi_head, variables(HEADS)), jit_compile=True)(X, TARGET)
    assert_close(got, expected)
    graph_def = split.get_concrete_function(X, TARGET).graph.as_graph_def()
    assert _transposes(graph_def).count([1, 0, 2]) >= 4, _transposes(graph_def)   # 2 in, 2 back, at least


def cross_attention_layers(x, context, weights):
    """Two decoder-style layers without gradients: each one's keys and values [L, H, D] projected
    from the same ``context`` [L, D] (four times its bytes), its queries from the layer before."""
    for layer in weights:
        q, k, v = (tf.einsum("ld,dhe->lhe", a, w) for a, w in zip((x, context, context), layer))
        probs = tf.nn.softmax(tf.einsum("lhe,mhe->hlm", q, k) / 4.0, -1)          # [H, L, L]
        x = x + tf.reduce_sum(tf.einsum("hlm,mhe->lhe", probs, v), 1)
    return x


def test_a_forward_computes_both_layers_keys_and_values_in_its_loops_prologue(monkeypatch):
    """Without gradients, the two layers are one loop along the queries (a row of the second's reads
    the same row of the first's), whose prologue computes both layers' keys and values (four einsums
    from the one context) once its sliced inputs exist; left outside the loop, XLA computes them side
    by side and holds transposed copies of them.  (Until the call's own figure was read here, the
    test traced the function twice and counted this one loop twice as "two loops".)"""
    weights = [[tf.constant(w) for w in HEADS], [tf.constant(w[:, ::-1]) for w in HEADS]]
    forward = lambda x, c: cross_attention_layers(x, c, weights)               # noqa: E731
    expected = tf.function(forward, jit_compile=True)(X, TARGET)
    tf_memsafe.enable(4 * LIMIT, strict=True)
    with splitter_only():
        got, figure = run_and_measure(tf.function(forward, jit_compile=True), X, TARGET)
    plans = loops()
    assert len(plans) == 1 and len(plans[0].prologue_ops) == 4, [p.render() for p in plans]
    assert_close(got, expected)
    # The loop's output buffer is made once its prologue has run (loop._made_after): made at the
    # program's start, XLA held it through the prologue's projections (measured: 6.8 MB, 4.1 MB now).
    assert figure <= 5 * 10**6, figure
    with monkeypatch.context() as m, splitter_only():
        m.setattr(loop, "_made_after", lambda carry, values, after: carry)
        early = tf_memsafe.memory_footprint(tf.function(forward, jit_compile=True), X, TARGET)
    assert 6 * 10**6 < early <= 4 * LIMIT, early
    monkeypatch.setattr(analysis, "prologue", lambda *a, **k: [])
    with splitter_only(), pytest.warns(RuntimeWarning, match="over its limit"):
        without = tf_memsafe.memory_footprint(tf.function(forward, jit_compile=True), X, TARGET)
    assert without > 4 * LIMIT, without            # (measured: 8.9 MB without, 4.1 MB with)
