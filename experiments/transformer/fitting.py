"""The tutorial's model trained the tutorial's way: ``compile`` and ``fit(jit_compile=True)`` on padded ``tf.data``.

The Transformer tutorial batches its sentence pairs with ``tf.data`` (each batch padded to its own
longest sentence), compiles the model with its masked loss and accuracy and Adam under its warm-up
schedule, and calls ``fit``.  Keras then traces one training step for every batch shape, with the
batch and both lengths ``None`` (``reduce_retracing``), and XLA compiles that trace once per concrete
shape.  :class:`FitCase` is the sweep's ``--pipeline tfdata`` mode (:mod:`.sweep`), one row per
variant at one length ``L``:

* the data: batches of ``B`` random sentence pairs of ``L / 2`` to ``L`` tokens, one of each batch
  exactly ``L`` (so that every batch pads to ``L`` and the step compiles once), made with
  ``padded_batch`` (:func:`padded_data`);
* the footprint: XLA's figure for the step Keras compiles, traced as ``fit`` traces it (the model's
  ``train_step`` under ``tf.function(jit_compile=True)`` with the data set's ``None`` shapes) and
  compiled (never run) for ``[B, L]`` batches -- so a step over the limit is measured without
  running it;
* the run, where the step is within the limit (and ``L`` within ``--max-run-length``): ``fit`` for
  one epoch of ``1 + repeats`` batches, tf_memsafe enabled for the tf_memsafe variant (with
  ``redraw_random`` where dropout is on), the first batch timed with its trace, rewrite and compile
  (``first_call_s``), the others' median (``seconds``), and XLA's figure for each program ``fit``
  compiled (``fit_footprint_bytes``: the largest);
* the losses per batch, compared with the naive run's where both ran and dropout is off.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings

import numpy as np
import tensorflow as tf

import tf_memsafe
from experiments._results import StepTimes
from experiments.transformer import model as tmodel
from experiments.transformer.data import PAD
from tf_memsafe import hook, xla_flags

__all__ = ["padded_data", "FitCase", "FitResult"]


def padded_data(batch: int, length: int, batches: int, input_vocab: int, target_vocab: int,
                seed: int = 0) -> tf.data.Dataset:
    """``batches`` padded batches ``((context, target_in), labels)`` of ``batch`` random sentence pairs,
    ``length // 2`` to ``length`` tokens each (the first pair of a batch exactly ``length``), with the
    tutorial's shift of the target by one token; the data set's shapes are ``[None, None]``."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(batches):
        for i in range(batch):
            n, m = (length, length) if i == 0 else rng.integers(length // 2, length + 1, 2)
            pairs.append((rng.integers(1, input_vocab, n), rng.integers(1, target_vocab, m + 1)))
    spec = (tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32))
    data = tf.data.Dataset.from_generator(lambda: iter(pairs), output_signature=spec)
    return data.padded_batch(batch, padding_values=PAD).map(lambda context, target: (
        (context, target[:, :-1]), target[:, 1:]))


@dataclasses.dataclass
class FitResult:
    """One variant's measures (the sweep's Row fields) and its losses, per batch."""

    fields: dict
    losses: list[float] | None


class FitCase:
    """The tutorial's model compiled the tutorial's way, measured at one length after another; both
    variants start every run from the same weights and optimizer state.  Each variant's step is traced
    (and, for tf_memsafe, rewritten) once, with the data set's ``None`` shapes, and compiled for each
    length, as ``fit`` does."""

    def __init__(self, config: tmodel.TransformerConfig, keras_version: int, batch: int, limit: int,
                 repeats: int, redraw_random: bool = False, seed: int = 0):
        self.keras = tmodel.keras_module(keras_version)
        self.keras.utils.set_random_seed(seed)
        self.model = tmodel.build_transformer(config, keras_version=keras_version)
        self.model.compile(optimizer=tmodel.tutorial_optimizer(config.d_model, keras_version),
                           loss=tmodel.masked_loss, metrics=[tmodel.masked_accuracy], jit_compile=True)
        self.model.optimizer.build(self.model.trainable_variables)
        self.config, self.limit, self.redraw_random, self.batch = config, limit, redraw_random, batch
        self.repeats, self.seed = repeats, seed
        self.variables = list(self.model.variables) + list(self.model.optimizer.variables)
        self.snapshot = [v.numpy() for v in self.variables]
        self.traced: dict = {}          # variant -> (step, seconds to trace, records, warnings, status)

    def data(self, length: int) -> tf.data.Dataset:
        return padded_data(self.batch, length, 1 + self.repeats, self.config.input_vocab_size,
                           self.config.target_vocab_size, self.seed)

    def _restore(self):
        for v, value in zip(self.variables, self.snapshot):
            v.assign(value)

    def _enable(self, variant: str):
        if variant == "naive":
            tf_memsafe.disable()
        else:
            tf_memsafe.enable(self.limit, redraw_random=self.redraw_random)

    def _trace(self, variant: str, spec) -> tuple:
        if variant not in self.traced:
            step = tf.function(self.model.train_step, jit_compile=True, input_signature=[spec])
            mark = hook.report_mark()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._enable(variant)
                try:
                    start = time.perf_counter()
                    step.get_concrete_function()
                    trace_s = time.perf_counter() - start
                finally:
                    tf_memsafe.disable()
            reports = hook.reports_since(mark)
            records = [rec for r in reports for rec in r.records]
            status = "disabled" if variant == "naive" else reports[-1].status if reports else "not seen by tf_memsafe"
            said = [str(c.message) for c in caught
                    if issubclass(c.category, RuntimeWarning) and "tf_memsafe" in str(c.message)]
            self.traced[variant] = (step, trace_s, records, said, status)
        return self.traced[variant]

    def footprint(self, variant: str, length: int) -> tuple[int, float, list, list[str], str]:
        """``(XLA's figure, seconds to trace, tf_memsafe's records, its warnings, its status)`` of the step
        ``fit`` compiles for ``[B, L]`` batches, traced with the data set's ``None`` shapes (not run)."""
        data = self.data(length)
        step, trace_s, records, said, status = self._trace(variant, data.element_spec)
        with xla_flags.dump_for_one_compile() as folder:
            step.experimental_get_compiler_ir(next(iter(data)))(stage="optimized_hlo")
            figures = xla_flags.memory_reports(folder)
        if not figures:
            raise tf_memsafe.MeasurementError("XLA wrote no memory-usage report (was tf_memsafe imported first?)")
        return sum(total for _, total in figures), trace_s, records, said, status

    def fit(self, variant: str, length: int) -> tuple[list[float], float, float, int]:
        """``fit`` for one epoch: ``(loss per batch, first batch's seconds, median of the others, XLA's
        largest figure among the programs compiled)``."""
        self._restore()
        self.model.train_function = None            # traced again, by this variant (Keras caches it)
        times, losses = StepTimes(self.keras), []

        class Losses(self.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                losses.append(float(logs["loss"]))

        self._enable(variant)
        try:
            with xla_flags.dump_all_compiles(in_memory=True) as folder:
                self.model.fit(self.data(length), epochs=1, verbose=0, callbacks=[times.callback, Losses()])
                figure = max((total for _, total in xla_flags.memory_reports(folder)), default=0)
        finally:
            tf_memsafe.disable()
        first, rest = times.times[0], times.times[1:]
        return losses, first, statistics.median(rest) if rest else first, figure

    def measure(self, variant: str, length: int, may_run: bool) -> FitResult:
        """One variant's footprint at ``length``, and its ``fit`` where within the limit and ``may_run``."""
        footprint, trace_s, records, said, status = self.footprint(variant, length)
        warned = list(dict.fromkeys(r.splitlines()[0][:300] for r in said))
        splits = [r for r in records if r.pass_name == "splitter" and r.action == "rewritten"]
        within = footprint <= self.limit
        notes = list(warned)
        losses, seconds, first_s, figure = None, None, None, None
        if not within:
            notes.append("not run: over the limit")
        elif not may_run:
            notes.append("not run: longer than --max-run-length")
        else:
            losses, first_s, seconds, figure = self.fit(variant, length)
        fields = dict(footprint_bytes=footprint, within_limit=within, status=status, splits=len(splits),
                      split=splits[0].reason if splits else "", ran=losses is not None, seconds=seconds,
                      first_call_s=first_s, trace_s=trace_s, note="; ".join(notes), fit_footprint_bytes=figure)
        return FitResult(fields, losses)
