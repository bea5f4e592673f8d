"""Stateless random draws under XLA, their key made inside every element as written, once under tf_memsafe.

    python -m experiments.random_key [--quick] [--out experiments/results] [--repeats 5]
        [--cases uniform keras3_dropout keras3_fit]

``tf.random.stateless_*`` with its default ``alg="auto_select"`` (and so Keras 3's ``Dropout``, whose
``keras.random`` draws that way) derives the generator's key with ``StatelessRandomGetKeyCounter``; XLA
fuses that derivation into the loop generating the bits, once per element.  The ``random_key`` pass makes
the key with a separate 4-word Philox draw: the same key, the same values.  Cases (float32):

* ``uniform``: ``tf.random.stateless_uniform([8, 8, 108, 512], seed)`` (the shape of one split slice's
  dropout mask in the tf_keras Transformer's training step at L = 512, batch 8);
* ``keras3_dropout``: Keras 3's ``Dropout(0.1)`` on [8, 512, 512], ``training=True``;
* ``keras3_fit``: Keras 3 ``fit(jit_compile=True)`` of a small model with two ``Dropout(0.1)`` layers
  (``Dense(512, relu)``, dropout, ``Dense(128)``, dropout, mean over the sequence, ``Dense(10)``) on
  batches of [32, 256, 128], sparse categorical cross-entropy, Adam: seconds per batch, and the losses.

Variants: ``naive`` (tf_memsafe not enabled); ``tf_memsafe`` (enabled, 4 GB: every program here fits,
so only time and compile rewrites fire); ``no_random_key`` (the same with ``random_key`` disabled).
Each case's variants are built afresh and timed interleaved (one call of each in turn, ``--repeats``
rounds after a first, untimed call); the median is reported.  Outputs (the drawn values; the losses)
are compared with the naive ones: equal bit for bit is ``max_rel_diff`` 0.  Run alone on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np
import tensorflow as tf

import tf_memsafe  # before anything compiles: it manages XLA_FLAGS
from experiments import _results
from experiments._results import OUT_HELP, StepTimes, machine_meta, max_rel_diff, results_dir, write_outputs

CASES = ("uniform", "keras3_dropout", "keras3_fit")
VARIANTS = ("naive", "tf_memsafe", "no_random_key")
LIMIT = "4GB"


@dataclasses.dataclass
class Row:
    case: str
    variant: str
    shape: str
    first_call_s: float       # trace + rewrite + compile + one call (keras3_fit: the first batch)
    median_s: float           # steady state: median over --repeats calls (keras3_fit: batches)
    rewrites: str             # the passes that rewrote the function, with their counts
    max_rel_diff: float       # against the naive variant's outputs (0: bit for bit)


def _enable(variant: str) -> None:
    if variant == "naive":
        tf_memsafe.disable()
    elif variant == "tf_memsafe":
        tf_memsafe.enable(LIMIT)
    elif variant == "no_random_key":
        tf_memsafe.enable(LIMIT, disabled_passes=["random_key"])
    else:
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")


def _rewrites(mark) -> str:
    return _results.rewrite_counts(tf_memsafe.hook.reports_since(mark))


def _function_case(case: str, quick: bool):
    """``(shape text, make)``: ``make()`` returns a fresh ``(callable, args)`` for one variant."""
    if case == "uniform":
        shape = [2, 8, 54, 256] if quick else [8, 8, 108, 512]
        seed = tf.constant([7, 11], tf.int64)

        def make():
            return tf.function(lambda s: tf.random.stateless_uniform(shape, s), jit_compile=True), (seed,)
    else:
        import keras

        shape = [2, 128, 128] if quick else [8, 512, 512]
        x = tf.constant(np.random.default_rng(0).standard_normal(shape).astype(np.float32))

        def make():
            layer = keras.layers.Dropout(0.1, seed=3)
            return tf.function(lambda x: layer(x, training=True), jit_compile=True), (x,)
    return "x".join(map(str, shape)), make


def run_function_case(case: str, repeats: int, quick: bool) -> list[Row]:
    shape, make = _function_case(case, quick)
    built, first, outputs, rewrites = {}, {}, {}, {}
    for variant in VARIANTS:
        mark = tf_memsafe.hook.report_mark()
        _enable(variant)
        try:
            fn, args = make()
            start = time.perf_counter()
            outputs[variant] = fn(*args).numpy()
            first[variant] = time.perf_counter() - start
        finally:
            tf_memsafe.disable()
        built[variant], rewrites[variant] = (fn, args), _rewrites(mark)
    times = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            fn, args = built[variant]
            start = time.perf_counter()
            fn(*args).numpy()
            times[variant].append(time.perf_counter() - start)
    return [Row(case, v, shape, round(first[v], 3), round(statistics.median(times[v]), 4), rewrites[v],
                max_rel_diff(outputs[v], outputs["naive"])) for v in VARIANTS]


def _fit_once(variant: str, x, y, batch: int) -> tuple[list[float], list[float], str]:
    """One variant's ``fit`` for one epoch from seed 0: ``(seconds per batch, losses, rewrites)``."""
    import keras

    length, width = x.shape[1:]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((length, width)), keras.layers.Dense(4 * width, activation="relu"),
                              keras.layers.Dropout(0.1), keras.layers.Dense(width), keras.layers.Dropout(0.1),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    times, losses = StepTimes(keras), []

    class Losses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))

    mark = tf_memsafe.hook.report_mark()
    _enable(variant)
    try:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[times.callback, Losses()])
    finally:
        tf_memsafe.disable()
    return times.times, losses, _rewrites(mark)


def run_fit_case(repeats: int, quick: bool) -> list[Row]:
    batch, length, width = (8, 64, 32) if quick else (32, 256, 128)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * (1 + repeats), length, width)).astype(np.float32)
    y = rng.integers(0, 10, batch * (1 + repeats))
    rows, reference = [], None
    for variant in VARIANTS:     # one fit each: a fit is many calls, timed per batch
        times, losses, rewrites = _fit_once(variant, x, y, batch)
        reference = losses if reference is None else reference
        rows.append(Row("keras3_fit", variant, f"{batch}x{length}x{width}", round(times[0], 3),
                        round(statistics.median(times[1:]), 4), rewrites,
                        max_rel_diff(np.asarray(losses), np.asarray(reference))))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, a smoke run")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (batches) after the first")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = parser.parse_args(argv)
    rows: list[Row] = []
    for case in args.cases:
        rows += run_fit_case(args.repeats, args.quick) if case == "keras3_fit" else \
            run_function_case(case, args.repeats, args.quick)
        for row in rows[-len(VARIANTS):]:
            print(row, flush=True)
    meta = {"quick": args.quick, "cases": args.cases, "repeats": args.repeats, "limit": LIMIT, **machine_meta(),
            "how": "run alone on the machine; variants of a case interleaved call by call (keras3_fit: one fit "
                   "each, in turn); medians of the calls after the first"}
    write_outputs(rows, Row, os.path.join(results_dir(args.out, args.quick), "random_key"), meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
