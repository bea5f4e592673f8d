"""An attention inside a loop over query rows, computed in each slice by a loop over key blocks (issue 28).

An encoder layer split along its sequence reads its attention's keys and values whole: the loop's
prologue projects them from the layer's input, and every slice holds them beside the input and the
output.  Where the limit leaves less than that, each slice computes its attention over blocks of the
keys (:mod:`grappler_ext.splitter.nesting`, :mod:`~grappler_ext.splitter.nested_loop`), projecting
each block's keys and values from the input's rows in it: FlashAttention with its projections fused.

The layer here is the one Keras' ``MultiHeadAttention`` computes, written with its einsums (float64,
batch 2, L = 512, d_model 32, 4 heads): keys and values [2, 512, 4, 8] are 256 KiB each, as large as
the input and the output; the scores [2, 4, 512, 512] 16 MiB.  At a limit of 1.2 MB the loop over
rows alone is a best effort (1.44 MB by XLA's figure: the input, the output, the keys and the values
and a slice); computed by key blocks, within.  Every case compares with the layer as written.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.graph_query import live_ops, topological_order
from grappler_ext.pipeline import Pipeline
from grappler_ext.splitter import Splitter, analysis, nested_loop, nesting
from grappler_ext.splitter.outcome import Code, NestedKeys, Why
from tests.xla_run import run_and_measure
from tf_memsafe import hook
from tf_memsafe.memory import XlaMeasurer

B, L, D, N = 2, 512, 32, 4
H = D // N
LIMIT = 1_200_000
RNG = np.random.default_rng(0)
X = tf.constant(RNG.standard_normal((B, L, D)))


def _weights():
    rng = np.random.default_rng(1)

    def w(*shape):
        return tf.Variable(rng.standard_normal(shape) / np.sqrt(shape[0]))

    return dict(q=w(D, N, H), k=w(D, N, H), v=w(D, N, H), bq=w(N, H), bk=w(N, H), bv=w(N, H), o=w(N, H, D),
                f1=w(D, 2 * D), f2=w(2 * D, D))


def encoder(w, dropout_identity=False, mask=None):
    """Keras' attention (its einsums), its output projection, a residual and a feed-forward pair;
    ``mask``: "padding" (the last 7 keys, from their positions) or "causal" (a band of [L, L])."""
    def layer(x):
        q = tf.einsum("abc,cde->abde", x, w["q"]) + w["bq"]
        k = tf.einsum("abc,cde->abde", x, w["k"]) + w["bk"]
        v = tf.einsum("abc,cde->abde", x, w["v"]) + w["bv"]
        scores = tf.einsum("aecd,abcd->acbe", k, q * (1 / np.sqrt(H)))
        if mask == "padding":
            scores += tf.cast(tf.range(L) >= L - 7, scores.dtype)[None, None, None, :] * -1e9
        elif mask == "causal":
            scores += (1 - tf.linalg.band_part(tf.ones([L, L], scores.dtype), -1, 0)) * -1e9
        probs = tf.nn.softmax(scores)
        if dropout_identity:                                  # tf_keras' attention dropout at inference
            probs = tf.identity(probs)
        y = x + tf.einsum("abcd,cde->abe", tf.einsum("acbe,aecd->abcd", probs, v), w["o"])
        return y + tf.einsum("abf,fd->abd", tf.nn.relu(tf.einsum("abd,df->abf", y, w["f1"])), w["f2"])

    return layer


def _splitter_only():
    return hook.use_pipeline(Pipeline([Splitter(XlaMeasurer())]))


def _plans():
    return [r.plan for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "splitter" and r.action == "rewritten"]


def _close(got, want, what=""):
    for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
        g, e = np.asarray(g), np.asarray(e)
        assert np.linalg.norm(g - e) <= 1e-10 * np.linalg.norm(e), (what, np.linalg.norm(g - e) / np.linalg.norm(e))


def _split(layer, limit=LIMIT):
    tf_memsafe.enable(limit, strict=True)
    try:
        with _splitter_only():
            got, figure = run_and_measure(tf.function(layer, jit_compile=True), X)   # (the call's compile)
    finally:
        tf_memsafe.disable()
    return got, figure, _plans()


@pytest.mark.parametrize("identity", [False, True], ids=["softmax_read_directly", "through_an_identity"])
def test_each_slice_computes_its_attention_by_key_blocks_within_the_limit(identity):
    layer = encoder(_weights(), identity)
    want = tf.function(layer, jit_compile=True)(X)
    got, figure, plans = _split(layer)
    nested = [p for p in plans if p.nested is not None]
    assert nested, [p.render() for p in plans]
    assert nested[0].nested.key_block == 64 and nested[0].nested.keys == L and nested[0].nested.moved == 4
    assert "its keys and values projected there" in nested[0].render()
    assert figure <= LIMIT, [p.render() for p in plans]
    # The input, the output, the keys and the values are 256 KiB each: never all held at once.
    assert figure < 4 * B * L * D * 8
    _close(got, want)


@pytest.mark.parametrize("mask", ["padding", "causal"])
def test_a_mask_on_the_scores(mask):
    """A padding mask along the keys, computed before the loop from the keys' positions: its ops are
    read by the key region alone, so the key blocks' loop computes them too (within the limit).  A
    causal mask built in the function is cut by the query rows and by the keys, and a block's would
    need both offsets: not nested (over the limit, warned).  Exact either way."""
    layer = encoder(_weights(), mask=mask)
    want = tf.function(layer, jit_compile=True)(X)
    got, figure, plans = _split(layer)
    nested = any(p.nested is not None for p in plans)
    assert nested == (mask == "padding"), [p.render() for p in plans]
    assert (figure <= LIMIT) == nested, (figure, [p.render() for p in plans])
    _close(got, want)


def test_the_gradients_through_it_with_the_tape_outside():
    """The inner loop's own gradient (its backward over the key blocks), differentiated through by the
    outer loop's: the input's and every weight's gradients as the layer's as written (but the keys'
    bias, whose gradient is zero up to rounding: softmax ignores it)."""
    w = _weights()
    layer = encoder(w)
    weights = [v for name, v in w.items() if name != "bk"]

    def gradients(fn):
        with tf.GradientTape() as tape:
            tape.watch(X)
            value = tf.reduce_sum(tf.sin(fn(X)))
        return value, tape.gradient(value, [X] + weights)

    want = gradients(tf.function(layer, jit_compile=True))
    tf_memsafe.enable(LIMIT, strict=True)
    try:
        with _splitter_only():
            got = gradients(tf.function(layer, jit_compile=True))
    finally:
        tf_memsafe.disable()
    assert any(p.nested is not None for p in _plans()), [p.render() for p in _plans()]
    _close(got, want)


def test_where_the_loop_fits_without_it_nothing_is_nested():
    """Key blocks cost a projection of every key per slice: only a best effort is nested."""
    layer = encoder(_weights())
    got, figure, plans = _split(layer, limit=2_000_000)
    assert plans and not any(p.nested for p in plans), [p.render() for p in plans]
    assert figure <= 2_000_000
    _close(got, tf.function(layer, jit_compile=True)(X))


def _grown(fn, *args, axis=1):
    """The graph of ``fn`` and the region of its loop over ``axis`` of its output, ending at its last
    ``AddV2``, with its prologue (as the splitter grows them)."""
    graph = tf.function(fn).get_concrete_function(*args).graph
    order = topological_order(graph, live_ops(graph))
    index = {op: i for i, op in enumerate(order)}
    outputs = {t.ref() for t in graph.outputs}
    root = [op for op in order if op.type == "AddV2"][-1]
    option = next(o for o in analysis.root_options(root) if o.kind == "concat" and o.output_axes[0] == axis)
    grown = analysis.grow([option], outputs, index)
    grown.region.prologue = analysis.prologue(grown, index, outputs, frozenset(), 1e9, 1.0, 64, 0)
    return graph, grown, outputs, index


def test_the_analysis_finds_the_attention_and_what_moves_into_its_loop():
    graph, grown, outputs, index = _grown(encoder(_weights()), X)
    nest = nesting.attention_within(grown, outputs, index)
    assert isinstance(nest, nesting.Nest), nest
    assert nest.option.kind == "online_softmax" and nest.keys == L
    assert sorted(op.type for op in nest.moved) == ["AddV2", "AddV2", "Einsum", "Einsum"]
    assert nest.saved == 2 * B * L * N * H * 8                     # the keys and the values
    region = nested_loop.nested(grown, nest, 64).region
    assert set(region.prologue) == set(grown.region.prologue) - nest.moved
    assert nest.option.root in region.ops and not any(op in region.ops for op in nest.option.absorbed)
    x = graph.inputs[0]
    assert x.ref() in region.whole_inputs and x.ref() in region.sliced_inputs    # keys' rows, and the slice's
    assert x in region.inputs_of[nest.option.root]
    assert grown.region.inputs_of == {}                            # the region as grown is left as it was


def test_keys_and_values_given_whole_are_not_nested():
    """Cross-attention on keys and values the function is given: nothing is projected before the
    loop, so key blocks would save nothing."""
    w = _weights()

    def cross(x, k, v):
        q = tf.einsum("abc,cde->abde", x, w["q"])
        probs = tf.nn.softmax(tf.einsum("aecd,abcd->acbe", k, q))
        return x + tf.einsum("abcd,cde->abe", tf.einsum("acbe,aecd->abcd", probs, v), w["o"])

    kv = tf.zeros([B, L, N, H], tf.float64)
    _, grown, outputs, index = _grown(cross, X, kv, kv)
    why = nesting.attention_within(grown, outputs, index)
    assert isinstance(why, Why) and why.code == Code.NO_PROLOGUE, why


def test_keys_of_the_slices_own_rows_are_not_nested():
    """Attention within each batch row, split along the batch: the keys carry the loop's axis, so the
    loop computes them by slice and there is nothing whole to project by key block."""
    layer = encoder(_weights())
    _, grown, outputs, index = _grown(layer, X, axis=0)
    why = nesting.attention_within(grown, outputs, index)
    assert isinstance(why, Why), why


@pytest.mark.parametrize("keys, block", [(1024, 128), (512, 64), (2048, 256), (4096, 512), (1000, 125), (96, 48),
                                         (100, 50)])
def test_key_blocks_divide_the_keys_where_they_can(keys, block):
    assert nested_loop.key_chunk(keys) == block


def test_the_record_renders_its_blocks():
    text = NestedKeys("mha/einsum_1", 128, 1024, 4).render()
    assert text.startswith("`mha/einsum_1` computed in each slice over its keys in blocks (8 x 128 of 1024)")
    assert "(4 ops no longer computed whole before the loop)" in text
    assert "8 x 120 + 64 of 1024" in NestedKeys("a", 120, 1024, 2).render()
