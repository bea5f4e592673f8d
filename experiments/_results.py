"""Where a benchmark writes, and its rows: one CSV column per field of its row dataclass, and a JSON copy;
how a row says two programs' outputs differ (:func:`max_rel_diff`); a Keras run's time per batch
(:class:`StepTimes`), and two epochs of a Keras ``fit`` timed and measured (:func:`two_epochs`).

A full run writes to ``experiments/results`` (the committed results); a ``--quick`` smoke run to
``experiments/results/quick`` (ignored by git), so that trying the quick check never overwrites
the measured tables.  ``--out`` chooses the folder explicitly.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import time

__all__ = ["write_outputs", "results_dir", "machine_meta", "max_rel_diff", "rewrite_counts", "StepTimes", "two_epochs",
           "fit_parser", "losses_rel_diff",
           "RESULTS",
           "QUICK_RESULTS", "OUT_HELP"]

RESULTS = os.path.join("experiments", "results")
QUICK_RESULTS = os.path.join(RESULTS, "quick")
OUT_HELP = f"results folder (default {RESULTS}; with --quick, {QUICK_RESULTS}, never the committed results)"


def results_dir(out: str | None, quick: bool) -> str:
    """``out`` if given, else the committed results folder for a full run and its ``quick/`` subfolder
    for a smoke run."""
    return out if out else (QUICK_RESULTS if quick else RESULTS)


def machine_meta() -> dict:
    """What a benchmark's JSON records of the machine it ran on: TensorFlow's version and the cores."""
    import platform

    import tensorflow as tf

    return {"tensorflow": tf.__version__, "cpus": os.cpu_count(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, TensorFlow {tf.__version__}"}


def max_rel_diff(got, expected) -> float:
    """The largest absolute difference over the largest magnitude, per output of two nests of
    outputs (tensors or arrays, same structure), the worst output's; 0 for an empty one."""
    import numpy as np
    import tensorflow as tf

    def flat(out):
        return [np.asarray(x) for x in tf.nest.flatten(out)]

    return max(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)) if x.size else 0.0
               for x, y in zip(flat(got), flat(expected)))


def rewrite_counts(reports) -> str:
    """The passes that rewrote in ``reports`` (tf_memsafe's trace reports), with their counts:
    ``"random_key x2, splitter x1"``; empty where none did."""
    counts: dict[str, int] = {}
    for report in reports:
        for rec in report.records:
            if rec.action == "rewritten":
                counts[rec.pass_name] = counts.get(rec.pass_name, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def write_outputs(rows: list, row_type: type, stem: str, meta: dict) -> None:
    """``stem.csv`` (one column per field of ``row_type``) and ``stem.json`` (``meta`` and the rows)."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[fld.name for fld in dataclasses.fields(row_type)])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in rows)
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump({**meta, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


class StepTimes:
    """A Keras callback (``callback``) keeping the seconds of each training batch (``times``), for
    either Keras (``keras``: the module the model is built with)."""

    def __init__(self, keras):
        outer = self
        self.times: list[float] = []

        class Callback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                outer.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                outer.times.append(time.perf_counter() - outer.start)

        self.callback = Callback()


def two_epochs(model, data, keras, limit: int | None = None, **options) -> tuple:
    """Two epochs of ``model.fit`` on ``data`` (``keras``: the module it is built with), with tf_memsafe
    enabled at ``limit`` and ``options`` (``None``: as written) and every compile dumped: ``(the two
    losses, XLA's largest "Total bytes used" among the programs, the first epoch's seconds, the second
    epoch's median step, tf_memsafe's reports of the traces made)``."""
    import statistics

    import tf_memsafe
    from tf_memsafe import hook, xla_flags

    mark = hook.report_mark()
    if limit is not None:
        tf_memsafe.enable(limit, **options)
    try:
        with xla_flags.dump_all_compiles(in_memory=True) as folder:
            steps = StepTimes(keras)
            start = time.perf_counter()
            first = model.fit(data, epochs=1, verbose=0, callbacks=[steps.callback]).history["loss"]
            first_s = time.perf_counter() - start
            steps.times.clear()
            second = model.fit(data, epochs=1, verbose=0, callbacks=[steps.callback]).history["loss"]
            figure = max(total for _, total in xla_flags.memory_reports(folder))
    finally:
        tf_memsafe.disable()
    return first + second, figure, first_s, statistics.median(steps.times), hook.reports_since(mark)


KERAS_VERSIONS = ("keras3", "tf_keras")


def fit_parser(description: str, quick_help: str):
    """The command line of a benchmark of Keras fits: ``--quick`` (``quick_help``), ``--out`` and
    ``--keras`` (the versions to run, default both)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--keras", nargs="+", choices=KERAS_VERSIONS, default=list(KERAS_VERSIONS),
                        help="the Keras versions to run (default: both)")
    return parser


def losses_rel_diff(losses, reference) -> float:
    """The largest relative difference of a fit's ``losses`` from the ``reference`` fit's, epoch by epoch."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))
