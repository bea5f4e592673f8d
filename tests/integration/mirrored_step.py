"""A training step under ``tf.distribute.MirroredStrategy`` on two logical CPU devices, run by
``test_distribute.py`` in a process of its own: TensorFlow splits a CPU into logical devices only
before its runtime starts, which the test process's has.

``python -m tests.integration.mirrored_step`` prints one JSON object: for each run (``naive``: not
enabled; ``outside``: ``tf_memsafe.enable`` before ``strategy.scope()``; ``inside``: within it) the
summed loss, the summed gradient, and XLA's "Total bytes used" of every program compiled in it (one
per replica), with the limit and the splitter's actions.

The step is a kernel regression's (an RBF kernel [n, M] of each replica's n points against M
centres, times the centres' projection): each replica's jit function takes its shard and the
weight's value, computes its loss and gradient with the tape inside, and the strategy sums them.
The weight's value is read outside the jit function: TensorFlow 2.21 places a jit function that
reads a mirrored variable itself on the first device for every replica ("Trying to access resource
.../replica_1 ... from device CPU:0", https://www.tensorflow.org/xla/known_issues), tf_memsafe or not.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tensorflow as tf

N, M, D = 2048, 4096, 8          # per replica: the kernel is 2048 x 4096 float64, 64 MiB
LIMIT = 8 * 2**20


def main() -> int:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    import tf_memsafe
    from tf_memsafe import hook, xla_flags

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((2 * N, D)))
    centres = tf.constant(rng.standard_normal((M, D)))
    with strategy.scope():
        w = tf.Variable(rng.standard_normal((D, 1)))
    shards = strategy.experimental_distribute_values_from_function(
        lambda ctx: x[ctx.replica_id_in_sync_group * N:(ctx.replica_id_in_sync_group + 1) * N])

    def step_function():
        @tf.function(jit_compile=True)
        def replica_step(xs, c, wv):
            with tf.GradientTape() as tape:
                tape.watch(wv)
                k = tf.exp(-tf.reduce_sum((xs[:, None, :] - c[None, :, :]) ** 2, -1))
                loss = tf.reduce_sum(tf.square(k @ (c @ wv)))
            return loss, tape.gradient(loss, wv)

        @tf.function
        def step():
            loss, grad = strategy.run(lambda xs: replica_step(xs, centres, tf.identity(w)), args=(shards,))
            return strategy.reduce("SUM", loss, axis=None), strategy.reduce("SUM", grad, axis=None)
        return step

    def run(where: str) -> dict:
        mark = hook.report_mark()
        step = step_function()               # traced afresh: the hook rewrites at trace time
        with xla_flags.dump_all_compiles(in_memory=True) as folder:
            if where == "naive":
                loss, grad = step()
            elif where == "outside":
                tf_memsafe.enable(LIMIT)
                try:
                    loss, grad = step()
                finally:
                    tf_memsafe.disable()
            else:
                with strategy.scope():
                    tf_memsafe.enable(LIMIT)
                    try:
                        loss, grad = step()
                    finally:
                        tf_memsafe.disable()
            programs = [total for name, total in xla_flags.memory_reports(folder) if "replica_step" in name]
        actions = [r.action for rep in hook.reports_since(mark) for r in rep.records if r.pass_name == "splitter"]
        return {"loss": float(loss), "grad": grad.numpy().ravel().tolist(), "programs": programs,
                "splitter": actions}

    print(json.dumps({"limit": LIMIT, **{where: run(where) for where in ("naive", "outside", "inside")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
