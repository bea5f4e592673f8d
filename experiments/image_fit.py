"""Keras ``fit`` of a small Vision Transformer on ``tf.data`` batches of run-time size, as written and under a limit.

    python -m experiments.image_fit [--quick] [--keras keras3 tf_keras] [--out experiments/results]

The model is keras.io's "Image classification with Vision Transformer" written small: 4 x 4 patches of
32 x 32 RGB images embedded by a ``Conv2D``, ``LAYERS`` encoder blocks (``LayerNormalization``,
``MultiHeadAttention`` with dropout, a residual, a ``Dense`` pair with GELU and dropout, a residual),
``GlobalAveragePooling1D`` and a ``Dense`` classifier, AdamW, ``compile(jit_compile=True)``.  Its data
are random images with labels a function of them, in ``batch(BATCH)``: the last batch is short, so
Keras traces the step with the batch unknown (``None``) and XLA compiles it for both batch sizes.

The limit is ``FRACTION`` of the naive step's XLA figure at the full batch.  tf_memsafe plans the step
at a nominal batch and splits it along the batch, the gradients computed in the same loop; with
dropout, ``redraw_random=True`` lets each slice draw its own masks (other numbers of the same
distribution, so the losses differ from the naive fit's by the draws).  Per Keras version and method:
XLA's largest "Total bytes used" among the step's programs (every compile of the fit dumped), the
losses of both epochs and their largest relative difference from the naive fit's, the first epoch's
time (trace, tf_memsafe's rewrite, a compile per batch size, and the steps), the second epoch's median
step, tf_memsafe's rewriting time, and the loop's chunk (rows of the batch a step).  The machine runs
nothing else while it is timed (results say how it was run).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow as tf

import tf_memsafe  # noqa: F401 - before the first XLA compile: it manages XLA_FLAGS
from experiments._results import (
    KERAS_VERSIONS,
    fit_parser,
    losses_rel_diff,
    machine_meta,
    results_dir,
    two_epochs,
    write_outputs,
)
from experiments.transformer.model import keras_module
from grappler_ext.splitter.outcome import Code

FRACTION = 0.35


@dataclasses.dataclass(frozen=True)
class Size:
    examples: int             # the batches: BATCH rows each, the last shorter
    batch: int
    width: int                # the patches' embedding
    layers: int
    dropout: float


FULL = Size(examples=1000, batch=64, width=128, layers=4, dropout=0.1)
QUICK = Size(examples=40, batch=16, width=32, layers=1, dropout=0.0)


@dataclasses.dataclass
class Row:
    keras: str                # "keras3" or "tf_keras"
    method: str               # "naive" or "tf_memsafe"
    xla_bytes: int            # the largest figure among the step's compiled programs
    limit_bytes: int
    within_limit: bool
    losses: str               # the two epochs' losses
    loss_rel_diff: float      # against the naive fit's (0 for the naive row)
    first_epoch_s: float      # the trace, rewrite, a compile per batch size, and the steps
    median_step_s: float      # the second epoch's steps (all compiled)
    rewrite_s: float          # tf_memsafe's passes on the step's traces (0 for naive)
    chunk: int                # rows of the batch a step of the loop computes with its gradients (0: no loop)


def vision_transformer(keras, size: Size):
    """The experiment's model, compiled."""
    layers = keras.layers
    keras.utils.set_random_seed(0)
    images = keras.Input([32, 32, 3])
    x = layers.Reshape([64, size.width])(layers.Conv2D(size.width, 4, strides=4)(images))
    for _ in range(size.layers):
        h = layers.LayerNormalization(epsilon=1e-6)(x)
        h = layers.MultiHeadAttention(4, size.width // 4, dropout=size.dropout)(h, h)
        x = layers.Add()([h, x])
        h = layers.LayerNormalization(epsilon=1e-6)(x)
        h = layers.Dropout(size.dropout)(layers.Dense(2 * size.width, activation="gelu")(h))
        x = layers.Add()([layers.Dense(size.width, activation="gelu")(h), x])
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization(epsilon=1e-6)(x))
    model = keras.Model(images, layers.Dense(10)(layers.Dropout(size.dropout)(x)))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3, weight_decay=1e-4), jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(size: Size) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    images = rng.random((size.examples, 32, 32, 3), dtype=np.float32)
    labels = (images[:, :16].mean(axis=(1, 2, 3)) * 40).astype(np.int32) % 10
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(size.batch)


def _fit(version: str, size: Size, limit: int | None) -> tuple:
    keras = keras_module(3 if version == "keras3" else 2)
    losses, figure, first_s, step_s, reports = two_epochs(vision_transformer(keras, size), _data(size), keras, limit,
                                                          redraw_random=size.dropout > 0)
    rewrite = sum(r.rewrite_seconds or 0.0 for r in reports)
    plans = [r.plan for rep in reports for r in rep.records if r.pass_name == "splitter" and r.code == Code.SPLIT]
    return losses, figure, first_s, step_s, rewrite, max((p.backward_chunk for p in plans), default=0)


def run(size: Size, versions=KERAS_VERSIONS, fraction: float = FRACTION) -> list[Row]:
    rows = []
    for version in versions:
        naive = _fit(version, size, None)
        limit = int(naive[1] * fraction)
        for method, (losses, figure, first_s, step_s, rewrite, chunk) in (
                ("naive", naive), ("tf_memsafe", _fit(version, size, limit))):
            diff = losses_rel_diff(losses, naive[0])
            rows.append(Row(version, method, figure, limit, figure <= limit, " ".join(f"{v:.6f}" for v in losses),
                            diff, round(first_s, 3), round(step_s, 4),
                            round(rewrite, 3) if method == "tf_memsafe" else 0.0, chunk))
    return rows


def main(argv=None) -> int:
    args = fit_parser(__doc__.splitlines()[0], "a small model without dropout, a smoke run").parse_args(argv)
    size = QUICK if args.quick else FULL
    rows = run(size, tuple(args.keras))
    meta = {"fraction": FRACTION, **dataclasses.asdict(size), "quick": args.quick, **machine_meta(),
            "how": "run alone on the machine; each fit in turn (naive first), two epochs over the same batches"}
    write_outputs(rows, Row, os.path.join(results_dir(args.out, args.quick), "image_fit"), meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
