"""Keras ``fit`` on padded batches (batch and length both known only at run time), as written and under a limit.

    python -m experiments.padded [--quick] [--keras keras3 tf_keras] [--out experiments/results]

The model is an ordinary attention classifier: ``Embedding``, ``MultiHeadAttention`` (4 heads of 16)
with a residual and ``LayerNormalization``, ``GlobalAveragePooling1D`` and a ``Dense`` classifier,
Adam, ``compile(jit_compile=True)``.  Its data are ``tf.data`` sequences of random tokens batched with
``padded_batch(4)``: each batch is padded to its own longest sequence, so Keras traces the step with
``[None, None]`` tokens (the TensorFlow Transformer tutorial's pipeline does the same) and XLA
compiles it for each batch's shape.  For each longest length ``L`` the batches' lengths are ``L``,
``3L/4``, ``L/2`` and ``L`` again (three shapes), for two epochs.

Per Keras version, ``L`` and method (``naive``: tf_memsafe off; ``tf_memsafe``: on, under the limit):
XLA's largest "Total bytes used" among the step's programs (every compile of the fit is dumped), the
losses of both epochs (equal to the naive fit's up to float32 rounding), the first epoch's time
(traces, tf_memsafe's rewrite, and a compile per shape), the second epoch's median step (all
compiled), and tf_memsafe's rewriting time (its reports).  The machine runs nothing else while it is
timed (results say how it was run).
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

D, HEADS, VOCAB, BATCH = 64, 4, 100, 4
LENGTHS, LIMIT = (512, 1024, 2048), 64 * 10**6
QUICK_LENGTHS, QUICK_LIMIT = (256,), 4 * 10**6


@dataclasses.dataclass
class Row:
    keras: str                # "keras3" or "tf_keras"
    length: int               # the longest batch's length L
    method: str               # "naive" or "tf_memsafe"
    xla_bytes: int            # the largest figure among the step's compiled programs
    limit_bytes: int
    within_limit: bool
    losses: str               # the two epochs' losses
    loss_rel_diff: float      # against the naive fit's (0 for the naive row)
    first_epoch_s: float      # traces, rewrite, a compile per shape, and the steps
    median_step_s: float      # the second epoch's steps (all compiled)
    rewrite_s: float          # tf_memsafe's passes on the step's traces (0 for naive)
    split: bool               # whether a loop was built in the step


def attention_classifier(keras, vocab: int = VOCAB):
    """The experiment's model, compiled (``tests/integration/test_padded_batches.py`` trains it too)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input([None], dtype="int32")
    x = keras.layers.Embedding(vocab, D)(tokens)
    x = keras.layers.LayerNormalization()(x + keras.layers.MultiHeadAttention(HEADS, D // HEADS)(x, x))
    model = keras.Model(tokens, keras.layers.Dense(vocab)(keras.layers.GlobalAveragePooling1D()(x)))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(length: int) -> tf.data.Dataset:
    rng = np.random.default_rng(length)
    lengths = [n for top in (length, 3 * length // 4, length // 2, length) for n in [top] + list(
        rng.integers(top // 2, top, BATCH - 1))]
    sequences = [rng.integers(1, VOCAB, n) for n in lengths]
    return tf.data.Dataset.from_generator(
        lambda: ((s, np.int32(s.sum() % VOCAB)) for s in sequences),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32))).padded_batch(BATCH)


def _fit(version: str, length: int, limit: int | None) -> tuple:
    keras = keras_module(3 if version == "keras3" else 2)
    losses, figure, first_s, step_s, reports = two_epochs(attention_classifier(keras), _data(length), keras, limit)
    rewrite = sum(r.rewrite_seconds or 0.0 for r in reports)
    split = any(r.pass_name == "splitter" and r.action == "rewritten" for rep in reports for r in rep.records)
    return losses, figure, first_s, step_s, rewrite, split


def run(lengths, limit: int, versions=KERAS_VERSIONS) -> list[Row]:
    rows = []
    for version in versions:
        for length in lengths:
            naive = _fit(version, length, None)
            for method, (losses, figure, first_s, step_s, rewrite, split) in (
                    ("naive", naive), ("tf_memsafe", _fit(version, length, limit))):
                diff = losses_rel_diff(losses, naive[0])
                rows.append(Row(version, length, method, figure, limit, figure <= limit,
                                " ".join(f"{v:.6f}" for v in losses), diff, round(first_s, 3), round(step_s, 4),
                                round(rewrite, 3) if method == "tf_memsafe" else 0.0, split))
    return rows


def main(argv=None) -> int:
    args = fit_parser(__doc__.splitlines()[0], "one small length, a smoke run").parse_args(argv)
    lengths, limit = (QUICK_LENGTHS, QUICK_LIMIT) if args.quick else (LENGTHS, LIMIT)
    rows = run(lengths, limit, tuple(args.keras))
    meta = {"limit_bytes": limit, "batch": BATCH, "d_model": D, "heads": HEADS, "quick": args.quick,
            **machine_meta(),
            "how": "run alone on the machine; each fit in turn (naive first), two epochs over the same batches"}
    write_outputs(rows, Row, os.path.join(results_dir(args.out, args.quick), "padded"), meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
