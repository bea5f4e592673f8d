"""graph_edit: rewiring with checks before mutation, acyclicity, outputs, and the undo journal.

These tests edit graphs after tracing, so they check structure; the numbers an edited graph computes
are checked in tests/tf_memsafe/test_hook.py, where edits happen inside the hook, before TensorFlow
builds the function.
"""

import pytest
import tensorflow as tf

from grappler_ext import graph_edit, graph_query
from grappler_ext.graph_edit import EditError, Journal, journaled


def trace(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs)


def op_of_type(graph, op_type):
    (op,) = [op for op in graph.get_operations() if op.type == op_type]
    return op


def exp_of_sin():
    """The graph of exp(sin(x)) over f32[3], and its Sin output."""
    g = trace(lambda x: tf.exp(tf.sin(x)), tf.TensorSpec([3])).graph
    return g, op_of_type(g, "Sin").outputs[0]


class TestReplaceUses:
    def test_moves_consumers_but_not_the_new_tensors_own_inputs(self):
        g, sin = exp_of_sin()
        with graph_edit.building(g, "test"):
            doubled = sin * 2.0           # reads sin: must keep reading it
        moved = graph_edit.replace_uses(sin, doubled)
        assert moved == 1
        assert op_of_type(g, "Exp").inputs[0] is doubled
        assert doubled.op.inputs[0] is sin
        assert doubled.op.name.startswith("tf_memsafe/test/")

    def test_graph_outputs_are_replaced(self):
        cf = trace(lambda x: x + 1.0, tf.TensorSpec([2]))
        g = cf.graph
        out = g.outputs[0]
        with graph_edit.building(g, "test"):
            new = tf.identity(out * 3.0)
        graph_edit.replace_uses(out, new)
        assert g.outputs[0] is new
        assert tf.nest.flatten(g.structured_outputs)[0] is new

    def test_dtype_mismatch_raises_before_any_change(self):
        g, sin = exp_of_sin()
        with graph_edit.building(g, "test"):
            wrong = tf.cast(sin, tf.float64)
        with pytest.raises(EditError, match="float64"):
            graph_edit.replace_uses(sin, wrong)
        assert op_of_type(g, "Exp").inputs[0] is sin

    def test_shape_mismatch_raises(self):
        g, sin = exp_of_sin()
        with graph_edit.building(g, "test"):
            wrong = tf.concat([sin, sin], 0)
        with pytest.raises(EditError, match="shape"):
            graph_edit.replace_uses(sin, wrong)

    def test_unknown_shape_cannot_replace_known(self):
        g, sin = exp_of_sin()
        with graph_edit.building(g, "test"):
            unknown = tf.raw_ops.Placeholder(dtype=tf.float32, shape=None)
        with pytest.raises(EditError):
            graph_edit.replace_uses(sin, unknown)


class TestJournal:
    def test_undo_restores_inputs_and_outputs(self):
        g, sin = exp_of_sin()
        out = g.outputs[0]
        journal = Journal()
        with journaled(journal):
            with graph_edit.building(g, "test"):
                a = sin + 1.0
                b = tf.identity(out)
            graph_edit.replace_uses(sin, a)
            graph_edit.replace_uses(out, b)
        assert len(journal) == 2
        journal.undo()
        assert len(journal) == 0
        assert op_of_type(g, "Exp").inputs[0] is sin
        assert g.outputs[0] is out
        assert tf.nest.flatten(g.structured_outputs)[0] is out

    def test_undo_to_a_mark_keeps_the_earlier_edits_and_runs_undo_callbacks(self):
        g, sin = exp_of_sin()
        out = g.outputs[0]
        state = {"targets": "old"}
        journal = Journal()
        with journaled(journal):
            assert graph_edit.active_journal() is journal
            with graph_edit.building(g, "test"):
                a = sin + 1.0
                b = tf.identity(out)
            graph_edit.replace_uses(sin, a)
            mark = len(journal)
            graph_edit.replace_uses(out, b)
            state["targets"] = "new"
            graph_edit.on_undo(lambda: state.__setitem__("targets", "old"))
        assert graph_edit.active_journal() is None
        journal.undo(to=mark)
        assert len(journal) == mark and state["targets"] == "old"
        assert g.outputs[0] is out and op_of_type(g, "Exp").inputs[0] is a     # the first edit stays
        journal.undo()
        assert op_of_type(g, "Exp").inputs[0] is sin

    def test_some_journal_is_the_active_one_or_the_blocks_own(self):
        g, sin = exp_of_sin()
        outer = Journal()
        with journaled(outer), graph_edit.some_journal() as journal:
            assert journal is outer and graph_edit.active_journal() is outer
        with graph_edit.some_journal() as own:                # outside a pipeline: one of its own
            assert own is not outer and graph_edit.active_journal() is own
            with graph_edit.building(g, "test"):
                a = sin + 1.0
            graph_edit.replace_uses(sin, a)
        assert graph_edit.active_journal() is None and len(own) == 1
        own.undo()
        assert op_of_type(g, "Exp").inputs[0] is sin

    def test_edits_outside_a_journal_are_not_recorded(self):
        g, sin = exp_of_sin()
        journal = Journal()
        with journaled(journal):
            pass
        with graph_edit.building(g, "test"):
            a = sin + 1.0
        graph_edit.replace_uses(sin, a)
        assert len(journal) == 0


def test_ancestors_follow_control_edges():
    @tf.function
    def f(x):
        a = tf.sin(x)
        with tf.control_dependencies([a]):
            return tf.identity(x)

    g = f.get_concrete_function(tf.TensorSpec([2])).graph
    types = {op.type for op in graph_query.ancestors(g.outputs)}
    assert {"Sin", "Placeholder", "Identity"} <= types


class TestCopyOps:
    """Copies of ops built once (a loop's backward, asked for again): the same computation on other
    inputs, each copy reading what its original read when the snapshot was taken."""

    def test_a_copy_computes_the_same_on_the_mapped_input_and_traces_no_body_again(self):
        seen = {}

        @tf.function
        def f(x, y):
            g = tf.compat.v1.get_default_graph()
            start = len(g.get_operations())
            _, total = tf.while_loop(lambda i, s: i < 3, lambda i, s: (i + 1, s + tf.sin(x)), (0, tf.zeros_like(x)))
            out = tf.exp(total)
            ops = graph_edit.snapshot(g.get_operations()[start:])
            functions = len(g._functions)  # noqa: SLF001
            mapping = graph_edit.copy_ops(ops, {x.ref(): y})
            (loop,) = [c.op for c in ops if c.op.type in ("While", "StatelessWhile")]
            seen.update(functions=(functions, len(g._functions)),  # noqa: SLF001 - the body referenced
                        bodies=(loop.get_attr("body"), mapping[loop.outputs[0].ref()].op.get_attr("body")),
                        shapes=(out.shape, mapping[out.ref()].shape))
            return out + mapping[out.ref()]

        x, y = tf.constant([0.1, 0.2, 0.3]), tf.constant([1.0, 2.0, 3.0])
        got = f(x, y)
        assert seen["functions"][0] == seen["functions"][1] and seen["bodies"][0] == seen["bodies"][1]
        assert seen["shapes"][0] == seen["shapes"][1] == [3]
        expected = tf.exp(3 * tf.sin(x)) + tf.exp(3 * tf.sin(y))
        assert got.numpy() == pytest.approx(expected.numpy(), rel=1e-6)

    def test_a_copy_reads_what_its_original_read_before_a_later_rewire(self):
        g, sin = exp_of_sin()
        with graph_edit.building(g, "test"):
            start = len(g.get_operations())
            a = tf.cos(sin)
            b = a * 2.0
            ops = graph_edit.snapshot(g.get_operations()[start:])
            replacement = tf.tan(sin)
        graph_edit.replace_uses(a, replacement)            # rewires b, the original
        assert b.op.inputs[0] is replacement
        with graph_edit.building(g, "test"):
            mapping = graph_edit.copy_ops(ops, {})
        copy_of_b = mapping[b.ref()]
        assert copy_of_b.op.inputs[0] is mapping[a.ref()]   # the copy of a, as b read when taken
        assert mapping[a.ref()].op.inputs[0] is sin


def test_kept_ops_are_the_live_ones_and_every_stateful_op():
    """What TensorFlow keeps of a function (``PruneFunctionBody``): what its outputs and control
    outputs read, and stateful ops whether or not anything reads them; not an abandoned op."""
    g, sin = exp_of_sin()
    with graph_edit.building(g, "test"):
        dead = tf.cos(sin)
        draw = tf.random.uniform([2])               # stateful, read by nothing
        dead_reader = draw * 2.0
    kept = graph_query.kept_ops(g)
    assert graph_query.live_ops(g) <= kept
    assert draw.op in kept and draw.op not in graph_query.live_ops(g)
    assert dead.op not in kept and dead_reader.op not in kept
