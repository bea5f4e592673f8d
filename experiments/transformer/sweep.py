"""Transformer sequence-length sweep: the tutorial's model, unchanged, naive and under tf_memsafe.

    python -m experiments.transformer.sweep [--preset cpu|gpu] [--quick] [--lengths 256 512 ...]
        [--limit 2GB] [--batch 1] [--modes forward train] [--train-lengths ...] [--repeats 3] [--max-run-length N]
        [--data random|ted_hrlr] [--dropout RATE] [--keras 2|3] [--pipeline step|tfdata] [--out experiments/results]

For each sequence length L (context and target both L tokens) x {naive, tf_memsafe} x
{forward, train}:

* ``forward``: ``model((context, target_in), training=False)`` inside a user-written
  ``tf.function(jit_compile=True)`` (:func:`experiments.transformer.model.forward_step`);
* ``train``: a user-written ``tf.function(jit_compile=True)`` with a ``GradientTape`` inside, the
  tutorial's masked loss and an Adam update (:func:`experiments.transformer.model.train_step`;
  ``training=True``).

``--pipeline tfdata`` trains instead as the tutorial does (mode ``fit`` in place of ``train``): the
model compiled with its masked loss and accuracy and warm-up Adam, ``fit(jit_compile=True)`` on padded
``tf.data`` batches whose batch size and lengths Keras traces as ``None`` (:mod:`.fitting`); tf_memsafe
plans that trace at nominal sizes, its loops reading the run's sizes.  Results go to
``transformer_sweep[_keras3]_tfdata[_quick].*``.

Dropout is off in every preset (rate 0: Keras' ``Dropout`` is then an identity).  ``--dropout RATE``
turns the tutorial's dropout on (attention probabilities, feed-forward outputs, embeddings) and
enables tf_memsafe with ``redraw_random=True``: the splitter moves the attention's dropout draw into
its loops, each slice drawing its own mask (without that option a region with a random draw is not
split through it).  Training steps then draw other masks than the naive step, so their first losses
are not compared (``err_vs_naive`` empty); the forward (``training=False``) draws none.  The JSON's
``dropout`` says which ran.

``--keras 3`` builds the same model from Keras 3's classes (what ``tf.keras`` is on TF 2.21) instead of
tf_keras's, and writes ``transformer_sweep_keras3[_quick].*``.  Keras 3's ``MultiHeadAttention`` with
dropout computes explicit scores under a causal mask built from running sums of ones, which XLA folds
at compile time for minutes at L = 2048 as written; tf_memsafe's ``constant_cumsum`` pass removes that
(``experiments/compile_time.py`` measures it).

Per case: XLA's footprint ("Total bytes used" of the compiled program, compiled from the very trace
that is timed; naive: traced with tf_memsafe disabled; tf_memsafe: traced with it enabled at
``--limit``), tf_memsafe's status and splitter records for the trace, whether it ran, and the median
seconds per step over ``--repeats`` calls after a first (compiling) call.  A program is run only if its
footprint is within the limit (the limit stands for the device's memory: a program over it is
"out of memory", not run) and L <= ``--max-run-length`` (a cap on this machine's patience; such
rows say so and count as within the limit by their footprint).  Where both variants ran, the
tf_memsafe result is compared with the naive one (forward: largest absolute difference of the logits
over their largest magnitude; train: the same for the first step's loss, from the same weights and
optimizer state).

Presets (``--preset``; any flag overrides):

* ``cpu`` (default, this 2-core machine): the tutorial's model (4 layers, d_model 128, dff 512,
  8 heads, its tokenizers' vocabularies), batch 1, L = 256 ... 16384, limit 2 GB, run up to L = 2048
  (longer programs are compiled and measured only: a step at L = 4096 takes minutes on 2 cores);
* ``gpu``: the paper's preset (d_model 512, 8 heads; 6 layers, dff 2048), batch 64, L = 256 ... 8192,
  limit 32 GB (the eXLA paper's GPU);
* ``--quick``: a one-layer model (d_model 32, dff 64, 2 heads, vocabularies of 100), batch 1,
  L = 256, 512, 1024, limit 8 MB: the same sweep in well under a minute.

Results: ``transformer_sweep[_quick].{csv,json,png}`` in ``--out`` (footprint vs L with the limit;
seconds per step vs L), a printed table, and the longest L within the limit for each mode and
variant.  Timings are of this machine and asserted nowhere.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments._results import OUT_HELP, results_dir
from experiments.transformer import data as tdata
from experiments.transformer import fitting
from experiments.transformer import model as tmodel
from grappler_ext.splitter import CANNOT_SPLIT
from tf_memsafe import hook, xla_flags

MODES = ("forward", "train")
VARIANTS = ("naive", "tf_memsafe")


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    config: tmodel.TransformerConfig
    batch: int
    lengths: tuple[int, ...]
    limit: str
    repeats: int
    max_run_length: int | None      # longer programs are compiled and measured, not run


PRESETS = {
    "cpu": Preset("cpu", dataclasses.replace(tmodel.PRESETS["tutorial"], dropout_rate=0.0), batch=1,
                  lengths=(256, 512, 1024, 2048, 4096, 8192, 16384), limit="2GB", repeats=3, max_run_length=2048),
    "gpu": Preset("gpu", dataclasses.replace(tmodel.PRESETS["paper"], dropout_rate=0.0), batch=64,
                  lengths=(256, 512, 1024, 2048, 4096, 8192), limit="32GB", repeats=5, max_run_length=None),
    "quick": Preset("quick", tmodel.TransformerConfig(num_layers=1, d_model=32, dff=64, num_heads=2, dropout_rate=0.0,
                                                      input_vocab_size=100, target_vocab_size=100),
                    batch=1, lengths=(256, 512, 1024), limit="8MB", repeats=1, max_run_length=None),
}


@dataclasses.dataclass
class Row:
    preset: str
    mode: str                       # "forward", "train" or "fit" (--pipeline tfdata)
    variant: str                    # "naive" or "tf_memsafe"
    length: int                     # L: context and target tokens per example
    batch: int
    limit_bytes: int
    footprint_bytes: int | None     # XLA's "Total bytes used" of the compiled program
    within_limit: bool
    status: str                     # tf_memsafe's report on the trace ("disabled" for naive)
    splits: int                     # splitter rewrites in that trace
    split: str                      # the first splitter record's reason ("" if none)
    ran: bool
    seconds: float | None           # median seconds per step (first, compiling call excluded)
    first_call_s: float | None      # the first call: compile and one step
    trace_s: float                  # tracing (tf_memsafe's passes included)
    err_vs_naive: float | None      # see the module docstring
    note: str
    fit_footprint_bytes: int | None = None      # mode fit: XLA's largest figure among the programs fit compiled


# ---------------------------------------------------------------- measuring


def _footprint(fn, args) -> int:
    """XLA's figure for the trace ``fn`` already has for ``args`` (compiled, not run)."""
    with xla_flags.dump_for_one_compile() as folder:
        fn.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
        reports = xla_flags.memory_reports(folder)
    if not reports:
        raise tf_memsafe.MeasurementError("XLA wrote no memory-usage report (was tf_memsafe imported first?)")
    return sum(total for _, total in reports)


def _numpy(x):
    return tf.nest.map_structure(lambda t: t.numpy(), x)


def _rel_error(got, ref) -> float | None:
    if got is None or ref is None:
        return None
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = float(np.max(np.abs(ref))) or 1.0
    return float(np.max(np.abs(got - ref))) / scale


class Case:
    """One model, optimizer and batch at one length; builds and measures both variants of a mode."""

    def __init__(self, model, optimizer, batch_data, limit: int, redraw_random: bool = False,
                 run_over_limit: bool = False):
        self.model, self.optimizer, self.limit, self.redraw_random = model, optimizer, limit, redraw_random
        self.run_over_limit = run_over_limit    # the naive program run over the limit too (its first call)
        (context, target_in), labels = batch_data
        self.args = {"forward": (context, target_in), "train": (context, target_in, labels)}
        # Weights and optimizer state before any step: each variant's first step starts from them.
        self.variables = list(model.variables) + list(optimizer.variables)
        self.snapshot = [v.numpy() for v in self.variables]

    def restore(self):
        for v, value in zip(self.variables, self.snapshot):
            v.assign(value)

    def function(self, mode: str):
        if mode == "forward":
            return tmodel.forward_step(self.model)
        return tmodel.train_step(self.model, self.optimizer)

    def measure(self, mode: str, variant: str, repeats: int, may_run: bool, note: str = ""):
        """Trace, measure the footprint, and run if allowed: (fields of a Row, the first result)."""
        fn, args, notes = self.function(mode), self.args[mode], [note] if note else []
        mark = hook.report_mark()
        with warnings.catch_warnings(record=True) as caught:  # the splitter warns when it cannot fit the limit
            warnings.simplefilter("always")
            start = time.perf_counter()
            if variant == "naive":
                tf_memsafe.disable()
                fn.get_concrete_function(*args)
            else:
                tf_memsafe.enable(self.limit, redraw_random=self.redraw_random)
                fn.get_concrete_function(*args)
            trace_s = time.perf_counter() - start
        tf_memsafe.disable()
        reports = [r for r in hook.reports_since(mark) if r.function_name in ("forward", "step")]
        records = [rec for r in hook.reports_since(mark) for rec in r.records]
        splits = [r for r in records if r.pass_name == "splitter" and r.action == "rewritten"]
        status = "disabled" if variant == "naive" else (reports[-1].status if reports else "not seen by tf_memsafe")
        if reports and reports[-1].status in ("failed", "skipped"):
            notes.append(f"tf_memsafe {reports[-1].status}: {reports[-1].reason.splitlines()[0][:300]}")
        notes += list(dict.fromkeys(str(c.message).splitlines()[0][:300] for c in caught
                                    if issubclass(c.category, RuntimeWarning) and "tf_memsafe" in str(c.message)))
        footprint = _footprint(fn, args)
        within = footprint <= self.limit
        if variant == "tf_memsafe" and not within and not caught:
            # Over the limit without a warning: the splitter's first skip says why (left alone, dynamic shapes...).
            skips = [r for r in records if r.pass_name == "splitter" and r.action == "skipped"]
            stuck = sorted((r for r in skips if r.code in CANNOT_SPLIT),
                           key=lambda r: -(r.bytes_before or 0))
            if stuck or skips:
                notes.append(f"splitter: {(stuck or skips)[0].reason.splitlines()[0][:300]}")
        ran, seconds, first_s, result = False, None, None, None
        if not within and not (self.run_over_limit and variant == "naive"):
            notes.append("not run: over the limit")
        elif not may_run:
            notes.append("not run: longer than --max-run-length")
        else:
            self.restore()
            try:
                start = time.perf_counter()
                result = _numpy(fn(*args))
                first_s = time.perf_counter() - start
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    _numpy(fn(*args))
                    times.append(time.perf_counter() - start)
                seconds, ran = statistics.median(times) if times else first_s, True
            except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as e:
                notes.append(f"failed to run: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        fields = dict(footprint_bytes=footprint, within_limit=within, status=status, splits=len(splits),
                      split=splits[0].reason if splits else "", ran=ran, seconds=seconds, first_call_s=first_s,
                      trace_s=trace_s, note="; ".join(notes))
        return fields, result


# ---------------------------------------------------------------- output


def longest(rows: list[Row]) -> dict:
    """For each mode and variant: the longest L within the limit (by footprint) and the longest that ran."""
    out = {}
    for mode in dict.fromkeys(r.mode for r in rows):
        for variant in VARIANTS:
            sel = [r for r in rows if r.mode == mode and r.variant == variant]
            fits = [r.length for r in sel if r.within_limit]
            ran = [r.length for r in sel if r.ran]
            out[f"{mode}/{variant}"] = {"within_limit": max(fits, default=None), "ran": max(ran, default=None)}
        naive, tfms = out[f"{mode}/naive"]["within_limit"], out[f"{mode}/tf_memsafe"]["within_limit"]
        out[f"{mode}/ratio"] = tfms / naive if naive and tfms else None
    return out


def plot(rows: list[Row], limit: int, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {"forward": "tab:blue", "train": "tab:orange", "fit": "tab:green"}
    for mode in dict.fromkeys(r.mode for r in rows):
        for variant, style in zip(VARIANTS, ("--", "-")):
            sel = sorted((r for r in rows if r.mode == mode and r.variant == variant), key=lambda r: r.length)
            pts = [(r.length, r.footprint_bytes / 2**20) for r in sel if r.footprint_bytes]
            if pts:
                axes[0].plot(*zip(*pts), style, marker="o", color=colors.get(mode), label=f"{mode}, {variant}")
            ran = [(r.length, r.seconds) for r in sel if r.ran and r.seconds]
            if ran:
                axes[1].plot(*zip(*ran), style, marker="o", color=colors.get(mode), label=f"{mode}, {variant}")
    axes[0].axhline(limit / 2**20, color="tab:red", lw=1, label=f"limit {tf_memsafe.format_bytes(limit)}")
    axes[0].set_ylabel("XLA footprint (MiB)")
    axes[0].set_title("footprint vs sequence length")
    axes[1].set_ylabel("seconds per step (median)")
    axes[1].set_title("time vs sequence length (cases that ran)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[Row]) -> str:
    fmt = tf_memsafe.format_bytes
    by = {(r.mode, r.length, r.variant): r for r in rows}

    def sec(r):
        return f"{r.seconds:.3f}" if r is not None and r.seconds is not None else "-"

    def fp(r):
        if r is None or r.footprint_bytes is None:
            return "-"
        return fmt(r.footprint_bytes) + ("" if r.within_limit else " OVER")

    head = (f"{'mode':7} {'L':>6} {'naive':>15} {'tf_memsafe':>15} {'splits':>6} {'naive s':>9} {'tfms s':>9} "
            f"{'tfms/naive':>10} {'err':>8}  status")
    lines = [head, "-" * len(head)]
    for mode, length in dict.fromkeys((r.mode, r.length) for r in rows):
        n, m = by.get((mode, length, "naive")), by.get((mode, length, "tf_memsafe"))
        ratio = f"{m.seconds / n.seconds:.2f}" if n and m and n.seconds and m.seconds else "-"
        err = f"{m.err_vs_naive:.1e}" if m and m.err_vs_naive is not None else "-"
        lines.append(f"{mode:7} {length:>6} {fp(n):>15} {fp(m):>15} {m.splits if m else '-':>6} {sec(n):>9} "
                     f"{sec(m):>9} {ratio:>10} {err:>8}  {m.status if m else '-'}")
        if m and m.note:
            lines.append(f"{'':15}tf_memsafe: {m.note}")
    return "\n".join(lines)


def summary(rows: list[Row], limit: int) -> str:
    lines = [f"longest L within the limit of {tf_memsafe.format_bytes(limit)} (by XLA's footprint; longest run):"]
    found = longest(rows)
    for mode in dict.fromkeys(r.mode for r in rows):
        n, m = found[f"{mode}/naive"], found[f"{mode}/tf_memsafe"]
        ratio = found[f"{mode}/ratio"]
        lines.append(f"  {mode:7} naive {n['within_limit'] or '-'} (ran {n['ran'] or '-'}), tf_memsafe "
                     f"{m['within_limit'] or '-'} (ran {m['ran'] or '-'})"
                     + (f": {ratio:.1f}x" if ratio else ""))
    return "\n".join(lines)


def _source_state() -> str:
    """The commit and whether tf_memsafe's sources differ from it (the sweep measures the working tree)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "tf_memsafe", "grappler_ext"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.rstrip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes in " + ", ".join(sorted({ln[3:] for ln in dirty.splitlines()}))
                   if dirty else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="a one-layer model at 3 short lengths, for a smoke run")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default: the preset's)")
    parser.add_argument("--limit", help="memory limit (default: the preset's; '2GB' on the CPU)")
    parser.add_argument("--batch", type=int, help="examples per batch (default: the preset's)")
    parser.add_argument("--num-layers", type=int, help="encoder and decoder layers (default: the preset's)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--train-lengths", type=int, nargs="+",
                        help="lengths of the training-step cases (default: --lengths; a training step is traced "
                             "and split for minutes at the longest)")
    parser.add_argument("--repeats", type=int, help="timed calls after the first (default: the preset's)")
    parser.add_argument("--run-over-limit", action="store_true",
                        help="run the naive program over the limit too, where this machine's memory holds it: its "
                             "first call and steps, to compare with tf_memsafe's")
    parser.add_argument("--max-run-length", type=int, help="compile and measure longer programs, do not run them "
                        "(default: the preset's; 0: no cap)")
    parser.add_argument("--data", choices=("random", "ted_hrlr"), default="random",
                        help="random tokens, or ted_hrlr_translate/pt_to_en if already prepared (never downloaded)")
    parser.add_argument("--data-dir", help="TFDS data directory (default: TFDS's)")
    parser.add_argument("--dropout", type=float, help="the tutorial's dropout rate (default 0: off); on, tf_memsafe "
                        "runs with redraw_random=True")
    parser.add_argument("--keras", type=int, choices=sorted(tmodel.KERAS_VERSIONS), default=2,
                        help="the Keras the model is written in: 2 (tf_keras, the tutorial's; default) or 3 (keras, "
                             "what tf.keras is on TF 2.21); results of 3 go to transformer_sweep_keras3.*")
    parser.add_argument("--pipeline", choices=("step", "tfdata"), default="step",
                        help="how training steps run: 'step' (a user-written jit step on one batch; default) or "
                             "'tfdata' (the tutorial's compile and fit(jit_compile=True) on padded tf.data batches "
                             "of unknown batch size and lengths: mode 'fit' instead of 'train'); results of "
                             "'tfdata' go to transformer_sweep[_keras3]_tfdata.*")
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)

    source = _source_state()  # now: the sources this process imports
    preset = PRESETS["quick" if args.quick else args.preset]
    lengths = tuple(args.lengths or preset.lengths)
    limit = tf_memsafe.parse_memory_limit(args.limit or preset.limit).resolve(0)
    batch = args.batch or preset.batch
    repeats = preset.repeats if args.repeats is None else args.repeats
    cap = preset.max_run_length if args.max_run_length is None else (args.max_run_length or None)
    config = dataclasses.replace(preset.config, max_length=max(max(lengths), preset.config.max_length))
    if args.num_layers:
        config = dataclasses.replace(config, num_layers=args.num_layers)
    dropout = args.dropout or 0.0
    config = dataclasses.replace(config, dropout_rate=dropout)
    dropout_note = (f"rate {dropout:g}; tf_memsafe with redraw_random=True (each slice of a split attention draws "
                    "its own mask; training losses not compared)" if dropout else "off (rate 0)")
    data_note = "random tokens"
    if args.data == "ted_hrlr" and tdata.tfds_available(args.data_dir):
        config = dataclasses.replace(config, input_vocab_size=tdata.BYTE_VOCAB, target_vocab_size=tdata.BYTE_VOCAB)

    from tqdm import tqdm

    tf.get_logger().setLevel("ERROR")  # a fresh trace per case is the point, not a mistake
    tmodel.keras_module(args.keras).utils.set_random_seed(0)
    model = tmodel.build_transformer(config, keras_version=args.keras)
    optimizer = tmodel.tutorial_optimizer(config.d_model, keras_version=args.keras)
    optimizer.build(model.trainable_variables)
    rows: list[Row] = []
    # (one model compiled the tutorial's way, its step traced once per variant for every length)
    fit_case = (fitting.FitCase(config, args.keras, batch, limit, repeats, bool(dropout))
                if args.pipeline == "tfdata" and "train" in args.modes else None)
    train_lengths = set(args.train_lengths or lengths)
    cases = [(length, mode) for length in lengths for mode in args.modes if mode != "train" or length in train_lengths]
    with tqdm(total=len(cases) * len(VARIANTS), desc="transformer sweep") as bar:
        for length in lengths:
            batch_data, data_note = tdata.batches(args.data, batch, length, config.input_vocab_size,
                                                  config.target_vocab_size, data_dir=args.data_dir)
            case = Case(model, optimizer, batch_data, limit, redraw_random=bool(dropout),
                        run_over_limit=args.run_over_limit)
            for mode in [mode for at, mode in cases if at == length]:
                results = {}
                fitted = fit_case if mode == "train" else None
                for variant in VARIANTS:
                    bar.set_postfix_str(f"L={length} {mode} {variant}")
                    may_run = cap is None or length <= cap
                    if fitted is not None:
                        measured = fitted.measure(variant, length, may_run)
                        fields, results[variant] = measured.fields, measured.losses
                    else:
                        fields, results[variant] = case.measure(mode, variant, repeats, may_run)
                    drawn = dropout and mode == "train"        # other masks than the naive step's
                    err = (_rel_error(results[variant], results["naive"])
                           if variant == "tf_memsafe" and not drawn else None)
                    rows.append(Row(preset=preset.name, mode="fit" if fitted else mode, variant=variant,
                                    length=length, batch=batch,
                                    limit_bytes=limit, err_vs_naive=err, **fields))
                    bar.update()
            case.restore()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "transformer_sweep" + ("_keras3" if args.keras == 3 else "")
                        + ("_tfdata" if args.pipeline == "tfdata" else "") + ("_quick" if args.quick else ""))
    with open(stem + ".csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[fld.name for fld in dataclasses.fields(Row)])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in rows)
    meta = {"tensorflow": tf.__version__, "keras": tmodel.KERAS_VERSIONS[args.keras], "source": source,
            "preset": preset.name, "quick": args.quick,
            "model": dataclasses.asdict(config), "batch": batch, "lengths": list(lengths),
            "train_lengths": sorted(train_lengths & set(lengths)) if "train" in args.modes else [],
            "limit_bytes": limit,
            "repeats": repeats, "max_run_length": cap, "data": data_note, "dropout": dropout_note,
            "run_over_limit": args.run_over_limit, "pipeline": args.pipeline,
            "longest": longest(rows)}
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump({**meta, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    title = (f"Transformer ({config.num_layers} layers, d_model {config.d_model}, {config.num_heads} heads), "
             f"batch {batch}, {data_note}; XLA:CPU" if not tf.config.list_logical_devices("GPU") else "")
    plot(rows, limit, title, stem + ".png")
    print(f"{preset.name} preset ({tmodel.KERAS_VERSIONS[args.keras]}): {config.num_layers} layers, "
          f"d_model {config.d_model}, dff {config.dff}, "
          f"{config.num_heads} heads, batch {batch}, {data_note}, dropout {dropout_note}, "
          f"limit {tf_memsafe.format_bytes(limit)}"
          + (f", run up to L = {cap}" if cap else ""))
    print(table(rows))
    print(summary(rows, limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
