"""tiling and tiled_loop: an attention split along its keys computed in query x key tiles, its masked tiles skipped.

Sizes, worked out: L = 1200 queries and keys, d = 16, float64: the scores are [1200, 1200] = 11.5 MB,
and a 6 MB limit splits them (the untiled loop's slices hold every query row).  The tiles are then
about 150 x 150 (8 x 8 of them; a causal mask skips the 28 above the diagonal).
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_memsafe
from grappler_ext.pipeline import Pipeline
from grappler_ext.splitter import Splitter, analysis, mechanism, tiling
from tf_memsafe import hook
from tf_memsafe.memory import XlaMeasurer

L, D = 1200, 16
LIMIT = 6 * 10**6


def points(n, d, seed):
    return tf.constant(np.random.default_rng(seed).standard_normal((n, d)), tf.float64)


def splitter_only():
    return hook.use_pipeline(Pipeline([Splitter(XlaMeasurer())]))


def loops():
    return [r.plan for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "splitter" and r.action == "rewritten"]


def band_causal(scores, n):
    return tf.linalg.band_part(tf.ones_like(scores), -1, 0) > 0                    # built in the region


def range_causal(scores, n):
    return tf.range(n)[:, None] >= tf.range(n)[None, :]


def padded_queries(scores, n):
    """Causal, and the last quarter of the queries padding (Keras' query mask): those rows see no key."""
    return tf.logical_and(range_causal(scores, n), tf.range(n)[:, None] < 3 * n // 4)


def padding_only(scores, n):
    return tf.range(n)[None, :] < 3 * n // 4


def no_mask(scores, n):
    return tf.ones_like(scores) > 0


def attention(mask, n=L, fill=-1e9):
    def attend(q, k, v):
        scores = tf.matmul(q, k, transpose_b=True) / 4.0                            # [n, n]
        scores = tf.where(mask(scores, n), scores, tf.constant(fill, scores.dtype))
        return tf.nn.softmax(scores, axis=-1) @ v
    return attend


def output_and_grads(fn, *args):
    """``fn(*args)`` traced anew with ``jit_compile`` and the gradients of ``sum(sin(out))`` by a tape outside."""
    f = tf.function(fn, jit_compile=True)
    with tf.GradientTape() as tape:
        tape.watch(args)
        out = f(*args)
        loss = tf.reduce_sum(tf.sin(out))
    return out, tape.gradient(loss, args)


@pytest.fixture
def keys_only(monkeypatch):
    """Only splits along the keys are offered (row splits, which the planner may prefer, withheld)."""
    offered = analysis.root_options
    monkeypatch.setattr(analysis, "root_options",
                        lambda root, ignored=frozenset(): [o for o in offered(root, ignored) if o.kind != "concat"])


def split(fn, *args, limit=LIMIT):
    expected = output_and_grads(fn, *args)
    tf_memsafe.enable(limit, strict=True)
    with splitter_only():
        got = output_and_grads(fn, *args)
    return got, expected


def assert_equal(got, expected):
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-10, atol=1e-12)
    for g, e in zip(got[1], expected[1]):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------- the policy, pure


@pytest.mark.parametrize("queries, keys, elements, expected", [
    (4096, 4096, 4096 * 512, (512, 512)),        # an eighth of the keys
    (2000, 2000, 2000 * 1000, (250, 250)),
    (1900, 1900, 1900 * 950, (190, 190)),        # 190 divides 1900, the largest to divide it under 237
    (4096, 4096, 4096 * 8, (128, 128)),          # tiny slices: tiles of at least 128
    (100, 4096, 100 * 2048, (100, 256)),         # few queries: one block of them
    (200, 200, 200 * 50, None),                  # too few keys to tile
    (1499, 1499, 1499 * 500, None),              # 1499 is prime: no key block divides it
])
def test_tile_sizes(queries, keys, elements, expected):
    got = tiling.tile_sizes(queries, keys, elements)
    assert got == expected
    if got is not None:
        assert keys % got[1] == 0 and got[1] >= tiling.MIN_TILE


def test_a_causal_schedule_skips_the_tiles_above_the_diagonal(keys_only):
    """8 x 8 tiles of a causal mask: block i computes key blocks 0..i, 28 of 64 skipped; the last query
    block, moved back, starts where it must to end at the last row and owns only its new rows."""
    q, k, v = (points(L, D, s) for s in range(3))
    tf_memsafe.enable(LIMIT, strict=True)
    with splitter_only():
        tf.function(attention(range_causal), jit_compile=True)(q, k, v)
    [plan] = loops()
    assert plan.tiles is not None and plan.tiles.skipped >= 0.4 * plan.tiles.total
    assert "masked and skipped" in plan.render()


# ---------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("mask", [band_causal, range_causal, padded_queries])
def test_tiled_values_and_gradients_equal_the_unsplit_ones(keys_only, mask):
    """float64, tape outside: the tiled loop's output and the gradients of q, k and v equal the
    unsplit ones, the padded query rows (no unmasked key: all their tiles computed) included."""
    q, k, v = (points(L, D, s) for s in range(3))
    got, expected = split(attention(mask), q, k, v)
    [plan] = loops()
    assert plan.tiles is not None
    assert_equal(got, expected)


def test_rows_that_see_no_key_need_every_tile(keys_only, monkeypatch):
    """Without the fallback for rows that saw only masked scores, the padded query rows would be
    spread over the keys of their computed tiles only: not the unsplit result."""
    planned = tiling.plan

    def without_fallback(*args, **kwargs):
        tiles = planned(*args, **kwargs)
        return tiles if isinstance(tiles, str) else tiling.TilePlan(**{**tiles.__dict__, "dead_below": float("-inf")})

    monkeypatch.setattr(tiling, "plan", without_fallback)
    q, k, v = (points(L, D, s) for s in range(3))
    got, expected = split(attention(padded_queries), q, k, v)
    assert loops()[0].tiles is not None
    live = 3 * L // 4
    np.testing.assert_allclose(got[0][:live], expected[0][:live], rtol=1e-10, atol=1e-12)
    assert not np.allclose(got[0][live:], expected[0][live:], rtol=1e-6)


def bottom_right_causal(queries, keys):
    """The causal mask of the last ``queries`` of ``keys`` positions (a decoder continuing a prefix)."""
    def attend(q, k, v):
        scores = tf.matmul(q, k, transpose_b=True) / 4.0                            # [queries, keys]
        keep = tf.range(queries)[:, None] + (keys - queries) >= tf.range(keys)[None, :]
        return tf.nn.softmax(tf.where(keep, scores, tf.constant(-1e9, scores.dtype)), axis=-1) @ v
    return attend


def test_a_remainder_of_rows_overlaps_and_keys_divide(keys_only):
    """1000 queries of 1330 keys: the last query block is moved back over rows an earlier block computed
    (they take no gradient twice); key blocks divide 1330."""
    q = points(1000, D, 0)
    k, v = (points(1330, D, s) for s in (1, 2))
    got, expected = split(bottom_right_causal(1000, 1330), q, k, v)
    [plan] = loops()
    assert plan.tiles is not None and 1330 % plan.tiles.key_block == 0 and 1000 % plan.tiles.query_block
    assert_equal(got, expected)


def test_padded_keys_tiles_are_skipped(keys_only):
    """A padding mask the graph computes from positions (the last quarter of the keys): the key
    blocks wholly past it are skipped for every query block, the rest computed."""
    q, k, v = (points(L, D, s) for s in range(3))
    got, expected = split(attention(padding_only), q, k, v)
    [plan] = loops()
    tiles = plan.tiles
    key_blocks = L // tiles.key_block
    padded = sum(j * tiles.key_block >= 3 * L // 4 for j in range(key_blocks))
    assert padded and tiles.skipped == padded * (tiles.total // key_blocks)
    assert_equal(got, expected)


def test_a_training_step_with_the_tape_inside():
    """Projections inside the function, the loss and its gradients in the same jit function: the
    planner prefers the tiled attention (about half its tiles skipped) to a loop over the rows computing
    every score, a projection read whole computed by its prologue (from the input it slices anyway),
    and the weights' gradients equal the unsplit ones."""
    x = points(L, D, 0)
    weights = [tf.Variable(np.random.default_rng(s).standard_normal((D, D)) / 4) for s in (1, 2, 3)]
    target = points(L, D, 4)

    def step(x, t):
        with tf.GradientTape() as tape:
            q, k, v = (x @ w for w in weights)
            out = attention(range_causal)(q, k, v)
            loss = tf.reduce_mean(tf.square(out - t))
        return loss, tape.gradient(loss, weights)

    expected = tf.function(step, jit_compile=True)(x, target)
    tf_memsafe.enable(LIMIT, strict=True)
    with splitter_only():
        got = tf.function(step, jit_compile=True)(x, target)
    [plan] = loops()
    assert plan.tiles is not None and plan.rebuilt_gradients == 1 and plan.prologue_ops
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-10)
    for g, e in zip(got[1], expected[1]):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- must not tile


@pytest.mark.parametrize("mask, why", [(no_mask, "no tile is proven masked")])
def test_attention_without_masked_tiles_is_not_tiled(keys_only, monkeypatch, mask, why):
    reasons = []
    untiled = mechanism.untiled

    def recorded(*args, **kwargs):
        found = untiled(*args, **kwargs)
        reasons.append(found)
        return found

    monkeypatch.setattr(mechanism, "untiled", recorded)
    q, k, v = (points(L, D, s) for s in range(3))
    got, expected = split(attention(mask), q, k, v)
    [plan] = loops()
    assert plan.tiles is None and "tiles" not in plan.render()
    assert why in reasons
    assert_equal(got, expected)


def test_a_reshape_carrying_the_query_rows_is_not_tiled(keys_only, monkeypatch):
    """A reshape's slice along the keys is rebuilt for all the query rows: building a tile in a
    scratch graph fails before anything is changed, so the loop is left untiled, and says why."""
    reasons = []
    untiled = mechanism.untiled
    monkeypatch.setattr(mechanism, "untiled", lambda *a, **k: reasons.append(untiled(*a, **k)) or reasons[-1])

    def reshaped(q, k, v):
        scores = tf.reshape(tf.matmul(q, k, transpose_b=True) / 4.0, [1, L, L])[0]   # carries both axes
        scores = tf.where(range_causal(scores, L), scores, tf.constant(-1e9, scores.dtype))
        return tf.nn.softmax(scores, axis=-1) @ v

    q, k, v = (points(L, D, s) for s in range(3))
    got, expected = split(reshaped, q, k, v)
    [plan] = loops()
    assert plan.tiles is None
    assert any(isinstance(r, str) and "building a tile failed" in r for r in reasons), reasons
    assert_equal(got, expected)


def test_a_mask_of_only_minus_ten_is_not_masking(keys_only):
    """exp(s - 10 - m) is not 0: such tiles are not skipped (the loop is untiled, values unchanged)."""
    q, k, v = (points(L, D, s) for s in range(3))
    got, expected = split(attention(range_causal, fill=-10.0), q, k, v)
    [plan] = loops()
    assert plan.tiles is None
    assert_equal(got, expected)


def test_keras_multi_head_attention_with_a_causal_mask_is_tiled():
    """Keras 3's ``MultiHeadAttention(use_causal_mask=True)`` (its output an ``Einsum``, BNTS,BSNH->BTNH,
    whose row statistics the online softmax keeps in the output's layout), the tape inside: split
    along the keys in tiles (its causal mask a band part sliced to [1, 1, T, S], rebuilt per tile),
    the output and every gradient equal to the layer's own in float64."""
    import keras

    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16, dtype="float64")
    x = points(2 * 1024, 32, 0)
    x = tf.reshape(x, [2, 1024, 32])
    layer(x, x, use_causal_mask=True)

    def step(q):
        with tf.GradientTape() as tape:
            tape.watch(q)
            out = layer(q, q, use_causal_mask=True)
            loss = tf.reduce_sum(tf.sin(out))
        return out, tape.gradient(loss, [q] + layer.trainable_variables)

    expected = tf.function(step, jit_compile=True)(x)
    tf_memsafe.enable(40 * 10**6, strict=True)
    with splitter_only():
        got = tf.function(step, jit_compile=True)(x)
    [plan] = loops()
    assert plan.roots[0].op_type == "Einsum" and plan.tiles is not None, plan.render()
    assert plan.tiles.skipped == 28 * plan.tiles.total // 64
    assert_equal((got[0], got[1]), (expected[0], expected[1]))


@pytest.mark.parametrize("equation, shapes_, accepted", [
    ("BNTS,BSNH->BTNH", ([2, 3, 4, 5], [2, 5, 3, 6]), True),     # Keras' MultiHeadAttention
    ("ij,jk->ik", ([4, 5], [5, 6]), True),
    ("ij,kj->ik", ([4, 5], [6, 5]), True),                       # the values transposed
    ("bij,bjk->bk", ([2, 4, 5], [2, 5, 6]), False),              # the queries summed over too
    ("ij,jk->ijk", ([4, 5], [5, 6]), False),                     # the keys kept
    ("ji,jk->ik", ([5, 4], [5, 6]), False),                      # the keys not the last axis
])
def test_which_einsums_are_softmax_times_values(equation, shapes_, accepted):
    from grappler_ext.splitter.analysis import softmax_einsum

    with tf.Graph().as_default():
        a, b = (tf.compat.v1.placeholder(tf.float32, s) for s in shapes_)
        root = tf.einsum(equation, a, b).op
        while root.type != "Einsum":                             # (tf.einsum may add a transpose)
            root = root.inputs[0].op
        assert (softmax_einsum(root) is not None) == accepted
