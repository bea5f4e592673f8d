"""A Transformer encoder layer written the ordinary Keras way, at batch 4, under 1/16 of its own footprint.

    python -m experiments.encoder_layer [--quick] [--out experiments/results]

The layer as the Keras and TensorFlow tutorials write it (issue 28): ``MultiHeadAttention`` (4 heads
of 16 on d_model 64), a feed-forward pair of ``Dense`` layers on the 3-D activations (hidden 256,
ReLU), two ``LayerNormalization``s and a residual around each; batch 4; Keras 3 (what ``tf.keras`` is on
TF 2.21) and tf_keras.  Three programs, each under a limit of its own naive figure / ``--ratio``
(16 by default):

- ``forward``: one layer (or a stack of ``depth``) at inference;
- ``step``: a training step with the tape inside (mean squared output, every weight's gradient);
- ``fit``: a model of such layers and a per-position 10-way classifier trained with
  ``fit(jit_compile=True)`` (Adam, sparse cross-entropy, accuracy) on a ``tf.data`` pipeline, two
  epochs of two batches; its figure is the largest of the programs ``fit`` compiles.

For each: XLA's "Total bytes used" as written and rewritten (compiled, from the same trace the run
uses), whether it is within the limit, the loops' plans, the first call rewritten (trace, rewrite,
compile, one run) against as written, and the largest difference against the program as written
over the largest magnitude among its outputs (forward), its loss and gradients (step: the keys'
bias gradient is zero up to rounding, softmax ignores it, so each gradient is not taken alone) or
the losses of every epoch (fit).

The attention's keys and values, its input and output (2 MiB each at L = 2048) are read whole by
every slice of the sequence, so 1/16 is out of reach at L = 512 (the scores, [4, 4, L, L], are what
shrinks): the default lengths are 1024 and 2048.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import warnings

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments._results import OUT_HELP, machine_meta, results_dir, write_outputs
from grappler_ext.splitter.outcome import Code
from tf_memsafe import hook, xla_flags

BATCH, D_MODEL, HEADS = 4, 64, 4
PROGRAMS = ("forward", "step", "fit")


@dataclasses.dataclass
class Row:
    keras: str                  # "keras3" or "tf_keras"
    program: str                # "forward", "step" or "fit"
    depth: int                  # encoder layers stacked
    length: int
    limit_bytes: int
    naive_bytes: int
    tfms_bytes: int
    ratio: float                # naive / rewritten, XLA's figures
    within_limit: bool
    loops: int                  # loops the splitter made (distinct plans)
    plan: str
    warned: str                 # what tf_memsafe said ("" where nothing)
    naive_first_s: float
    tfms_first_s: float
    max_rel_diff: float         # against as written, over the largest magnitude among its outputs


def keras_of(name: str):
    """Keras 3 (``"keras3"``) or tf_keras (``"tf_keras"``)."""
    if name == "keras3":
        import keras
    elif name == "tf_keras":
        import tf_keras as keras
    else:
        raise ValueError(f"unknown Keras {name!r}: 'keras3' or 'tf_keras'")
    return keras


def encoder_layer(keras, dropout: float = 0.0):
    """A fresh encoder layer (not built): attention, feed-forward pair, two layer norms, residuals."""

    class Encoder(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.attention = keras.layers.MultiHeadAttention(HEADS, D_MODEL // HEADS, dropout=dropout)
            self.hidden = keras.layers.Dense(4 * D_MODEL, activation="relu")
            self.out = keras.layers.Dense(D_MODEL)
            self.dropout = keras.layers.Dropout(dropout)
            self.norm1 = keras.layers.LayerNormalization()
            self.norm2 = keras.layers.LayerNormalization()

        def call(self, x, training=False):
            x = self.norm1(x + self.attention(x, x, training=training))
            return self.norm2(x + self.dropout(self.out(self.hidden(x)), training=training))

    return Encoder()


def _inputs(length: int) -> tf.Tensor:
    return tf.constant(np.random.default_rng(0).standard_normal((BATCH, length, D_MODEL)).astype(np.float32))


def _layers(keras, depth: int, x: tf.Tensor) -> list:
    keras.utils.set_random_seed(0)
    layers = [encoder_layer(keras) for _ in range(depth)]
    for layer in layers:
        layer(x)
    return layers


def _program(keras, program: str, depth: int, x: tf.Tensor):
    """A plain Python function of ``x`` over fresh layers from a fixed seed."""
    layers = _layers(keras, depth, x)

    def forward(x, training=False):
        for layer in layers:
            x = layer(x, training=training)
        return x

    if program == "forward":
        return forward

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(forward(x, training=True)))
        weights = [v for layer in layers for v in layer.trainable_variables]
        return (loss,) + tuple(tape.gradient(loss, weights))

    return step


def _traced(keras, program, depth, x, limit):
    """``(outputs, seconds of the first call, XLA's figure, splitter plans, warnings)`` of a fresh
    program, rewritten under ``limit`` (``None``: as written)."""
    fn = tf.function(_program(keras, program, depth, x), jit_compile=True)
    mark = hook.report_mark()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (tf_memsafe.options(memory_limit=limit) if limit else hook.suspended()):
            start = time.perf_counter()
            got = tf.nest.map_structure(lambda t: t.numpy(), fn(x))
            first = time.perf_counter() - start
            figure = tf_memsafe.memory_footprint(fn, x, rewrite=limit is not None)
    return got, first, figure, _plans(mark), _said(caught)


def _plans(mark) -> list:
    plans = [r.plan for rep in hook.reports_since(mark) for r in rep.records
             if r.pass_name == "splitter" and r.code in (Code.SPLIT, Code.BEST_EFFORT)]
    return list(dict.fromkeys(plans))           # (a measurement's own trace plans alike)


def _said(caught) -> list[str]:
    return [str(w.message) for w in caught if "tf_memsafe" in str(w.message)]


def _fitted(keras, depth, length, limit):
    """``(losses, seconds of the first epoch, the largest figure among fit's programs, plans, warnings)``."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input([length, D_MODEL])
    x = inputs
    for _ in range(depth):
        x = encoder_layer(keras)(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=True, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices((rng.standard_normal((2 * BATCH, length, D_MODEL)).astype(np.float32),
                                               rng.integers(0, 10, (2 * BATCH, length)))).batch(BATCH)
    mark = hook.report_mark()
    with warnings.catch_warnings(record=True) as caught, xla_flags.dump_all_compiles(in_memory=True) as folder:
        warnings.simplefilter("always")
        with (tf_memsafe.options(memory_limit=limit) if limit else hook.suspended()):
            start = time.perf_counter()
            losses = model.fit(data, epochs=1, verbose=0).history["loss"]
            first = time.perf_counter() - start
            losses += model.fit(data, epochs=1, verbose=0).history["loss"]
        figure = max(total for _, total in xla_flags.memory_reports(folder))
    return losses, first, figure, _plans(mark), _said(caught)


def measure(keras_name: str, program: str, depth: int, length: int, ratio: int) -> Row:
    keras = keras_of(keras_name)
    if program == "fit":
        want, naive_first, naive, _, _ = _fitted(keras, depth, length, None)
        limit = naive // ratio
        got, first, figure, plans, said = _fitted(keras, depth, length, limit)
    else:
        x = _inputs(length)
        want, naive_first, naive, _, _ = _traced(keras, program, depth, x, None)
        limit = naive // ratio
        got, first, figure, plans, said = _traced(keras, program, depth, x, limit)
    return Row(keras_name, program, depth, length, limit, naive, figure, round(naive / figure, 1), figure <= limit,
               len(plans), "; ".join(p.render() for p in plans), " | ".join(said), round(naive_first, 2),
               round(first, 2), _difference(got, want))


def _difference(got, want) -> float:
    """The largest absolute difference of two nests of outputs over the largest magnitude in ``want``."""
    got, want = ([np.asarray(x, np.float64) for x in tf.nest.flatten(n)] for n in (got, want))
    scale = max(float(np.max(np.abs(w))) if w.size else 0.0 for w in want)
    return max(float(np.max(np.abs(g - w))) if w.size else 0.0 for g, w in zip(got, want)) / max(scale, 1e-30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="L = 512, one layer, a limit of a quarter of each naive figure: a smoke run")
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument("--keras", nargs="*", choices=["keras3", "tf_keras"], default=["keras3", "tf_keras"])
    parser.add_argument("--programs", nargs="*", choices=PROGRAMS, default=list(PROGRAMS))
    parser.add_argument("--lengths", nargs="*", type=int, default=[1024, 2048])
    parser.add_argument("--depths", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--ratio", type=int, default=16, help="the limit is the naive figure over this")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.depths, args.ratio = [512], [1], 4
    args.out = results_dir(args.out, args.quick)
    tf.get_logger().setLevel("ERROR")
    tf_memsafe.enable()          # each program's limit comes from its own naive figure (``options``)
    rows = []
    for length in args.lengths:
        for depth in args.depths:
            for program in args.programs:
                for keras_name in args.keras:
                    rows.append(measure(keras_name, program, depth, length, args.ratio))
                    print(rows[-1], flush=True)
                    write_outputs(rows, Row, os.path.join(args.out, "encoder_layer"),
                                  {"quick": args.quick, "ratio": args.ratio, "batch": BATCH, "d_model": D_MODEL,
                                   "heads": HEADS, **machine_meta()})
    _plot(rows, os.path.join(args.out, "encoder_layer.png"))
    fmt = tf_memsafe.format_bytes
    for r in rows:
        print(f"{r.keras:8} {r.program:7} depth {r.depth} L {r.length:5} {fmt(r.naive_bytes):>10} -> "
              f"{fmt(r.tfms_bytes):>10} ({r.ratio}x; limit {fmt(r.limit_bytes)}, "
              f"{'within' if r.within_limit else 'OVER'}) {r.loops} loop(s), first {r.naive_first_s:.1f} s -> "
              f"{r.tfms_first_s:.1f} s, diff {r.max_rel_diff:.1e}")
    return 0


def _plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    ax.bar(x - 0.2, [r.naive_bytes / 2**20 for r in rows], 0.4, label="as written")
    ax.bar(x + 0.2, [r.tfms_bytes / 2**20 for r in rows], 0.4, label="tf_memsafe")
    ax.scatter(x + 0.2, [r.limit_bytes / 2**20 for r in rows], marker="_", s=200, color="k", label="limit", zorder=3)
    ax.set_xticks(x, [f"{r.keras}\n{r.program} x{r.depth}\nL={r.length}" for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("XLA footprint (MiB)")
    ax.set_title("Encoder layers at batch 4, each under its naive figure / ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
