"""grappler_ext.graph_query: questions about a graph that change nothing in it."""

import tensorflow as tf

from grappler_ext.graph_query import returned


def test_returned_follows_what_passes_a_tensor_on():
    """A function returning ``y * 3`` through ``identity_n`` of two tensors returns it and not ``x * 2``
    (each input of an ``IdentityN`` has its own output); a reshape passes a tensor on as well."""
    def fn(x, y):
        _, b = tf.identity_n([x * 2, y * 3])
        return b, tf.reshape(x - 1, [3, 1])

    graph = tf.function(fn).get_concrete_function(tf.TensorSpec([3]), tf.TensorSpec([3])).graph
    outputs = {t.ref() for t in graph.outputs}
    assert [returned(graph.get_operation_by_name(name).outputs[0], outputs) for name in ("mul", "mul_1", "sub")] \
        == [False, True, True]
