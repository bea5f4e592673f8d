"""experiments/peak_buffers.py: what XLA holds at a program's peak, read from its buffer assignment."""

import tensorflow as tf

from experiments.peak_buffers import live_at_peak, render


def test_the_peak_names_the_tensorflow_ops_it_holds():
    """``exp(x) @ xᵀ`` then ``sin(y) * y`` summed: at the peak XLA holds the [300, 300] product and
    the fused ``sin * y`` beside the input, and names the product's op."""
    @tf.function
    def f(x):
        y = tf.exp(x) @ tf.transpose(x)
        return tf.reduce_sum(tf.sin(y) * y, 0)

    peak = live_at_peak(f, tf.ones([300, 200]))
    assert peak.total_bytes > 300 * 300 * 4
    largest = peak.live[0]
    assert largest.bytes == 300 * 300 * 4 and largest.shape.startswith("f32[300,300]")
    assert any(b.op_type == "MatMul" for b in peak.live), peak.live
    assert any(b.bytes == 300 * 200 * 4 for b in peak.live)               # the input, held throughout
    text = render(peak)
    assert text.startswith(f"{peak.module}: {peak.total_bytes:,} B in all") and "MatMul `" in text
