"""splitter.analysis: roots, regions and where they stop, on small graphs (nothing is rewritten).

Sizes are small on purpose: analysis reads shapes and op types only.  x is [600, 3], y [400, 3]
float32: K = exp(x y^T) is [600, 400] (960 kB), its row sums [600].
"""

import tensorflow as tf

from grappler_ext.graph_query import topological_order
from grappler_ext.splitter import Code, analysis

X, Y = tf.TensorSpec([600, 3]), tf.TensorSpec([400, 3])


def traced(fn, *specs):
    """The function's graph, its ops in order and their index, and its output refs."""
    graph = tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph
    order = topological_order(graph)
    return graph, {op: i for i, op in enumerate(order)}, {t.ref() for t in graph.outputs}


def op_of(graph, op_type):
    return [o for o in graph.get_operations() if o.type == op_type][-1]      # the last: the function's own


def grown_from(fn, root_type, kind, *specs, ignored=frozenset()):
    graph, order_index, outputs = traced(fn, *specs)
    root = op_of(graph, root_type)
    (option,) = [o for o in analysis.root_options(root) if o.kind == kind][:1]
    return graph, analysis.grow([option], outputs, order_index, ignored)


class TestRootOptions:
    def test_a_matmul_offers_its_rows_its_columns_and_its_contracting_axis(self):
        """``x @ y^T``: rows of x (joined), rows of y (joined as columns), or slices of D summed."""
        graph, _, _ = traced(lambda x, y: tf.matmul(x, y, transpose_b=True), X, Y)
        options = analysis.root_options(op_of(graph, "MatMul"))
        assert sorted(((o.kind, o.input_axes) for o in options), key=str) == [
            ("concat", (0, None)), ("concat", (None, 0)), ("sum", (1, 1))]

    def test_a_reduction_offers_its_kept_axis_joined_and_its_reduced_axis_folded(self):
        graph, _, _ = traced(lambda x, y: tf.reduce_max(tf.matmul(x, y, transpose_b=True), axis=1), X, Y)
        options = analysis.root_options(op_of(graph, "Max"))
        assert sorted(((o.kind, o.input_axes) for o in options), key=str) == [("concat", (0, None)), ("max", (1, None))]

    def test_top_k_is_split_along_its_last_axis(self):
        graph, _, _ = traced(lambda x, y: tf.math.top_k(tf.matmul(x, y, transpose_b=True), k=3).values, X, Y)
        kinds = {o.kind: o.input_axes for o in analysis.root_options(op_of(graph, "TopKV2"))}
        assert kinds["top_k"] == (1, None) and kinds["concat"] == (0, None)

    def test_softmax_times_values_offers_an_online_softmax_over_the_keys(self):
        v = tf.TensorSpec([400, 8])
        graph, _, _ = traced(lambda x, y, v: tf.nn.softmax(tf.matmul(x, y, transpose_b=True)) @ v, X, Y, v)
        (online,) = [o for o in analysis.root_options(op_of(graph, "MatMul")) if o.kind == "online_softmax"]
        assert [op.type for op in online.absorbed] == ["Softmax"] and online.split.describe() == (
            "`MatMul` online_softmax over input 0 axis 1, input 1 axis 0")


class TestGrow:
    def test_through_elementwise_ops_to_the_inputs(self):
        """Rows of sum(exp(x y^T), 1): Exp and MatMul join the region; x is sliced, y read whole."""
        graph, grown = grown_from(lambda x, y: tf.reduce_sum(tf.exp(tf.matmul(x, y, transpose_b=True)), 1),
                                  "Sum", "concat", X, Y)
        assert isinstance(grown, analysis.Grown)
        assert {op.type for op in grown.region.ops} == {"MatMul", "Exp"} and grown.region.length == 600
        (sliced,) = grown.region.sliced_inputs.items()
        assert sliced[0].deref().op.type == "Placeholder" and sliced[1] == 0
        whole = {tuple(r.deref().shape.as_list()) for r in grown.region.whole_inputs}
        assert whole - {()} == {(400, 3)}                                     # and the Sum's axis
        assert all(w.code == Code.REGION_STOPS and "is an input" in w.text for w in grown.stops)

    def test_at_an_op_without_a_rule_with_the_reason(self):
        """A Cholesky before the reduction: the region stops there, refused, and says why."""
        def fn(x):
            k = tf.exp(-tf.matmul(x, x, transpose_b=True)) + tf.eye(600)
            return tf.reduce_sum(tf.linalg.cholesky(k) * 2.0, 1)

        graph, grown = grown_from(fn, "Sum", "concat", X)
        assert "Cholesky" not in {op.type for op in grown.region.ops}
        assert grown.stops[0].code == Code.REFUSED_OP and "Cholesky" in grown.stops[0].text

    def test_at_a_tensor_the_function_also_returns(self):
        """exp(x y^T) is returned as well as summed: its full value exists, so it is sliced, not recomputed."""
        def fn(x, y):
            k = tf.exp(tf.matmul(x, y, transpose_b=True))
            return tf.reduce_sum(k, 1), k

        graph, grown = grown_from(fn, "Sum", "concat", X, Y)
        assert grown.region.ops == [] and grown.stops[0].code == Code.REGION_STOPS
        assert "read outside the region" in grown.stops[0].text or "output of the function" in grown.stops[0].text

    def test_at_a_tensor_another_op_reads_with_that_op_named(self):
        """exp(x y^T) is summed by rows and also read by a product outside the region: the reason names
        the reader (a GCN's reason named only the tensor read)."""
        def fn(x, y):
            k = tf.exp(tf.matmul(x, y, transpose_b=True))
            return tf.reduce_sum(k, 1), tf.matmul(k, y)

        graph, grown = grown_from(fn, "Sum", "concat", X, Y)
        assert any("is also read outside the region, by `MatMul_1` (MatMul)" in w.text for w in grown.stops), \
            [w.text for w in grown.stops]

    def test_readers_in_ignored_do_not_hold_an_op_back(self):
        """The same returned tensor's other reader ignored (as the gradients inside the function are)."""
        def fn(x, y):
            k = tf.exp(tf.matmul(x, y, transpose_b=True))
            return tf.reduce_sum(k, 1), tf.reduce_max(k, 1)

        graph, order_index, outputs = traced(fn, X, Y)
        (option,) = [o for o in analysis.root_options(op_of(graph, "Sum")) if o.kind == "concat"]
        held = analysis.grow([option], outputs, order_index)
        freed = analysis.grow([option], outputs, order_index, ignored=frozenset({op_of(graph, "Max")}))
        assert held.region.ops == [] and {op.type for op in freed.region.ops} == {"MatMul", "Exp"}

    def test_conflicting_axes_are_a_conflict(self):
        """x x^T split by rows reads x along axis 0 twice -- fine -- but K + K^T needs K along two axes."""
        def fn(x):
            k = tf.matmul(x, x, transpose_b=True)
            return tf.reduce_sum(k + tf.transpose(k), 1)

        graph, grown = grown_from(fn, "Sum", "concat", X)
        assert isinstance(grown, analysis.Why) and grown.code == Code.REGION_CONFLICT, grown


class TestForwardRoots:
    def test_two_readers_reducing_the_same_axis_end_one_region(self):
        """K [600, 400] read by a column sum and by K^T w: both reduce the rows, one loop can take both."""
        w = tf.TensorSpec([600, 2])

        def fn(x, y, w):
            k = tf.exp(tf.matmul(x, y, transpose_b=True))
            return tf.reduce_sum(k, 0), tf.matmul(k, w, transpose_a=True)

        graph, order_index, outputs = traced(fn, X, Y, w)
        k = op_of(graph, "Exp").outputs[0]
        roots = analysis.forward_roots(k, 0, order_index, outputs, frozenset())
        assert sorted((o.root.type, o.kind) for o in roots) == [("MatMul", "sum"), ("Sum", "sum")]

    def test_a_reader_that_neither_keeps_nor_reduces_the_axis_says_so(self):
        graph, order_index, outputs = traced(lambda x: tf.linalg.cholesky(tf.exp(-tf.matmul(x, x, transpose_b=True))),
                                             X)
        k = op_of(graph, "Exp").outputs[0]
        why = analysis.forward_roots(k, 0, order_index, outputs, frozenset())
        assert isinstance(why, str) and "neither keeps nor reduces" in why and "Cholesky" in why, why

    def test_the_axis_ends_where_two_of_its_paths_part(self):
        """Two attention layers: the first one's queries axis reaches the second one's scores through
        its queries and through its keys (two axes of one tensor), so it ends at the first layer's
        output, where the paths part, joined there (one loop per layer); the keys' axis ends nowhere."""
        x, w = tf.TensorSpec([600, 8]), tf.TensorSpec([8, 8])

        def layer(x, w):
            q, k = x @ w, x @ tf.transpose(w)
            return x + tf.nn.softmax(tf.matmul(q, k, transpose_b=True), -1) @ x             # [L, 8]

        graph, order_index, outputs = traced(lambda x, w: layer(layer(x, w), w) * 2.0, x, w)
        first = [o for o in graph.get_operations() if o.type == "MatMul" and o.outputs[0].shape == [600, 600]][0]
        end = [o for o in graph.get_operations() if o.type == "AddV2"][0]          # the first layer's output
        roots = analysis.forward_roots(first.outputs[0], 0, order_index, outputs, frozenset())
        assert [(o.root, o.kind, o.output_axes) for o in roots] == [(end, "concat", (0,))], roots
        why = analysis.forward_roots(first.outputs[0], 1, order_index, outputs, frozenset())
        assert isinstance(why, str) and "neither keeps nor reduces" in why, why


def test_downstream_lists_ops_within_the_depth_farthest_first():
    graph, order_index, _ = traced(lambda x, y: tf.reduce_sum(tf.exp(tf.matmul(x, y, transpose_b=True)), 1), X, Y)
    matmul = op_of(graph, "MatMul")
    near = analysis.downstream(matmul, order_index, 1)
    assert [op.type for op in near] == ["Exp", "MatMul"]
    assert [op.type for op in analysis.downstream(matmul, order_index, 2)][:2] == ["Sum", "Exp"]


class TestPrologue:
    """What a loop computes before its slices from the inputs it reads anyway (nothing is built)."""

    @staticmethod
    def prologue(fn, root_type, kind, *specs):
        graph, order_index, outputs = traced(fn, *specs)
        root = op_of(graph, root_type)
        (option,) = [o for o in analysis.root_options(root) if o.kind == kind][:1]
        grown = analysis.grow([option], outputs, order_index, frozenset())
        return analysis.prologue(grown, order_index, outputs, frozenset(), cap=1.0, share=0.5, most_ops=8,
                                 min_bytes=1)

    def test_a_projection_of_the_input_it_slices_is_computed_before_the_slices(self):
        """Keys x W read whole by a loop over x's rows: W is small and x is read anyway, so the
        projection is the prologue's, though it is as large as x (over the share, over the cap)."""
        w = tf.TensorSpec([3, 3])
        ops = self.prologue(lambda x, w: tf.reduce_sum(tf.exp(tf.matmul(x, x @ w, transpose_b=True)), 1),
                            "Sum", "concat", X, w)
        assert [op.type for op in ops] == ["MatMul"]

    def test_a_reshape_of_the_input_it_slices_is_not(self):
        """x[None] read whole by a loop over x's rows (a kernel of x with itself) computes nothing new:
        no prologue (under DTensor, one held each device's gathered copy twice)."""
        ops = self.prologue(lambda x: tf.reduce_max(tf.exp(-tf.reduce_sum((x[:, None, :] - x[None, :, :]) ** 2, -1)),
                                                    0), "Max", "concat", X)
        assert ops == []


class TestHeldWhole:
    """What a linear algebra op holds whole whatever is rewritten: its matrix and results, less the
    program's arguments and results (n = 300 f32: 360,000 B a matrix)."""

    N = tf.TensorSpec([300, 300])

    def test_an_eigh_of_a_computed_matrix_holds_it_and_its_vectors(self):
        graph, _, _ = traced(lambda x: tf.reduce_sum(tf.linalg.eigh(tf.exp(x))[1], 0), self.N)
        whole = analysis.held_whole(graph)
        assert (whole.op, whole.function, whole.shape) == ("SelfAdjointEigV2", "tf.linalg.eigh", (300, 300))
        assert whole.bytes == 2 * 360_000 + 1_200              # the matrix, the vectors and the values

    def test_an_argument_and_a_result_are_not_counted_again(self):
        """The arguments and results are the warning's own floor: the op adds what is neither."""
        graph, _, _ = traced(lambda x: tf.linalg.eigh(x)[1], self.N)
        assert analysis.held_whole(graph).bytes == 1_200       # the eigenvalues alone

    def test_an_inverse_split_by_its_batch_holds_one_matrix(self):
        graph, _, _ = traced(lambda x: tf.reduce_sum(tf.linalg.inv(tf.exp(x)), 0), tf.TensorSpec([4, 300, 300]))
        assert analysis.held_whole(graph).bytes == 2 * 360_000

    def test_a_solve_holds_its_matrix_and_a_cholesky_its_factor(self):
        """A solve's right-hand side splits by columns; a Cholesky's input is computed block by block."""
        solve, _, _ = traced(lambda a, b: tf.reduce_sum(tf.linalg.solve(tf.exp(a), b)), self.N,
                             tf.TensorSpec([300, 50]))
        chol, _, _ = traced(lambda a: tf.reduce_sum(tf.linalg.cholesky(tf.exp(a))), self.N)
        assert analysis.held_whole(solve).bytes == analysis.held_whole(chol).bytes == 360_000

    def test_a_program_without_such_ops_has_none(self):
        graph, _, _ = traced(lambda x, y: tf.exp(tf.matmul(x, y, transpose_b=True)), X, Y)
        assert analysis.held_whole(graph) is None
