"""Keras convolutional models trained split along their batch: convolutions' gradients inside the loops.

    python -m experiments.conv_loops [--quick] [--out experiments/results] [--keras keras3 tf_keras]
        [--models cnn autoencoder] [--ratio 4] [--batches 3] [--variants naive tf_memsafe ...]

XLA:CPU canonicalizes only a program's top-level convolutions (``grappler_ext.xla_facts``), so
TensorFlow's gradients of a convolution computed inside the splitter's loop ran in XLA's naive
emitter; ``grappler_ext.loop_convolutions`` builds them (and transposed convolutions) canonical.
Models, ``fit(jit_compile=True)`` on ``tf.data`` ``.batch(32)`` (the batch ``None`` in the step), Adam:

* ``cnn``: the TensorFlow image-classification tutorial's model on 128 x 128 x 3 images: rescaling,
  three ``Conv2D`` (16, 32, 64, ReLU) each followed by max pooling, ``Flatten``, ``Dense(128)``,
  ``Dense(5)``;
* ``autoencoder``: a convolutional autoencoder on 64 x 64 x 1 images, ``Conv2D`` 32 and 64 with stride
  2 down, ``Conv2DTranspose`` 64 and 32 with stride 2 up, a ``Conv2D(1)`` out, mean squared error.

Variants, each model's in turn in this process: ``naive`` (tf_memsafe not enabled); ``tf_memsafe``
under the naive step's XLA figure / ``--ratio``; ``tf_naive_grads``: the same with the canonical forms
switched off (``loop_convolutions.made`` patched to do nothing, as before the change);
``tf_ungrown``: the same with a loop that computes its gradients as it goes kept at the chunk the
memory model gave it (``Tuning.fused_starved_steps`` out of reach), not grown into the room XLA's
figure leaves (as before that change).  Two epochs of ``--batches`` batches: the first epoch (traces,
rewrite, compiles), the median batch of the second, XLA's largest figure among the programs
compiled, the losses' largest relative difference from naive's, the loops' chunks.  Run alone on
the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from unittest import mock

import numpy as np
import tensorflow as tf

import tf_memsafe  # before anything compiles: it manages XLA_FLAGS
from experiments._results import OUT_HELP, StepTimes, machine_meta, max_rel_diff, results_dir, write_outputs
from grappler_ext import loop_convolutions
from grappler_ext.splitter.outcome import LoopPlan
from grappler_ext.splitter.tuning import Tuning
from tf_memsafe import hook, xla_flags

MODELS = ("cnn", "autoencoder")
VARIANTS = ("naive", "tf_memsafe", "tf_naive_grads", "tf_ungrown")
BATCH, BATCHES = 32, 3


@dataclasses.dataclass
class Row:
    keras: str
    model: str
    variant: str
    limit_bytes: int              # 0 for naive
    xla_bytes: int                # the largest "Total bytes used" among the programs fit compiled
    first_epoch_s: float          # traces, rewrite, compiles, and its batches
    median_step_s: float          # the second epoch's median batch
    step_over_naive: float
    max_rel_diff: float           # the losses' against naive's
    chunks: str = ""              # the loops' chunks, as the splitter's records give them ("" for naive)


def _keras(name: str):
    if name == "keras3":
        import keras
    else:
        import tf_keras as keras
    return keras


def _model(keras, name: str, quick: bool, batches: int = BATCHES):
    """A fresh model (seed 0) and its data, ``batches`` batches."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    L = keras.layers
    if name == "cnn":
        side = 32 if quick else 128
        x = rng.integers(0, 256, (BATCH * batches, side, side, 3)).astype(np.float32)
        y = rng.integers(0, 5, BATCH * batches)
        layers = [keras.Input((side, side, 3)), L.Rescaling(1.0 / 255)]
        for filters in (16, 32, 64):
            layers += [L.Conv2D(filters, 3, padding="same", activation="relu"), L.MaxPooling2D()]
        model = keras.Sequential(layers + [L.Flatten(), L.Dense(128, activation="relu"), L.Dense(5)])
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        side = 16 if quick else 64
        x = rng.random((BATCH * batches, side, side, 1)).astype(np.float32)
        y = x
        model = keras.Sequential([
            keras.Input((side, side, 1)),
            L.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
            L.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
            L.Conv2DTranspose(64, 3, strides=2, padding="same", activation="relu"),
            L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu"),
            L.Conv2D(1, 3, padding="same")])
        loss = "mse"
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=True)
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def _chunks(mark: int) -> str:
    """The chunks of the loops the splitter built in the traces reported since ``mark``."""
    return " ".join(str(r.plan.chunk) for rep in hook.reports_since(mark) for r in rep.records
                    if isinstance(r.plan, LoopPlan))


def _fit(keras_name: str, model_name: str, variant: str, limit: int | None, quick: bool, batches: int):
    """``(losses, first epoch s, second epoch's batch times, XLA's largest figure, the loops' chunks)``."""
    keras = _keras(keras_name)
    model, data = _model(keras, model_name, quick, batches)
    times = StepTimes(keras)
    patch = (mock.patch.object(loop_convolutions, "made", lambda op: None) if variant == "tf_naive_grads"
             else contextlib.nullcontext())
    pipeline = (hook.use_pipeline(hook.product_pipeline(Tuning(fused_starved_steps=2**31 - 1)))
                if variant == "tf_ungrown" else contextlib.nullcontext())
    mark = hook.report_mark()
    if variant != "naive":
        tf_memsafe.enable(limit)
    try:
        with xla_flags.dump_all_compiles(in_memory=True) as folder, patch, pipeline:
            start = time.perf_counter()
            losses = model.fit(data, epochs=1, verbose=0).history["loss"]
            first = time.perf_counter() - start
            losses += model.fit(data, epochs=1, verbose=0, callbacks=[times.callback]).history["loss"]
            figure = max(total for _, total in xla_flags.memory_reports(folder))
        chunks = _chunks(mark) if variant != "naive" else ""
    finally:
        tf_memsafe.disable()
    return losses, first, times.times, figure, chunks


def measure(keras_name: str, model_name: str, ratio: int, quick: bool, batches: int = BATCHES,
            variants=VARIANTS) -> list[Row]:
    losses, first, steps, naive, _ = _fit(keras_name, model_name, "naive", None, quick, batches)
    base = statistics.median(steps)
    rows = [Row(keras_name, model_name, "naive", 0, naive, round(first, 2), round(base, 4), 1.0, 0.0)]
    limit = naive // ratio
    for variant in [v for v in variants if v != "naive"]:
        got, first, steps, figure, chunks = _fit(keras_name, model_name, variant, limit, quick, batches)
        step = statistics.median(steps)
        rows.append(Row(keras_name, model_name, variant, limit, figure, round(first, 2), round(step, 4),
                        round(step / base, 2), max_rel_diff(np.asarray(got), np.asarray(losses)), chunks))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small images, a smoke run")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--keras", nargs="+", choices=["keras3", "tf_keras"], default=["keras3", "tf_keras"])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--ratio", type=int, default=4, help="the limit is the naive step's figure over this")
    parser.add_argument("--batches", type=int, default=BATCHES, help="batches an epoch")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args(argv)
    tf.get_logger().setLevel("ERROR")
    rows: list[Row] = []
    for keras_name in args.keras:
        for model_name in args.models:
            rows += measure(keras_name, model_name, args.ratio, args.quick, args.batches, args.variants)
            print("\n".join(map(str, rows[-len(args.variants):])), flush=True)
    how = "run alone; each model's variants in turn in one process; medians of the second epoch's batches"
    name = "conv_loops" if set(args.variants) == set(VARIANTS) else "conv_loops_" + "_".join(args.variants)
    write_outputs(rows, Row, os.path.join(results_dir(args.out, args.quick), name),
                  {"quick": args.quick, "ratio": args.ratio, "batch": BATCH, "batches": args.batches, "how": how,
                   **machine_meta()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
