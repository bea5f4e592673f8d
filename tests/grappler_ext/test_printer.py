"""Tests for grappler_ext.printer: golden texts of small traced graphs, order, liveness, asserts.

The golden texts are what TensorFlow 2.21 really builds, pasted from ``format_graph``.  Note what
FuncGraph adds on its own: an ``Identity`` per output, and with stateful ops a ``NoOp`` that the
output Identities depend on, plus control outputs on the ``return`` line.
"""

import numpy as np
import pytest
import tensorflow as tf

from grappler_ext.printer import assert_graph_text, canonical_lines, format_graph, graph_fingerprint
from grappler_ext.verifier import VerificationError


def trace(fn, *specs):
    """The FuncGraph of ``fn`` traced for ``specs``."""
    return tf.function(fn).get_concrete_function(*specs).graph


def op_of_type(graph, op_type):
    (op,) = [op for op in graph.get_operations() if op.type == op_type]
    return op


def creation_index(graph, op):
    return [o.name for o in graph.get_operations()].index(op.name)


class TestMatMul:
    """The style guide's example line: default-valued attrs (transpose_a, grad_a, ...) are left out."""

    def test_golden(self):
        graph = trace(
            lambda a, b: tf.matmul(a, b, transpose_b=True),
            tf.TensorSpec([500, 3], tf.float64),
            tf.TensorSpec([20000, 3], tf.float64),
        )
        assert_graph_text(
            graph,
            """
            %0 = Placeholder f64[500,3] ()
            %1 = Placeholder f64[20000,3] ()
            %2 = MatMul{transpose_b=true} f64[500,20000] (%0, %1)
            %3 = Identity f64[500,20000] (%2)
            return %3
            """,
        )


class TestReductionWithConstAxis:
    def test_golden(self):
        graph = trace(lambda x: tf.reduce_sum(x, axis=[0, 1], keepdims=True), tf.TensorSpec([4, 3]))
        assert_graph_text(
            graph,
            """
            %0 = Placeholder f32[4,3] ()
            %1 = Const i32[2] = [0, 1]
            %2 = Sum{keep_dims=true} f32[1,1] (%0, %1)
            %3 = Identity f32[1,1] (%2)
            return %3
            """,
        )


class TestMultiOutput:
    """top_k has two outputs; the second is referenced as ``%2.1``."""

    def test_golden(self):
        graph = trace(lambda x: tf.math.top_k(x, k=5), tf.TensorSpec([10, 8]))
        assert_graph_text(
            graph,
            """
            %0 = Placeholder f32[10,8] ()
            %1 = Const i32[] = 5
            %2 = TopKV2 (f32[10,5], i32[10,5]) (%0, %1)
            %3 = Identity f32[10,5] (%2)
            %4 = Identity i32[10,5] (%2.1)
            return %3, %4
            """,
        )


class TestVariableAssign:
    """A stateful op: the captured variable handle is an extra input placeholder; FuncGraph makes
    the output Identity wait on a NoOp that it creates *after* the Identity, and lists the stateful
    ops as control outputs."""

    def test_golden(self):
        v = tf.Variable(tf.zeros([3]))

        def update(x):
            v.assign(x)
            return v.read_value() * 2.0

        graph = trace(update, tf.TensorSpec([3]))
        assert_graph_text(
            graph,
            """
            %0 = Placeholder f32[3] ()
            %1 = Placeholder resource[] ()
            %2 = AssignVariableOp{validate_shape=true} () (%1, %0)
            %3 = ReadVariableOp f32[3] (%1; ^%2)
            %4 = Identity f32[3] (%3)
            %5 = Const f32[] = 2.0
            %6 = Mul f32[3] (%4, %5)
            %7 = NoOp () (; ^%2, ^%3)
            %8 = Identity f32[3] (%6; ^%7)
            return %8; ^%2, ^%3
            """,
        )

    def test_creation_order_is_not_topological(self):
        """Why the printer sorts: TF itself creates the output Identity before its NoOp."""
        v = tf.Variable(0.0)

        def bump(x):
            v.assign_add(x)
            return x + 1.0

        graph = trace(bump, tf.TensorSpec([]))
        noop = op_of_type(graph, "NoOp")
        out = graph.outputs[0].op
        assert noop in out.control_inputs
        assert creation_index(graph, out) < creation_index(graph, noop)
        lines = canonical_lines(format_graph(graph))
        assert [line.split()[2] for line in lines[-3:-1]] == ["NoOp", "Identity"]


class TestControlDependency:
    def test_golden(self):
        def fn(x):
            y = tf.math.exp(x)
            with tf.control_dependencies([y]):
                return tf.math.log(x)

        assert_graph_text(
            trace(fn, tf.TensorSpec([3])),
            """
            %0 = Placeholder f32[3] ()
            %1 = Exp f32[3] (%0)
            %2 = Log f32[3] (%0; ^%1)
            %3 = Identity f32[3] (%2)
            return %3
            """,
        )

    def test_control_inputs_sorted_by_number(self):
        """TF stores control inputs in the order given; they print sorted, since elsewhere (NoOp,
        control outputs) TF fills them from sets whose order changes between processes."""
        graph = tf.Graph()
        with graph.as_default():
            a = tf.constant(1.0)
            b = tf.constant(2.0)
            c = tf.constant(3.0)
            with tf.control_dependencies([c.op, b.op]):
                d = tf.identity(a)
        assert [op.name for op in d.op.control_inputs] == [c.op.name, b.op.name]
        assert canonical_lines(format_graph(graph))[-1] == "%3 = Identity f32[] (%0; ^%1, ^%2)"


class TestUnknownShapes:
    def test_unknown_dim(self):
        assert_graph_text(
            trace(lambda x: tf.reduce_sum(x, axis=1), tf.TensorSpec([None, 3])),
            """
            %0 = Placeholder f32[?,3] ()
            %1 = Const i32[] = 1
            %2 = Sum f32[?] (%0, %1)
            %3 = Identity f32[?] (%2)
            return %3
            """,
        )

    def test_unknown_rank(self):
        assert_graph_text(
            trace(lambda x: -x, tf.TensorSpec(None)),
            """
            %0 = Placeholder f32[*] ()
            %1 = Neg f32[*] (%0)
            %2 = Identity f32[*] (%1)
            return %2
            """,
        )


def rewired_graph():
    """``x * 2 + 1`` traced, then a new ``Neg(x)`` created and wired in as the AddV2's first input:
    the AddV2 now consumes an op created after it, and ``mul``, ``mul/y`` are dead."""
    graph = trace(lambda x: x * 2.0 + 1.0, tf.TensorSpec([3]))
    with graph.as_default():
        neg = tf.math.negative(graph.inputs[0])
    add = op_of_type(graph, "AddV2")
    add._update_input(0, neg)
    assert creation_index(graph, add) < creation_index(graph, neg.op)
    return graph


class TestRewiredToNewerOp:
    def test_topological_not_creation_order(self):
        """Ties go to the op created first (the Const), but Neg, created last, precedes AddV2."""
        assert_graph_text(
            rewired_graph(),
            """
            %0 = Placeholder f32[3] ()
            %1 = Const f32[] = 1.0
            %2 = Neg f32[3] (%0)
            %3 = AddV2 f32[3] (%2, %1)
            %4 = Identity f32[3] (%3)
            return %4
            """,
        )

    def test_cycle_raises(self):
        graph = rewired_graph()
        neg = op_of_type(graph, "Neg")
        neg._update_input(0, op_of_type(graph, "AddV2").outputs[0])
        with pytest.raises(VerificationError, match=r"cycle.*add \(AddV2\).*Neg \(Neg\)"):
            format_graph(graph)


class TestDeadOps:
    def test_dead_ops_left_out_by_default(self):
        text = format_graph(rewired_graph())
        assert "Mul" not in text
        assert "Const f32[] = 2.0" not in text

    def test_include_dead(self):
        """Dead ops keep their creation-order place among the live ones."""
        assert_graph_text(
            rewired_graph(),
            """
            %0 = Placeholder f32[3] ()
            %1 = Const f32[] = 2.0
            %2 = Mul f32[3] (%0, %1)
            %3 = Const f32[] = 1.0
            %4 = Neg f32[3] (%0)
            %5 = AddV2 f32[3] (%4, %3)
            %6 = Identity f32[3] (%5)
            return %6
            """,
            include_dead=True,
        )

    def test_dead_input_placeholder(self):
        graph = trace(lambda x, unused: x + 1.0, tf.TensorSpec([2]), tf.TensorSpec([5]))
        assert "f32[5]" not in format_graph(graph)
        assert canonical_lines(format_graph(graph, include_dead=True))[:2] == [
            "%0 = Placeholder f32[2] ()",
            "%1 = Placeholder f32[5] ()",
        ]

    def test_fingerprint_sees_dead_ops(self):
        graph = trace(lambda x: x + 1.0, tf.TensorSpec([2]))
        text, fingerprint = format_graph(graph), graph_fingerprint(graph)
        assert fingerprint == format_graph(graph, include_dead=True)
        with graph.as_default():
            tf.math.exp(graph.inputs[0])  # left behind, unused
        assert format_graph(graph) == text
        assert graph_fingerprint(graph) != fingerprint
        assert "Exp f32[2] (%0)" in graph_fingerprint(graph)


class TestPlainGraph:
    """A tf.Graph has no outputs: every op is printed and there is no return line."""

    def test_golden(self):
        graph = tf.Graph()
        with graph.as_default():
            a = tf.constant(1.0)
            tf.constant([1, 2])
            tf.math.add(a, a)
        assert_graph_text(
            graph,
            """
            %0 = Const f32[] = 1.0
            %1 = Const i32[2] = [1, 2]
            %2 = AddV2 f32[] (%0, %0)
            """,
        )

    def test_dtype_short_names(self):
        graph = tf.Graph()
        dtypes = [tf.bfloat16, tf.float16, tf.uint8, tf.int64, tf.bool, tf.complex128, tf.string, tf.qint8]
        with graph.as_default():
            for dtype in dtypes:
                tf.raw_ops.Placeholder(dtype=dtype, shape=[2])
        types = [line.split()[3] for line in canonical_lines(format_graph(graph))]
        assert types == ["bf16[2]", "f16[2]", "u8[2]", "i64[2]", "bool[2]", "c128[2]", "str[2]", "qint8[2]"]


class TestConstValues:
    def test_small_and_large(self):
        graph = tf.Graph()
        with graph.as_default():
            tf.constant(0.1)  # float32: numpy's shortest form, not 0.10000000149011612
            tf.constant(True)
            tf.constant([[1, 2], [3, 4]], tf.int64)
            tf.constant(np.arange(8, dtype=np.float64))
            tf.constant(np.arange(9, dtype=np.float64))
            tf.constant([b"a b"])
        assert canonical_lines(format_graph(graph)) == [
            "%0 = Const f32[] = 0.1",
            "%1 = Const bool[] = True",
            "%2 = Const i64[2,2] = [[1, 2], [3, 4]]",
            "%3 = Const f64[8] = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]",
            "%4 = Const f64[9]",
            "%5 = Const str[1] = [b'a b']",
        ]

    def test_const_with_control_input(self):
        graph = tf.Graph()
        with graph.as_default():
            a = tf.constant(1.0)
            with tf.control_dependencies([a.op]):
                tf.constant(2)
        assert canonical_lines(format_graph(graph))[-1] == "%1 = Const i32[] (; ^%0) = 2"


class TestAttributes:
    """Strings quoted when they hold a comma, list(int) attrs, a non-default float, function attrs
    as @fn, the binary config_proto as <bytes>, and no type/shape attrs."""

    def test_golden(self):
        @tf.function
        def inner(a):
            return a * 2.0

        def fn(x, y):
            z = tf.nn.leaky_relu(tf.einsum("ij,jk->ik", x, y), alpha=0.25)
            return inner(z), tf.nn.max_pool2d(z[None, :, :, None], 2, 2, "VALID")

        assert_graph_text(
            trace(fn, tf.TensorSpec([4, 4]), tf.TensorSpec([4, 4])),
            """
            %0 = Placeholder f32[4,4] ()
            %1 = Placeholder f32[4,4] ()
            %2 = Einsum{N=2,equation="ij,jk->ik"} f32[4,4] (%0, %1)
            %3 = LeakyRelu{alpha=0.25} f32[4,4] (%2)
            %4 = PartitionedCall{config_proto=<bytes>,f=@fn} f32[4,4] (%3)
            %5 = Const i32[4] = [0, 0, 0, 0]
            %6 = Const i32[4] = [0, 0, 0, 0]
            %7 = Const i32[4] = [1, 1, 1, 1]
            %8 = StridedSlice{begin_mask=6,end_mask=6,new_axis_mask=9} f32[1,4,4,1] (%3, %5, %6, %7)
            %9 = MaxPool{ksize=[1,2,2,1],padding=VALID,strides=[1,2,2,1]} f32[1,2,2,1] (%8)
            %10 = Identity f32[4,4] (%4)
            %11 = Identity f32[1,2,2,1] (%9)
            return %10, %11
            """,
        )


class TestCanonicalLines:
    def test_normal_form(self):
        assert canonical_lines("\n  %0 =   Neg\tf32[]  (%1)  \n\n   \nreturn %0\n") == [
            "%0 = Neg f32[] (%1)",
            "return %0",
        ]


class TestAssertGraphText:
    GRAPH_TEXT = """
        %0 = Placeholder f32[3] ()
        %1 = Neg f32[3] (%0)
        %2 = Identity f32[3] (%1)
        return %2
    """

    def graph(self):
        return trace(lambda x: -x, tf.TensorSpec([3]))

    def test_passes_with_other_whitespace(self):
        assert_graph_text(
            self.graph(),
            "\n\n%0   =  Placeholder f32[3]  ()\n\t%1 = Neg   f32[3] (%0)\n%2 = Identity f32[3] (%1)\n return %2 ",
        )

    def test_failure_shows_actual_text_and_diff(self):
        wrong = self.GRAPH_TEXT.replace("Neg", "Abs")
        with pytest.raises(AssertionError) as info:
            assert_graph_text(self.graph(), wrong)
        message = str(info.value)
        assert format_graph(self.graph()) in message
        assert "-%1 = Abs f32[3] (%0)" in message
        assert "+%1 = Neg f32[3] (%0)" in message

    def test_passes_format_kwargs(self):
        graph = self.graph()
        with graph.as_default():
            tf.math.exp(graph.inputs[0])
        assert_graph_text(graph, self.GRAPH_TEXT)
        with pytest.raises(AssertionError):
            assert_graph_text(graph, self.GRAPH_TEXT, include_dead=True)


class TestDeterminism:
    """Tracing the same function twice gives identical text, although the nested function's name
    (``__inference_inner_<counter>``) differs between the traces."""

    def test_same_text_twice(self):
        def build():
            @tf.function
            def inner(a):
                return tf.nn.relu(a)

            v = tf.Variable(1.0)

            def fn(x):
                v.assign_add(tf.reduce_sum(x))
                return inner(x) * v.read_value()

            return trace(fn, tf.TensorSpec([None, 2]))

        first, second = build(), build()
        function_names = [op_of_type(g, "PartitionedCall").get_attr("f").name for g in (first, second)]
        assert function_names[0] != function_names[1]
        assert format_graph(first) == format_graph(second)
        assert graph_fingerprint(first) == graph_fingerprint(second)
