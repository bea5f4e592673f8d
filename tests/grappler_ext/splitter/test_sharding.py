"""splitter.sharding: the axes a device mesh shards (DTensor), carried from the inputs, and the splitter
refusing to slice them -- on plain traced graphs, the sharded axes given as DTensor's would be
(``tests/integration/test_dtensor.py`` runs the same on a mesh)."""

from __future__ import annotations

import pytest
import tensorflow as tf

from grappler_ext.pass_base import PassOptions, ShardedAxis
from grappler_ext.pipeline import Pipeline
from grappler_ext.splitter import Code, Splitter
from grappler_ext.splitter.sharding import pinned_axes
from tf_memsafe.memory import XlaMeasurer

LIMIT = 2 * 2**20


def graph_of(fn, *specs):
    return tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph


def mlp(x, c):
    return tf.reduce_sum(tf.tanh(tf.tanh(x @ c) @ c), 0)


def kernel_sum(x, c):
    return tf.reduce_sum(tf.exp(-tf.reduce_sum((x[:, None, :] - c[None, :, :]) ** 2, -1)), 1)


def by_name(graph, name):
    return next(op for op in graph.get_operations() if op.name == name)


def test_sharded_axes_follow_the_split_rules_from_the_inputs():
    g = graph_of(lambda x, c: tf.transpose(tf.reshape(x @ c, [4, 256, 64]), [1, 0, 2]) + tf.reduce_sum(x),
                 tf.TensorSpec([1024, 32]), tf.TensorSpec([32, 64]))
    pinned = pinned_axes(g, PassOptions(memory_limit_bytes=LIMIT, sharded_inputs=(ShardedAxis("x", 0, "b"),)))
    axes = {op.type: pinned.axes.get(op.outputs[0].ref()) for op in g.get_operations() if op.outputs}
    assert axes["MatMul"] == {0: "b"}                       # rows of x @ c are rows of x
    # [1024] -> [4, 256]: both factors of the sharded axis count as sharded (on the safe side: DTensor's
    # blocks of 256 rows would be the leading factor's)
    assert axes["Reshape"] == {0: "b", 1: "b"}
    assert axes["Transpose"] == {0: "b", 1: "b"}
    assert axes["Sum"] is None                              # x reduced whole: a scalar, replicated
    assert pinned.gather_bytes == LIMIT // 8


def test_without_sharded_inputs_nothing_is_pinned():
    g = graph_of(mlp, tf.TensorSpec([1024, 32]), tf.TensorSpec([32, 32]))
    assert pinned_axes(g, PassOptions(memory_limit_bytes=LIMIT)) is None


def split(fn, sharded, *specs):
    g = graph_of(fn, *specs)
    result = Pipeline([Splitter(XlaMeasurer())]).run(
        g, PassOptions(memory_limit_bytes=LIMIT, verify=True, sharded_inputs=sharded))
    return g, [r for r in result.records if r.pass_name == "splitter"]


def test_a_loop_never_slices_a_large_sharded_axis_and_says_why():
    specs = (tf.TensorSpec([32768, 64]), tf.TensorSpec([64, 64]))
    _, alone = split(mlp, (), *specs)
    assert any(r.action == "rewritten" for r in alone)           # the rows of x, unsharded: split
    g, records = split(mlp, (ShardedAxis("x", 0, "b"),), *specs)
    assert not any(r.action == "rewritten" for r in records)
    assert not any(op.type in ("While", "StatelessWhile") for op in g.get_operations())
    why = [r for r in records if r.code == Code.SHARDED_AXIS]
    assert why and "`x` is sharded along axis 0 over mesh axis 'b' (DTensor): a loop over its slices would " \
                   "gather its 8,388,608 B on every device" in why[0].reason


def test_a_loop_along_an_unsharded_axis_still_splits():
    # Rows of x are sharded; the centres c are not: the kernel's row sums are split along c.
    g, records = split(kernel_sum, (ShardedAxis("x", 0, "b"),), tf.TensorSpec([4096, 8], tf.float64),
                       tf.TensorSpec([4096, 8], tf.float64))
    rewritten = [r for r in records if r.action == "rewritten"]
    assert rewritten and rewritten[0].plan.roots[0].input_axes[0] == 1        # the kernel's columns


@pytest.mark.parametrize("rows,splits", [(4096, True), (32768, False)])
def test_a_small_sharded_tensor_may_be_gathered(rows, splits):
    # A self-kernel reads x along both axes: a loop must slice x along its sharded axis.  Gathering
    # 4096 x 8 floats (128 KB) is allowed under a 2 MiB limit; 32768 x 8 (1 MiB) is not.
    def self_kernel_max(x):
        return tf.reduce_max(tf.exp(-tf.reduce_sum((x[:, None, :] - x[None, :, :]) ** 2, -1)), 0)

    _, records = split(self_kernel_max, (ShardedAxis("x", 0, "b"),), tf.TensorSpec([rows, 8]))
    assert any(r.action == "rewritten" for r in records) == splits, [r.reason for r in records]
