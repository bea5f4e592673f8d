"""Variable updates as values (grappler_ext.variable_updates): every relative write made an assignment
of the new value, reads after a write forwarded to it, the old writes made no-ops that run after.

Each case runs a training step (Keras 3 and tf_keras optimizers, with and without jit) rewritten and
as traced, from the same start, and compares losses and every variable after three steps exactly;
XLA's figure must not change; refusals leave the graph as traced (its printed form compared).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_memsafe
from grappler_ext import variable_updates
from grappler_ext.graph_query import live_ops, topological_order
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pipeline import Pipeline
from grappler_ext.printer import format_graph
from tests.keras_steps import OPTIMIZERS, dense_step
from tf_memsafe import hook

RNG = np.random.default_rng(0)
X = tf.constant(RNG.standard_normal((64, 32)), tf.float32)
Y = tf.constant(RNG.standard_normal((64, 48)), tf.float32)


class AsValues(GraphPass):
    """The rewrite alone, every variable (no size floor), for these tests."""

    name = "as_values"
    motive = Motive.LIMIT

    def __init__(self):
        self.updates, self.printed = [], []

    def run(self, graph, options):
        result = PassResult(self.name)
        order = {op: i for i, op in enumerate(topological_order(graph, live_ops(graph)))}
        before = format_graph(graph)
        updates = variable_updates.as_values(graph, self.name, variable_updates.candidates(graph, order))
        self.updates.append(updates)
        self.printed.append((before, format_graph(graph)))
        if updates:
            result.rewrote([], f"{len(updates)} variables' updates as values")
        return result


def _step(keras, optimizer, jit):
    step, values = dense_step(keras, optimizer, 32, 48)
    return tf.function(step, jit_compile=jit), values


def _three_steps(keras, optimizer, jit, rewrite):
    step, values = _step(keras, optimizer, jit)
    if not rewrite:
        return [float(step(X, Y)) for _ in range(3)], values(), None
    the_pass = AsValues()
    with hook.use_pipeline(Pipeline([the_pass])), tf_memsafe.options(strict=True, verify=True):
        losses = [float(step(X, Y)) for _ in range(3)]
    return losses, values(), the_pass


@pytest.fixture(autouse=True)
def _enabled():
    tf_memsafe.enable(memory_limit="1GB", rewrite_non_jit=True)
    yield
    tf_memsafe.disable()


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "no_jit"])
@pytest.mark.parametrize("keras", [tf.keras, tf_keras], ids=["keras3", "tf_keras"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_steps_with_updates_as_values_are_exact(keras, optimizer, jit):
    losses0, values0, _ = _three_steps(keras, optimizer, jit, rewrite=False)
    losses, values, the_pass = _three_steps(keras, optimizer, jit, rewrite=True)
    assert losses == losses0
    for got, want in zip(values, values0):
        np.testing.assert_array_equal(got, want)
    # The kernel and the bias at least (their writes are relative in every optimizer here).
    assert len(the_pass.updates[0]) >= 2
    before, after = the_pass.printed[0]
    assert "AssignSubVariableOp" in before or "AssignAddVariableOp" in before
    for update in the_pass.updates[0]:
        assert all(a.type == "AssignVariableOp" for a in update.assigns)


def test_xla_figure_unchanged():
    step, _ = _step(tf.keras, "adam", True)
    as_traced = tf_memsafe.memory_footprint(step, X, Y, rewrite=False)
    with hook.use_pipeline(Pipeline([AsValues()])):
        assert tf_memsafe.memory_footprint(step, X, Y) == as_traced


def test_a_variable_read_by_other_ops_is_left_alone():
    """An embedding's table read by a gather (a ResourceGather on the handle) is not a straight line
    of reads and writes: its writes stay as traced."""
    table = tf.Variable(RNG.standard_normal((100, 8)).astype(np.float32))
    scale = tf.Variable(2.0)

    @tf.function(jit_compile=True)
    def step(ids):
        rows = tf.gather(table, ids)
        table.assign_sub(tf.ones_like(table) * 0.1)
        scale.assign_add(1.0)            # a relative write before any read: left alone too
        return tf.reduce_sum(rows)

    the_pass = AsValues()
    with hook.use_pipeline(Pipeline([the_pass])):
        step(tf.constant([1, 5, 7]))
    assert the_pass.updates == [[]]
    before, after = the_pass.printed[0]
    assert before == after


def test_undone_with_the_journal():
    from grappler_ext import graph_edit

    step, _ = _step(tf.keras, "adam", True)
    graph = step.get_concrete_function(X, Y).graph
    printed = format_graph(graph)
    order = {op: i for i, op in enumerate(topological_order(graph, live_ops(graph)))}
    journal = graph_edit.Journal()
    with graph_edit.journaled(journal):
        updates = variable_updates.as_values(graph, "t", variable_updates.candidates(graph, order))
    assert updates and format_graph(graph) != printed
    journal.undo()
    assert format_graph(graph) == printed
