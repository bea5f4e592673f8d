"""masked_tiles: exactly the tiles a mask makes fully masked are proven, and never one with an unmasked score.

Each case builds the scores of a small attention the way a library does (L = 64, blocks of 16: a 4 x 4 grid
of tiles, 256 scores each), finds the ``Softmax`` op's input in the traced graph and compares the proven
tiles with the tiles whose every score the mask masks, worked out element by element from the mask's rule
(causal: 6 of the 16 tiles, those whose first key comes after the block's last query).  Where the scores
are computed from ``s`` alone, the claim itself is checked too: with ``s = 0`` (a zero data part) every score
of a skipped tile is at most ``bound``, and with random ``s`` the softmax there is exactly 0, so that leaving
those tiles out changes no bit.  Each case that must prove nothing has, where one exists, a nearest variant
that is proven, so that the refusal is the case's own.
"""

import numpy as np
import pytest
import tensorflow as tf

from grappler_ext.constant_cumsum import ConstantCumsum, running_index
from grappler_ext.pass_base import PassOptions
from grappler_ext.splitter.masked_tiles import MAX_VISITS, THRESHOLD, masked_tiles

L = 64


def blocks(n, size=16, start=0):
    return [(s, min(s + size, n)) for s in range(start, n, size)]


GRID = blocks(L)
TRIL = np.tril(np.ones((128, 128), np.float32))[None, None]       # GPT-2's causal buffer
causal = lambda r, c: c > r                                   # masked where the key comes after the query


def softmax_input(graph):
    (op,) = [op for op in graph.get_operations() if op.type == "Softmax"]
    return op.inputs[0]


def traced(masked, shape=(2, L, L), extra=()):
    """The graph of ``softmax(masked(s, *extra))``, ``s`` a [2, Lq, Lk] placeholder."""
    fn = tf.function(lambda s, *e: tf.nn.softmax(masked(s, *e)))
    return fn.get_concrete_function(tf.TensorSpec(shape), *extra).graph


def fully_masked(rule, rows, cols):
    """Tile (i, j) is fully masked: ``rule(query, key)`` holds for each of its scores."""
    return np.array([[rule(np.arange(*r)[:, None], np.arange(*c)[None]).all() for c in cols] for r in rows])


def tile_values(values, result, rows, cols):
    """The elements of ``values`` [.., Lq, Lk] in the skipped tiles."""
    return [values[..., slice(*rows[i]), slice(*cols[j])] for i, j in zip(*np.nonzero(result.skipped))]


def check(masked, rule, rows=GRID, cols=GRID, shape=(2, L, L), extra=(), numeric=True):
    """The proven tiles are the fully masked ones.  With ``numeric``: the bound holds on ``masked(0)``, and
    on random scores the softmax is exactly 0 in the skipped tiles (leaving them out changes no bit)."""
    result = masked_tiles(softmax_input(traced(masked, shape, extra)), rows, cols)
    want = fully_masked(rule, rows, cols)
    assert want.any() and result is not None
    np.testing.assert_array_equal(result.skipped, want)
    assert result.bound <= -THRESHOLD
    if numeric:
        assert all((v <= result.bound).all() for v in tile_values(masked(tf.zeros(shape)).numpy(), result, rows, cols))
        s = tf.random.stateless_normal(shape, seed=(1, 2)) * 4
        assert all((p == 0).all() for p in tile_values(tf.nn.softmax(masked(s)).numpy(), result, rows, cols))
    return result


def band_mask(lq=L, lk=L):
    return tf.linalg.band_part(tf.ones((lq, lk)), -1, 0)           # 1 where the key is not after the query


def index_grid(lq=L, lk=L):
    return tf.range(lq)[:, None], tf.range(lk)[None, :]


class TestAdditive:
    """The TensorFlow tutorial's look-ahead mask, added to the scores scaled by -1e9."""

    def test_one_minus_mask_times_minus_1e9(self):
        result = check(lambda s: s + (1 - band_mask()) * -1e9, causal)
        assert result.bound == -1e9
        assert not np.diag(result.skipped).any()                     # the diagonal tiles are only half masked
        np.testing.assert_array_equal(result.skipped, [[c[0] > r[1] - 1 for c in GRID] for r in GRID])

    def test_minus_1e9_times_one_minus_mask(self):
        check(lambda s: s - 1e9 * (1 - band_mask()), causal)

    def test_scaled_after_masking_by_a_positive_constant(self):
        result = check(lambda s: (s - 1e9 * (1 - band_mask())) / 8.0, causal)
        assert result.bound == -1e9 / 8

    def test_gpt2_buffer_sliced_bottom_right(self):
        """GPT-2 keeps a [1, 1, 128, 128] lower triangle and reads ``b[:, :, nk - nq:nk, :nk]``: the slice
        shifts the query index by 32; ``s * b - 1e4 * (1 - b)`` is exactly -1e4 at a masked score.  (The
        buffer is a constant of the graph; captured as an input it proves nothing: see TestNotMasked.)"""
        def masked(s):
            b = tf.constant(TRIL)[:, :, 32:64, :64]
            return s * b - 1e4 * (1 - b)
        result = check(masked, lambda r, c: c > r + 32, rows=blocks(32), shape=(2, 2, 32, L))
        assert result.bound == -1e4


class TestWhere:
    """``tf.where(query >= key, s, fill)`` from ranges."""

    @pytest.mark.parametrize("fill", [float("-inf"), -1e9, "tf.fill", "splat constant"])
    def test_causal(self, fill):
        def masked(s):
            r, c = index_grid()
            other = {"tf.fill": lambda: tf.fill(tf.shape(s), -1e9),
                     "splat constant": lambda: tf.constant(-1e9, shape=(L, L))}.get(fill, lambda: fill)()
            return tf.where(r >= c, s, other)
        result = check(masked, causal)
        assert result.bound == (-np.inf if fill == float("-inf") else -1e9)

    def test_transposed_mask(self):
        """The mask built key-major [Lk, Lq] and transposed: the coordinates follow the permutation."""
        check(lambda s: tf.where(tf.transpose(tf.range(L)[:, None] <= tf.range(L)[None, :]), s, -1e9), causal)

    def test_bottom_right_causal_lq_below_lk(self):
        def masked(s):
            r, c = index_grid(32, L)
            return tf.where(c <= r + (L - 32), s, -1e9)
        check(masked, lambda r, c: c > r + (L - 32), rows=blocks(32), shape=(2, 32, L))

    def test_sliding_window_skips_both_sides(self):
        def masked(s):
            r, c = index_grid()
            return tf.where(tf.abs(r - c) < 16, s, float("-inf"))
        result = check(masked, lambda r, c: abs(r - c) >= 16)
        assert result.skipped[0, 3] and result.skipped[3, 0] and not result.skipped[1, 2]

    @pytest.mark.parametrize("lower", [-1, 0, 5, 20])
    @pytest.mark.parametrize("upper", [0, 7, 30])
    def test_band_part_widths(self, lower, upper):
        mask = lambda r, c: ~(((lower < 0) | (r - c <= lower)) & ((upper < 0) | (c - r <= upper)))
        check(lambda s: tf.where(tf.linalg.band_part(tf.ones((L, L), tf.bool), lower, upper), s, -1e9), mask)

    @pytest.mark.parametrize("dtype", [tf.int32, tf.float32])
    @pytest.mark.parametrize("exclusive", [False, True])
    @pytest.mark.parametrize("reverse", [False, True])
    def test_running_sums_of_ones(self, dtype, exclusive, reverse):
        """Keras' construction: the row index and the column index as cumsums of ones, compared."""
        k = running_index(L, exclusive, reverse)

        def masked(s):
            ones = tf.ones((1, L, L), dtype)
            r, c = (tf.cumsum(ones, axis, exclusive=exclusive, reverse=reverse) for axis in (-2, -1))
            return tf.where(r >= c, s, -1e9)
        check(masked, lambda r, c: ~(k[r] >= k[c]))

    def test_overlapping_blocks(self):
        """L = 56: the last query block moved back to fit, overlapping the one before it."""
        rows = [(0, 16), (16, 32), (32, 48), (40, 56)]

        def masked(s):
            r, c = index_grid(56, 56)
            return tf.where(r >= c, s, -1e9)
        result = check(masked, causal, rows=rows, cols=rows, shape=(2, 56, 56))
        assert result.skipped[3].tolist() == [False, False, False, False]

    def test_key_blocks_across_the_diagonal(self):
        """Key blocks shifted by 8: the tiles the diagonal crosses are partly masked, never skipped."""
        cols = [(0, 8)] + blocks(L, start=8)
        result = check(lambda s: tf.where(index_grid()[0] >= index_grid()[1], s, -1e9), causal, cols=cols)
        assert not result.skipped[np.arange(4), np.arange(1, 5)].any()

    def test_causal_and_a_padding_mask_from_an_input(self):
        """False AND unknown is false: the causal tiles are still proven, the padding adds none."""
        def masked(s, keys):
            r, c = index_grid()
            return tf.where(keys[:, None, :] & (r >= c), s, -1e9)
        check(masked, causal, extra=(tf.TensorSpec((2, L), tf.bool),), numeric=False)


def _causal_bool():
    r, c = index_grid()
    return c > r                                                      # True where masked


RULE_CASES = {   # name: (scores from s, which scores are masked); one rule each, beside those the cases above use
    "Greater, Select": (lambda s: tf.compat.v1.where(tf.broadcast_to(_causal_bool(), s.shape), s * 0 - 1e9, s),
                        causal),
    "Less": (lambda s: tf.where(index_grid()[0] < index_grid()[1], float("-inf"), s), causal),
    "Equal, Minimum": (lambda s: tf.where(tf.equal(tf.minimum(*index_grid()), index_grid()[1]), s, -1e9), causal),
    "NotEqual, Maximum": (lambda s: tf.where(tf.not_equal(tf.maximum(*index_grid()), index_grid()[0]), -1e9, s),
                          causal),
    "LogicalOr with an unknown": (lambda s, pad: tf.where(_causal_bool() | pad[:, None, :], -1e9, s), causal),
    "LogicalNot": (lambda s: tf.where(~_causal_bool(), s, -1e9), causal),
    "Neg, Add": (lambda s: tf.raw_ops.Add(x=s, y=-(tf.cast(_causal_bool(), tf.float32) * 1e9)), causal),
    "Cast to bool": (lambda s: tf.where(tf.cast(tf.maximum(index_grid()[1] - index_grid()[0], 0), tf.bool), -1e9, s),
                     causal),
    "Cast float to int": (lambda s: tf.where(tf.cast(tf.cast(index_grid()[1] - index_grid()[0], tf.float32) * 0.5,
                                                     tf.int32) > 0, -1e9, s),
                          lambda r, c: np.trunc((c - r) * 0.5) > 0),
    "Minimum of data and known": (lambda s: tf.minimum(s, tf.where(_causal_bool(), -1e9, 1e9)), causal),
    "Squeeze": (lambda s: tf.where(tf.squeeze(_causal_bool()[:, None, :], axis=1), -1e9, s), causal),
    "Slice": (lambda s: tf.where(tf.slice(tf.range(2 * L)[:, None] - 32 < index_grid()[1], [32, 0], [L, L]),
                                 -1e9, s), causal),
    "ZerosLike, OnesLike": (lambda s: s + tf.where(_causal_bool(), tf.raw_ops.OnesLike(x=s) * -1e9,
                                                   tf.raw_ops.ZerosLike(x=s)), causal),
    "identities": (lambda s: s + tf.raw_ops.PreventGradient(input=tf.raw_ops.Snapshot(input=tf.stop_gradient(
        tf.identity(tf.ensure_shape(tf.debugging.check_numerics(tf.cast(_causal_bool(), tf.float32), "m"),
                                    (L, L)))))) * -1e9, causal),
    "Reshape merging batch axes": (lambda s: tf.reshape(tf.where(_causal_bool(), -1e9, s), [4, L, L]), causal),
    "StridedSlice: ellipsis, shrink": (lambda s: tf.where(_causal_bool()[None, None][0, ..., :, :], -1e9, s), causal),
    "float Range": (lambda s: tf.where(tf.range(L, dtype=tf.float32)[:, None] >= tf.range(L, dtype=tf.float32),
                                       s, -1e9), causal),
    "scaled up after masking": (lambda s: (s - 1e9 * tf.cast(_causal_bool(), tf.float32)) * 10.0, causal),
}
RULE_EXTRA = {"LogicalOr with an unknown": (tf.TensorSpec((2, L), tf.bool),)}


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_rule(case):
    masked, rule = RULE_CASES[case]
    extra = RULE_EXTRA.get(case, ())
    shape = (2, 2, L, L) if case.startswith("Reshape") else (2, L, L)
    check(masked, rule, shape=shape, extra=extra, numeric=not extra)


def test_select_by_rows():
    """``Select`` with a vector condition picks whole rows of axis 0 (here the query axis)."""
    masked = lambda s: tf.compat.v1.where(tf.range(L) >= 40, tf.fill([L, L], -1e9), s)
    check(masked, lambda r, c: r >= 40 + 0 * c, shape=(L, L), numeric=False)     # (rows with no unmasked score)


@pytest.fixture(params=["keras3", "keras3_no_dropout", "tf_keras_mha", "tf_keras_attention"])
def keras_graph(request):
    """A causal attention layer of each library, called inside a ``tf.function``, built eagerly first."""
    if request.param.startswith("keras3"):
        import keras

        dropout = 0.1 if request.param == "keras3" else 0.0        # with dropout: the explicit-scores path
        layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=dropout)
        fn = lambda q: layer(q, q, use_causal_mask=True, training=False)
    else:
        import tf_keras

        if request.param == "tf_keras_mha":
            layer = tf_keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
            fn = lambda q: layer(q, q, use_causal_mask=True)
        else:
            layer = tf_keras.layers.Attention()
            fn = lambda q: layer([q, q], use_causal_mask=True)
    fn(tf.zeros((1, L, 8)))
    return request.param, tf.function(fn).get_concrete_function(tf.TensorSpec((1, L, 8))).graph, layer


def path_types(t, depth=12):
    """The op types on the paths from the graph's inputs to ``t``, ``depth`` ops deep."""
    found = {t.op.type}
    for x in t.op.inputs if depth else ():
        found |= path_types(x, depth - 1)
    return found


def test_keras_causal_attention(keras_graph):
    """Proven exactly on each library's graph; the layer's own attention probabilities are 0 there."""
    name, graph, layer = keras_graph
    result = masked_tiles(softmax_input(graph), GRID, GRID)
    np.testing.assert_array_equal(result.skipped, fully_masked(causal, GRID, GRID))
    q = tf.random.stateless_normal((1, L, 8), seed=(3, 4)) * 4
    if name == "tf_keras_attention":
        _, probs = layer([q, q], use_causal_mask=True, return_attention_scores=True)
    else:
        _, probs = layer(q, q, use_causal_mask=True, return_attention_scores=True)
    assert all((p == 0).all() for p in tile_values(probs.numpy(), result, GRID, GRID))
    if name in ("keras3", "tf_keras_attention"):
        # Their masks are cumsums of ones; constant_cumsum rewrites them to broadcast indices: still proven.
        assert "Cumsum" in path_types(softmax_input(graph))
        ConstantCumsum().run(graph, PassOptions())
        assert "Cumsum" not in path_types(softmax_input(graph))
        np.testing.assert_array_equal(masked_tiles(softmax_input(graph), GRID, GRID).skipped, result.skipped)


CAPTURED = tf.constant(TRIL[:, :, :L, :L])                     # an eager tensor: captured as an input
m = lambda: 1 - band_mask()                                    # 1 where masked, built in the graph


def chain(t, n):
    for _ in range(n):
        t = tf.identity(t)
    return t


NOT_MASKED = {   # name: (scores from s, the nearest variant that is proven causal, or None)
    "no mask": (lambda s: s * 0.125, None),
    "padding only": (lambda s, keys: tf.where(keys[:, None, :], s, -1e9), None),
    "masked value -10": (lambda s: s + m() * -10, lambda s: s + m() * -1e4),
    "data of unknown sign after masking": (lambda s, d: (s + m() * -1e9) * d, lambda s, d: (s + m() * -1e9) * 0.5),
    "multiplicative": (lambda s: s * band_mask(), lambda s: s * band_mask() - 1e9 * m()),
    "a mask input": (lambda s, mask: s + mask, None),
    # An input's value is data: 1e9 x (1 - input) has a data part of size 1e9, and proves nothing.
    "one minus a mask input": (lambda s, keep: s + (1 - keep) * -1e9, lambda s, keep: s + m() * -1e9),
    "captured buffer": (lambda s: s * CAPTURED - 1e4 * (1 - CAPTURED), None),        # (GPT-2's, as a constant above)
    "negated": (lambda s: s - m() * -1e9, lambda s: s + m() * -1e9),
    "clipped": (lambda s: tf.maximum(s + m() * -1e9, -100.0), lambda s: s + tf.maximum(m() * -1e9, -1e4)),
    "gathered mask": (lambda s: s + tf.gather(m() * -1e9, tf.range(L)), None),
    # 1e6 s - 1e9 is not masked where s > 1000: the offset must beat the data part's amplification.
    "data amplified": (lambda s: s * 1e6 + m() * -1e9, lambda s: s * 1e6 + m() * -1e12),
    "fractional float range": (
        lambda s: tf.where(tf.range(0.05, 6.4, 0.1)[:, None] >= tf.range(0.05, 6.4, 0.1), s, -1e9),
        lambda s: tf.where(tf.range(0.0, 64.0, 1.0)[:, None] >= tf.range(0.0, 64.0, 1.0), s, -1e9)),
    "past MAX_VISITS": (lambda s: s + chain(m() * -1e9, MAX_VISITS), lambda s: s + chain(m() * -1e9, 8)),
}
NOT_MASKED_EXTRA = {"padding only": tf.TensorSpec((2, L), tf.bool), "a mask input": tf.TensorSpec((L, L)),
                    "data of unknown sign after masking": tf.TensorSpec((2, L, L)),
                    "one minus a mask input": tf.TensorSpec((L, L))}


@pytest.mark.parametrize("case", list(NOT_MASKED))
def test_not_masked(case):
    """Nothing proven: each has a score that is not surely masked in every tile; its nearest masked variant
    (where there is one) is proven, so the refusal is the case's own."""
    refused, control = NOT_MASKED[case]
    extra = (NOT_MASKED_EXTRA[case],) if case in NOT_MASKED_EXTRA else ()
    assert masked_tiles(softmax_input(traced(refused, extra=extra)), GRID, GRID) is None
    if control is not None:
        check(control, causal, extra=extra, numeric=not extra)


def test_blocks_outside_the_axis_are_refused():
    scores = softmax_input(traced(lambda s: s - 1e9 * (1 - band_mask())))
    with pytest.raises(ValueError, match="blocks"):
        masked_tiles(scores, [(0, 80)], GRID)
