"""jit functions on DTensor inputs, run by ``test_dtensor.py`` in a process of its own (TensorFlow splits the
CPU into logical devices only before its runtime starts).

``python -m tests.integration.dtensor_step`` prints one JSON object: for each case, run as traced and
with ``tf_memsafe.enable(LIMIT)``, the values (gathered to one replicated array), the allocator's peak
during the call over the four devices (DTensor runs each device's program on CPU without XLA, and the
four logical devices share one allocator: the mean per device), and the splitter's actions.

* ``kernel_sum``: a Gaussian kernel's row sums of batch-sharded points [4 x 1024, 8] against 4096
  replicated centres, float64 (a [1024, 4096] kernel per device, 32 MiB);
* ``train_step``: a kernel regression's loss, its gradient taken with the tape inside, and an SGD
  update of a replicated ``DVariable``, on batch-sharded points;
* ``self_kernel``: the column maxima of the points' own kernel [4096, 4096]: a loop must slice the
  sharded points, which DTensor gathers (256 KB: allowed);
* ``mlp``: two tanh layers over batch-sharded rows [4 x 8192, 64], summed over the rows: the only loop
  would slice the sharded rows, 16 MB gathered on every device, so it is left as traced and the warning
  says why (before, the loop took each device from 4 MiB to 45 MiB).

DTensor expands a function for each device after it is traced, from the global graph: tf_memsafe sees
global shapes and sizes its loops for them, which bounds each device's share from above.
"""

from __future__ import annotations

import json
import sys
import warnings

import tensorflow as tf

LIMIT = 8 * 2**20
DEVICES = 4


def main() -> int:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES)
    from tensorflow.experimental import dtensor

    import tf_memsafe
    from tf_memsafe import hook

    mesh = dtensor.create_mesh([("b", DEVICES)], device_type="CPU")

    def replicated(t):
        return dtensor.copy_to_mesh(t, dtensor.Layout.replicated(mesh, t.shape.rank))

    def gathered(t):
        return dtensor.relayout(t, dtensor.Layout.replicated(mesh, t.shape.rank)).numpy().tolist()

    x = dtensor.relayout(replicated(tf.random.stateless_normal([DEVICES * 1024, 8], [1, 2], dtype=tf.float64)),
                         dtensor.Layout.batch_sharded(mesh, "b", 2))
    centres = replicated(tf.random.stateless_normal([4096, 8], [1, 3], dtype=tf.float64))
    w = dtensor.DVariable(replicated(tf.fill([8, 1], tf.constant(0.1, tf.float64))))

    def kernel(a, c):
        return tf.exp(-tf.reduce_sum((a[:, None, :] - c[None, :, :]) ** 2, -1))

    def kernel_sum(a, c):
        return tf.reduce_sum(kernel(a, c), 1)

    def train_step(a, c):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(kernel(a, c[:2048]) @ (c[:2048] @ w)))
        grad = tape.gradient(loss, w)
        w.assign_sub(1e-6 * grad)
        return loss, grad, tf.identity(w)

    def self_kernel(a, c):
        return tf.reduce_max(kernel(a, a), 0)

    rows = dtensor.relayout(replicated(tf.random.stateless_normal([DEVICES * 8192, 64], [1, 4], dtype=tf.float64)),
                            dtensor.Layout.batch_sharded(mesh, "b", 2))
    weights = replicated(tf.random.stateless_normal([64, 64], [1, 5], dtype=tf.float64) / 8)

    def mlp(a, c):
        return tf.reduce_sum(tf.tanh(tf.tanh(a @ c) @ c), 0)

    def run(fn, enabled: bool) -> dict:
        w.assign(replicated(tf.fill([8, 1], tf.constant(0.1, tf.float64))))
        step = tf.function(fn, jit_compile=True)
        mark = hook.report_mark()
        if enabled:
            tf_memsafe.enable(LIMIT)
        try:
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = step(rows, weights) if fn is mlp else step(x, centres)
            values = [gathered(t) for t in tf.nest.flatten(out)]
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
        finally:
            tf_memsafe.disable()
        actions = [r.action for rep in hook.reports_since(mark) for r in rep.records if r.pass_name == "splitter"]
        return {"values": values, "peak_per_device": peak / DEVICES, "splitter": actions,
                "warnings": [str(w.message) for w in caught]}

    print(json.dumps({"limit": LIMIT, **{name: {"naive": run(fn, False), "tf_memsafe": run(fn, True)}
                                         for name, fn in (("kernel_sum", kernel_sum), ("train_step", train_step),
                                                          ("self_kernel", self_kernel), ("mlp", mlp))}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
