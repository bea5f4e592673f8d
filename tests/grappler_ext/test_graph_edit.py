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
