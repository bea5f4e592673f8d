"""A wide layer's training step under 700 MB: its kernel, its gradient and the optimizer's slots crowd the limit.

    python -m experiments.wide_layer [--quick] [--out experiments/results]

The step, as a Keras user writes it: a ``Dense(16384)`` on 2048 inputs regressing 16384 targets
(mean squared error) for a batch of 2048, float32, ``tape.gradient`` and ``optimizer.apply_gradients``
inside one ``tf.function(jit_compile=True)``; Keras 3 (``tf.keras`` on TF 2.21) and tf_keras; SGD and
Adam.  The kernel is 128 MiB, each optimizer slot 128 MiB more (tf_keras' SGD keeps a momentum slot
even at momentum 0), x 16 MiB and the targets 128 MiB.  Split along the batch's rows, a step still
holds the kernel's whole gradient; along the kernel's columns (issue 29) each column block's forward,
gradient and update are computed in one loop step and written into the variables' own buffers.

For each: XLA's "Total bytes used" as written and under the limit (compiled), the first call (trace,
rewrite, compile and one step) and the median of interleaved steps as written and rewritten (the
naive step fits this machine's memory), and the largest difference over the largest magnitude of the
losses and every variable after three steps from the same start, against the step as written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments._results import OUT_HELP, machine_meta, max_rel_diff, results_dir, write_outputs
from tf_memsafe import hook

LIMIT = 700 * 10**6
FULL = dict(n=2048, d_in=2048, d_out=16384, limit=LIMIT)
QUICK = dict(n=256, d_in=256, d_out=2048, limit=LIMIT // 64)     # the same problem at 1/64 of the bytes
STEPS = 3


@dataclasses.dataclass
class Row:
    keras: str                  # "keras3" or "tf_keras"
    optimizer: str
    n: int
    d_in: int
    d_out: int
    limit_bytes: int
    naive_bytes: int
    tfms_bytes: int
    within_limit: bool
    written_into: str           # the variables the loop writes in place ("" where none)
    plan: str
    naive_first_s: float
    tfms_first_s: float
    naive_step_s: float         # median of interleaved steps
    tfms_step_s: float
    max_rel_diff: float         # losses and variables after STEPS steps, against the step as written


def _keras(name: str):
    if name == "keras3":
        return tf.keras
    import tf_keras

    return tf_keras


def dense_step(keras, optimizer, d_in: int, d_out: int, dtype: str = "float32"):
    """``(step, values)``: a fresh ``Dense(d_out)`` on ``d_in`` inputs from a fixed seed, and
    ``optimizer`` built for it before any trace; ``step(x, y)`` (a plain Python function: the mean
    squared error against ``y``, ``tape.gradient``, ``apply_gradients``) returns the loss, and
    ``values()`` the layer's variables and the optimizer's, as arrays.  (The tests' step too.)"""
    keras.utils.set_random_seed(1)
    layer = keras.layers.Dense(d_out, dtype=dtype)
    layer.build((None, d_in))
    optimizer.build(layer.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x) - y))
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    return step, lambda: [v.numpy() for v in layer.trainable_variables + list(optimizer.variables)]


def _build(keras_name: str, optimizer: str, n: int, d_in: int, d_out: int):
    """``(step, values, inputs)``: a fresh layer and optimizer from a fixed start."""
    keras = _keras(keras_name)
    step, values = dense_step(keras, keras.optimizers.Adam(1e-3) if optimizer == "adam" else keras.optimizers.SGD(0.1),
                              d_in, d_out)
    rng = np.random.default_rng(0)
    inputs = (tf.constant(rng.standard_normal((n, d_in)), tf.float32),
              tf.constant(rng.standard_normal((n, d_out)), tf.float32))
    return step, values, inputs


def _first(fn, inputs) -> tuple[float, float]:
    start = time.perf_counter()
    loss = float(fn(*inputs))
    return time.perf_counter() - start, loss


def measure(keras_name: str, optimizer: str, n: int, d_in: int, d_out: int, limit: int, repeats: int) -> Row:
    step, values, inputs = _build(keras_name, optimizer, n, d_in, d_out)
    naive = tf.function(step, jit_compile=True)
    with hook.suspended():
        naive_bytes = tf_memsafe.memory_footprint(naive, *inputs, rewrite=False)
        naive_first, loss = _first(naive, inputs)
        losses0 = [loss] + [float(naive(*inputs)) for _ in range(STEPS - 1)]
    values0 = values()

    step, values, inputs = _build(keras_name, optimizer, n, d_in, d_out)
    mark = hook.report_mark()
    with tf_memsafe.options(memory_limit=limit):
        rewritten = tf.function(step, jit_compile=True)
        tfms_first, loss = _first(rewritten, inputs)
        losses = [loss] + [float(rewritten(*inputs)) for _ in range(STEPS - 1)]
        tfms_bytes = tf_memsafe.memory_footprint(rewritten, *inputs)
    diff = max(max_rel_diff(losses, losses0), max_rel_diff(values(), values0))
    plans = [r.plan for rep in hook.reports_since(mark) for r in rep.records
             if r.pass_name == "splitter" and r.action == "rewritten"]
    plans = list(dict.fromkeys(plans))              # (the measurement's own trace plans alike)
    written = sorted({name for p in plans for name in p.written_into})

    times: dict = {"naive": [], "tfms": []}
    for _ in range(repeats):                        # interleaved: the machine's drift hits both alike
        for key, fn in (("naive", naive), ("tfms", rewritten)):
            start = time.perf_counter()
            fn(*inputs).numpy()
            times[key].append(time.perf_counter() - start)
    return Row(keras_name, optimizer, n, d_in, d_out, limit, naive_bytes, tfms_bytes, tfms_bytes <= limit,
               ", ".join(written), "; ".join(p.render() for p in plans), round(naive_first, 3), round(tfms_first, 3),
               float(np.median(times["naive"])), float(np.median(times["tfms"])), diff)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument("--keras", nargs="*", choices=["keras3", "tf_keras"], default=["keras3", "tf_keras"])
    parser.add_argument("--optimizers", nargs="*", choices=["sgd", "adam"], default=["sgd", "adam"])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed steps of each (median)")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)
    tf.get_logger().setLevel("ERROR")
    sizes = QUICK if args.quick else FULL
    tf_memsafe.enable(memory_limit=sizes["limit"])
    rows = []
    for keras_name in args.keras:
        for optimizer in args.optimizers:
            rows.append(measure(keras_name, optimizer, **sizes, repeats=args.repeats))
            print(rows[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_outputs(rows, Row, os.path.join(args.out, "wide_layer"),
                  {"quick": args.quick, "repeats": args.repeats, **machine_meta()})
    _plot(rows, os.path.join(args.out, "wide_layer.png"))
    fmt = tf_memsafe.format_bytes
    for r in rows:
        print(f"{r.keras:8} {r.optimizer:4} {fmt(r.naive_bytes):>10} -> {fmt(r.tfms_bytes):>10} "
              f"(limit {fmt(r.limit_bytes)}, {'within' if r.within_limit else 'OVER'}) step {r.naive_step_s:.2f} s -> "
              f"{r.tfms_step_s:.2f} s, first {r.naive_first_s:.1f} s -> {r.tfms_first_s:.1f} s, "
              f"diff {r.max_rel_diff:.1e}; in place: {r.written_into or '-'}")
    return 0


def _plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.keras}\n{r.optimizer}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.2, [r.naive_bytes / 2**20 for r in rows], 0.4, label="as written")
    ax.bar(x + 0.2, [r.tfms_bytes / 2**20 for r in rows], 0.4, label="tf_memsafe")
    if rows:
        ax.axhline(rows[0].limit_bytes / 2**20, color="k", linestyle="--", label="limit")
    ax.set_xticks(x, labels)
    ax.set_ylabel("XLA footprint (MiB)")
    ax.set_title("A wide layer's training step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
