"""Every experiment in one command, then a one-page Markdown summary of their results.

    python -m experiments.report [--quick] [--out experiments/results] [--only NAME ...] [--skip NAME ...]
        [--summary-only]

Runs the experiments of :data:`EXPERIMENTS` in turn, in this process, each through its own
``main(["--out", OUT] + ["--quick"])`` (each stays runnable alone: ``python -m experiments.knn``,
...), then writes ``OUT/SUMMARY.md``: the machine, then per experiment what it measures, a table of
its key numbers read from its JSON file, and its plot, then the same for each further run of it kept
in a folder ``OUT/<stem>_<what>/`` (SGPR's training to convergence, a timing measured again alone).
The summary covers every experiment whose results are in OUT, not only those run now; one without
results gets "not run: <command>".  OUT is ``experiments/results`` by default, and with ``--quick``
``experiments/results/quick`` (ignored by git): a smoke run never overwrites the committed results.

An experiment that raises or returns non-zero is reported in the summary with the error's last
line (the traceback goes to stderr), the others still run, and the report exits with 1; so it
does when a JSON file cannot be summarised.  An experiment whose module does not exist yet
(``experiments.sgpr`` while it is being written) is recorded as missing, not as a failure.
``--summary-only`` runs nothing and rebuilds SUMMARY.md from the JSON files in OUT.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments import _methods as m
from experiments._results import QUICK_RESULTS, RESULTS, results_dir
from tf_memsafe import hook

# ---------------------------------------------------------------- Markdown


def md_table(head: list[str], body: list[list]) -> list[str]:
    """A Markdown table (and a blank line); columns of numbers (every cell a number or "-") right-aligned."""
    body = [[str(c).replace("|", "\\|") for c in row] for row in body]

    def numeric(column: list[str]) -> bool:
        starts = [c.lstrip("*")[:1] for c in column if c]
        return any(s.isdigit() for s in starts) and all(s.isdigit() or s == "-" for s in starts)

    rule = ["---:" if numeric([row[i] for row in body]) else "---" for i in range(len(head))]
    return ["| " + " | ".join(row) + " |" for row in (head, rule, *body)] + [""]


def first_clause(text: str, width: int = 80) -> str:
    """The first ``; ``-separated part of a note, cut to ``width`` characters."""
    part = text.split("; ")[0]
    return part if len(part) <= width else part[:width - 3] + "..."


def seconds(s: float | None) -> str:
    return f"{s:.3g} s" if s is not None else "not run"


def footprint(row) -> str:
    """A row's XLA footprint, marked when it is over the row's limit."""
    if row is None:
        return "-"
    return m.fmt_bytes(row.footprint_bytes) + (" (over)" if row.within_limit is False else "")


def mark(value: float | None, ok: bool | None, spec: str = ".2f") -> str:
    """``value`` formatted, in bold where it misses its target (``ok`` False)."""
    text = m.num(value, spec)
    return f"**{text}**" if ok is False else text


# ---------------------------------------------------------------- per-experiment summaries (JSON -> Markdown lines)


def throughput_lines(data: dict, module, key: str, rate: str, check: str, worst: Callable, check_spec: str,
                     setting: str) -> list[str]:
    """kNN and kernel matvec: per size, each method's rate and footprint, and tf_memsafe's speed ratios."""
    rows = [module.Row(**r) for r in data["rows"]]
    ratios, reach = module.summary(rows)   # _methods.speed_summary
    target = data.get("targets", {}).get("tf_memsafe_vs_hand_min", module.TARGET_SPEED)
    by = {(getattr(r, key), r.data, r.d, r.n, r.method): r for r in rows if r.method in m.METHODS}

    def rate_cell(r) -> str:
        if r is None:
            return "-"
        if getattr(r, rate) is not None:
            return m.num(getattr(r, rate), ",.0f")
        why = r.skipped.split(":")[0].split(" (")[0]
        return "-" if not why or why == "not selected" else f"- ({why})"

    body = []
    for s in ratios:
        size = (s[key], s["data"], s["d"], s["n"])
        found = {meth: by.get((*size, meth)) for meth in m.METHODS}
        if not any(found.values()):
            continue
        body.append([size[0], size[1], size[2], m.fmt_n(size[3]), *(rate_cell(found[meth]) for meth in m.METHODS),
                     *(footprint(found[meth]) for meth in m.TF_METHODS),
                     mark(s["tf_memsafe_vs_hand"], s["target_met"]), m.num(s["tf_memsafe_vs_keops"], ".2f")])
    compared = [s["target_met"] for s in ratios if s["target_met"] is not None]
    checks = [getattr(r, check) for r in rows if getattr(r, check) is not None]
    label = rate.replace("_per_s", "/s")
    lines = [f"{setting}; limit {m.fmt_bytes(data.get('limit_bytes'))}. {label} of each method (\"- (why)\": not "
             f"run), XLA footprints of the TF methods (\"over\": above the limit), tf_memsafe's {label} over the "
             f"hand-written loop's (target >= {target}, bold: missed) and over KeOps'.", "",
             *md_table([key, "data", "d", "n", *m.METHODS, *(f"{meth} bytes" for meth in m.TF_METHODS),
                        "tfms/hand", "tfms/keops"], body),
             f"tf_memsafe >= {target} x the hand-written loop at {sum(compared)} of {len(compared)} sizes where both "
             f"ran; {check} against NumPy, worst of {len(checks)} results checked: "
             f"{m.num(worst(checks) if checks else None, check_spec)}.", ""]
    reach_body = []
    for config in dict.fromkeys((x[key], x["data"], x["d"]) for x in reach):
        mine = {x["method"]: x for x in reach if (x[key], x["data"], x["d"]) == config}
        if not any(x["largest_n_run"] or x["largest_n_fits"] for x in mine.values()):
            continue
        cells = [m.fmt_n(mine[meth]["largest_n_run"]) if mine[meth]["largest_n_run"] else "-" for meth in m.METHODS]
        for i, meth in enumerate(m.METHODS):
            if meth in m.TF_METHODS:
                fits = mine[meth]["largest_n_fits"]
                cells[i] += " / " + (m.fmt_n(fits) if fits else "-")
        reach_body.append([*config, *cells])
    lines += ["Largest n run within the limit / largest n whose XLA footprint fits it (compiled only):", "",
              *md_table([key, "data", "d", *m.METHODS], reach_body)]
    # Rows of no method: a whole data set left out (MNIST without its files), once per metric or kernel.
    notes = [f"- {note}" for note in dict.fromkeys(r.skipped for r in rows if r.method not in m.METHODS)]
    return lines + notes + ([""] if notes else [])


def knn_lines(data: dict) -> list[str]:
    from experiments import knn

    return throughput_lines(data, knn, "metric", "queries_per_s", "recall", min, ".3f",
                            f"{data.get('queries')} queries, k = {data.get('k')}")


def kernel_matvec_lines(data: dict) -> list[str]:
    from experiments import kernel_matvec

    return throughput_lines(data, kernel_matvec, "kernel", "rows_per_s", "rel_err", max, ".1e",
                            f"{data.get('result_rows')} rows, v with {data.get('columns')} column(s)")


def overhead_lines(data: dict) -> list[str]:
    from experiments import overhead

    rows = [overhead.Row(**r) for r in data["rows"]]   # results before training rows: mode "forward"
    targets = data.get("targets", {})
    most = {"forward": targets.get("ratio_vs_naive_max", overhead.TARGET_OVERHEAD),
            "training": targets.get("ratio_vs_naive_max_training", overhead.TARGET_OVERHEAD_TRAINING)}
    least = targets.get("speed_vs_hand_min", overhead.TARGET_SPEED)
    body, seen = [], set()
    for r in rows:
        first = (r.workload, r.mode) not in seen
        seen.add((r.workload, r.mode))
        body.append([r.workload if first else "", r.size if first else "", r.case, r.mode, m.fmt_bytes(r.naive_bytes),
                     m.fmt_bytes(r.rewritten_bytes), m.fmt_bytes(r.limit_bytes), "yes" if r.within_limit else "**NO**",
                     r.rewrites, mark(r.ratio_vs_naive, None if r.case != "fits" or r.ratio_vs_naive is None
                                      else r.ratio_vs_naive <= most.get(r.mode, most["forward"])),
                     mark(r.speed_vs_hand, None if r.speed_vs_hand is None else r.speed_vs_hand >= least),
                     first_calls(r.naive_first_s, r.rewritten_first_s), first_clause(r.note)])
    training = any(r.mode == "training" for r in rows)
    return [f"Medians of {data.get('repeats', '?')} interleaved runs. Targets: tf_memsafe / naive time <= "
            f"{most['forward']}" + (f" (a whole training step: <= {most['training']})" if training else "")
            + f" where the program fits (case `fits`: limit = 2 x its footprint); hand-written / tf_memsafe speed >= "
            f"{least} beyond the limit (bold: missed).", "",
            *md_table(["workload", "size", "case", "mode", "naive", "tf_memsafe", "limit", "within", "rewrites",
                       "time tfms/naive", "speed hand/tfms", "first call naive / tfms", "note"], body)]


def first_calls(naive: float | None, rewritten: float | None) -> str:
    """The first calls' seconds (trace, rewrite, compile, first run), "-" where not measured."""
    if naive is None and rewritten is None:
        return "-"
    return f"{seconds(naive)} / {seconds(rewritten)}"


def bench_rewrites_lines(data: dict) -> list[str]:
    from experiments import bench_rewrites

    rows = [bench_rewrites.Row(**r) for r in data["rows"]]
    body = []
    for workload in dict.fromkeys(r.workload for r in rows):
        by = {r.config: r for r in rows if r.workload == workload}
        off, on = by.get("off"), by.get("all")
        fired = [config.split(":", 1)[1] for config, r in by.items() if config.startswith("only:") and r.rewrites]
        shrink = f"{off.footprint_bytes / on.footprint_bytes:.3g}x" if off and on and on.footprint_bytes else "-"
        body.append([workload, next(iter(by.values())).note, m.fmt_bytes(off.footprint_bytes if off else None),
                     m.fmt_bytes(on.footprint_bytes if on else None), shrink,
                     f"{seconds(off.seconds if off else None)} -> {seconds(on.seconds if on else None)}",
                     ", ".join(fired) or "none"])
    raised = sorted({f"{r.workload} {r.config}" for r in rows if r.raised})
    return ["XLA footprint before (every pass off) and after (every pass on), each workload under a limit of half "
            "its own figure as written (rewrites made for memory change only programs over their limit), median "
            "time of a run (\"not run\": over the run limit), and the passes that rewrite the program when each "
            "runs alone. A rewrite that raised the figure: " + (", ".join(raised) if raised else "none") + ".", "",
            *md_table(["workload", "size", "before", "after", "before/after", "time before -> after",
                       "passes that fire"], body)]


def transformer_lines(data: dict) -> list[str]:
    from experiments.transformer import sweep

    rows = [sweep.Row(**r) for r in data["rows"]]
    model = data.get("model", {})
    cap = data.get("max_run_length")
    lines = [f"Preset `{data.get('preset')}`: {model.get('num_layers')} layer(s), d_model {model.get('d_model')}, "
             f"{model.get('num_heads')} heads, batch {data.get('batch')}, {data.get('data')}, dropout "
             f"{data.get('dropout')}; limit {m.fmt_bytes(data.get('limit_bytes'))}"
             + (f", run up to L = {cap}" if cap else "") + f"; sources {data.get('source', 'not recorded')}.", "",
             "Longest L within the limit by XLA's footprint (longest that ran):", ""]
    longest = sweep.longest(rows)
    body = []
    for mode in dict.fromkeys(r.mode for r in rows):
        cells = [f"{longest[f'{mode}/{v}']['within_limit'] or '-'} (ran {longest[f'{mode}/{v}']['ran'] or '-'})"
                 for v in sweep.VARIANTS]
        ratio = longest[f"{mode}/ratio"]
        body.append([mode, *cells, f"{ratio:.3g}x" if ratio else "-"])
    lines += md_table(["mode", *sweep.VARIANTS, "tf_memsafe / naive"], body)
    by = {(r.mode, r.length, r.variant): r for r in rows}
    body = []
    for mode, length in dict.fromkeys((r.mode, r.length) for r in rows):
        naive, tfms = by.get((mode, length, "naive")), by.get((mode, length, "tf_memsafe"))
        body.append([mode, length, footprint(naive), footprint(tfms), tfms.splits if tfms else "-",
                     seconds(naive.seconds) if naive else "-", seconds(tfms.seconds) if tfms else "-",
                     first_call(naive), first_call(tfms),
                     m.num(tfms.err_vs_naive if tfms else None, ".1e"), first_clause(tfms.note) if tfms else ""])
    lines += md_table(["mode", "L", "naive", "tf_memsafe", "splits", "naive s/step", "tf_memsafe s/step",
                       "naive first call", "tf_memsafe first call", "err vs naive", "tf_memsafe note"], body)
    lines += ["First call: the trace (tf_memsafe's passes and the programs they compile to measure included), "
              "XLA's compile and one step; \"not run\" where the program was not run.", ""]
    return lines


def first_call(row) -> str:
    """A sweep row's first call, trace + compile + one step, in seconds ("-" for no row)."""
    if row is None:
        return "-"
    return seconds(row.trace_s + row.first_call_s) if row.first_call_s is not None else "not run"


def sgpr_lines(data: dict) -> list[str]:
    from experiments import sgpr

    rows = [sgpr.Row(**r) for r in data["rows"]]
    body = []
    for r in rows:
        naive = m.fmt_bytes(r.naive_bytes) + (" (model)" if r.naive_source == "model" else "") + (
            " (over)" if r.naive_within_limit is False else "")
        body.append([r.kernel, m.fmt_n(r.n), r.m, naive, footprint_cell(r.tf_memsafe_bytes, r.tf_memsafe_within_limit),
                     footprint_cell(r.predict_bytes, r.predict_within_limit), m.num(r.naive_s, ".3g"),
                     m.num(r.tf_memsafe_s, ".3g"), m.num(r.grad_rel_err, ".1e"), training_cell(r),
                     m.num(r.elbo, ".6g"), m.num(r.rmse, ".4f"), m.num(r.nlpd, ".4f"),
                     r.same_params_check or r.check or "-"])
    return [f"Limit {m.fmt_bytes(data.get('limit_bytes'))}. XLA's footprint of the loss-and-gradient program as "
            "`gpflow.optimizers.Scipy` compiles it (tape inside), naive (compiled only where it does not fit) and "
            "under tf_memsafe; the larger of the `predict_y` / `predict_log_density` programs over the test set; "
            "seconds per loss and gradient; the gradient's error against naive; where trained, tf_memsafe's "
            "L-BFGS iterations (whether scipy's convergence tests stopped it, and the wall time) and the fit "
            "(standardised units); the check against the naive program.", "",
            *md_table(["kernel", "N", "M", "naive", "tf_memsafe", "predict", "naive s", "tf_memsafe s", "grad err",
                       "L-BFGS", "ELBO", "RMSE", "NLPD", "check"], body)]


def dynamic_lines(data: dict) -> list[str]:
    from experiments import dynamic

    rows = [dynamic.Row(**r) for r in data["rows"]]
    static = {(r.workload, r.n): r for r in rows if r.method == "static"}
    body = []
    for r in rows:
        base = static.get((r.workload, r.n))
        ratio = r.median_s / base.median_s if base is not None and r.method != "static" and base.median_s else None
        body.append([r.workload, f"{r.n:,}", r.method, footprint_cell(r.xla_bytes, r.within_limit),
                     seconds(r.first_call_s), f"{r.median_s * 1e3:.1f} ms", m.num(ratio, ".2f"),
                     m.num(r.max_rel_diff, ".1e")])
    return [f"Limit {m.fmt_bytes(data.get('limit_bytes'))}, {data.get('points'):,} points. `dynamic`: one trace "
            "with `input_signature=[TensorSpec([None, 3])]`, rewritten once and compiled by XLA per shape; "
            "`static`: a trace, a rewrite and a compile per shape. XLA's footprint at that n; the first call "
            "(dynamic: a compile only after its first n); the median call; its time over the static split's; the "
            "largest difference over the largest magnitude against the naive function, or the static split where "
            "naive is not run.", "",
            *md_table(["workload", "n", "method", "XLA", "first call", "median", "/ static", "rel. diff"], body)]


def padded_lines(data: dict) -> list[str]:
    from experiments import padded

    rows = [padded.Row(**r) for r in data["rows"]]
    naive = {(r.keras, r.length): r for r in rows if r.method == "naive"}
    body = []
    for r in rows:
        base = naive.get((r.keras, r.length))
        ratio = r.median_step_s / base.median_step_s if base is not None and base.median_step_s else None
        body.append([r.keras, f"{r.length:,}", r.method, footprint_cell(r.xla_bytes, r.within_limit),
                     m.num(r.loss_rel_diff, ".1e"), seconds(r.first_epoch_s), f"{r.median_step_s * 1e3:.1f} ms",
                     m.num(ratio, ".2f"), seconds(r.rewrite_s) if r.method != "naive" else "-"])
    return [f"Limit {m.fmt_bytes(data.get('limit_bytes'))}; `padded_batch({data.get('batch')})` of sequences up to L "
            "tokens (three shapes); an embedding, `MultiHeadAttention`, layer norm and a pooled classifier, Adam, "
            "`fit(jit_compile=True)`, two epochs. XLA's largest footprint among the step's programs; the losses' "
            "largest relative difference from the naive fit's; the first epoch (traces, rewrite, a compile per "
            "shape); the second epoch's median step and its time over naive's; tf_memsafe's rewriting time.", "",
            *md_table(["Keras", "L", "method", "XLA", "loss diff", "first epoch", "median step", "/ naive",
                       "rewrite"], body)]


def image_fit_lines(data: dict) -> list[str]:
    from experiments import image_fit

    rows = [image_fit.Row(**r) for r in data["rows"]]
    naive = {r.keras: r for r in rows if r.method == "naive"}
    body = []
    for r in rows:
        base = naive.get(r.keras)
        ratio = r.median_step_s / base.median_step_s if base is not None and base.median_step_s else None
        first = r.first_epoch_s / base.first_epoch_s if base is not None and base.first_epoch_s else None
        body.append([r.keras, r.method, footprint_cell(r.xla_bytes, r.within_limit), m.num(r.loss_rel_diff, ".1e"),
                     seconds(r.first_epoch_s), m.num(first, ".1f"), f"{r.median_step_s * 1e3:.1f} ms",
                     m.num(ratio, ".2f"), seconds(r.rewrite_s) if r.method != "naive" else "-",
                     str(r.chunk) if r.chunk else "-"])
    return [f"{data.get('examples')} images in `batch({data.get('batch')})` (the last shorter: the batch unknown in "
            f"the step); embedding width {data.get('width')}, {data.get('layers')} encoder blocks, dropout "
            f"{data.get('dropout')} (under tf_memsafe with `redraw_random=True`: the losses differ by the draws); "
            f"limit {data.get('fraction')} of the naive step's figure. XLA's largest footprint among the step's "
            "programs; the losses' largest relative difference from the naive fit's; the first epoch (trace, "
            "rewrite, a compile per batch size, the steps) and its time over naive's; the second epoch's median "
            "step and its time over naive's; tf_memsafe's rewriting time; the rows of the batch a loop step "
            "computes with their gradients.", "",
            *md_table(["Keras", "method", "XLA", "loss diff", "first epoch", "/ naive", "median step", "/ naive",
                       "rewrite", "chunk"], body)]


def gpr_lines(data: dict) -> list[str]:
    from experiments import gpr

    rows = [gpr.Row(**r) for r in data["rows"]]
    body = [[r.workload, f"{r.n:,}", f"{r.t:,}" if r.t else "-", r.kind, m.fmt_bytes(r.naive_bytes),
             m.fmt_bytes(r.limit_bytes), m.fmt_bytes(r.tfms_bytes), "yes" if r.within_limit else "**NO**",
             seconds(r.rewrite_s), r.status, m.num(r.max_rel_diff, ".1e"),
             f"{r.naive_s:.3g} s -> {r.tfms_s:.3g} s" if r.naive_s and r.tfms_s else "-"] for r in rows]
    return [f"Each program under its figure as written / {data.get('divisor')}: XLA's footprint (compiled; "
            "`footprint` rows are not run), the time to trace, rewrite and compile it, and (`check` rows, both run) "
            "the largest difference over the largest magnitude against the unsplit program and the fastest warm "
            "call of each, the two taking turns. `t`: test points (predict) or right-hand sides (solve).", "",
            *md_table(["workload", "N", "t", "kind", "naive", "limit", "tf_memsafe", "within", "rewrite",
                       "status", "rel. diff", "warm call"], body)]


def wide_layer_lines(data: dict) -> list[str]:
    from experiments import wide_layer

    rows = [wide_layer.Row(**r) for r in data["rows"]]
    body = [[r.keras, r.optimizer, f"{r.n:,} x {r.d_in:,} -> {r.d_out:,}", m.fmt_bytes(r.naive_bytes),
             m.fmt_bytes(r.limit_bytes), m.fmt_bytes(r.tfms_bytes), "yes" if r.within_limit else "**NO**",
             r.written_into or "-", f"{r.naive_step_s:.3g} s / {r.tfms_step_s:.3g} s",
             f"{r.naive_first_s:.3g} s / {r.tfms_first_s:.3g} s", m.num(r.max_rel_diff, ".1e")] for r in rows]
    return ["XLA's footprint as written and under the limit (compiled), the variables the loop writes in place, "
            f"the median of {data.get('repeats')} interleaved steps and the first call (trace, rewrite, compile, "
            "one step), as written / rewritten, and the largest difference over the largest magnitude of the "
            "losses and variables after three steps.", "",
            *md_table(["Keras", "optimizer", "batch x in -> out", "naive", "limit", "tf_memsafe", "within",
                       "written in place", "step", "first call", "rel. diff"], body)]


def encoder_layer_lines(data: dict) -> list[str]:
    from experiments import encoder_layer

    rows = [encoder_layer.Row(**r) for r in data["rows"]]
    body = [[r.keras, r.program, str(r.depth), f"{r.length:,}", m.fmt_bytes(r.naive_bytes), m.fmt_bytes(r.limit_bytes),
             m.fmt_bytes(r.tfms_bytes), f"{r.ratio:g}x", "yes" if r.within_limit else "**NO**", str(r.loops),
             f"{r.naive_first_s:.3g} s / {r.tfms_first_s:.3g} s", m.num(r.max_rel_diff, ".1e"),
             "yes" if r.warned else "-"] for r in rows]
    return [f"Batch {data.get('batch')}, d_model {data.get('d_model')}, {data.get('heads')} heads, float32; each "
            f"program under its naive figure / {data.get('ratio')}. XLA's footprint as written and rewritten "
            "(compiled), the loops made, the first call (trace, rewrite, compile, one run; for `fit`, its first "
            "epoch) as written / rewritten, the largest difference over the largest magnitude against as written, "
            "and whether tf_memsafe warned.", "",
            *md_table(["Keras", "program", "layers", "L", "naive", "limit", "tf_memsafe", "naive / ours", "within",
                       "loops", "first call", "rel. diff", "warned"], body)]


def distributed_lines(data: dict) -> list[str]:
    from experiments import distributed

    rows = [distributed.Row(**r) for r in data["relayout"]]
    worst = max(rows, key=lambda r: r.peak_over_bound, default=None)
    body = [[r.shape, r.source, r.target, r.collectives, m.fmt_bytes(r.bound_bytes),
             m.num(r.peak_over_bound, ".2f"), m.num(r.allocator_over_bound, ".2f"),
             m.num(r.dtensor_allocator_over_bound, ".2f"), f"{r.time_s * 1e3:.3g} ms / {r.dtensor_time_s * 1e3:.3g} ms",
             m.num(r.time_ratio, ".2f"), "yes" if r.equal else "**NO**"] for r in rows]
    theirs = [r.dtensor_allocator_over_bound for r in rows if r.dtensor_allocator_over_bound is not None]
    allocator = (f"DTensor's allocator figure up to {max(theirs):.1f}x" if theirs else
                 "no allocator figures (this TensorFlow build's CPU allocator keeps no statistics)")
    summary = (f"Worst tf_memsafe peak {worst.peak_over_bound:.2f}x the bound ({worst.source} -> {worst.target}); "
               f"{allocator}; time ratio median {statistics.median(r.time_ratio for r in rows):.2f}, "
               f"worst {max(r.time_ratio for r in rows):.2f}." if rows else "No rows.")
    cluster = data.get("multi_worker")
    if cluster:
        workers = cluster["workers"]
        diff = max(abs(a - b) / abs(b) for w in workers for a, b in zip(w["losses"], cluster["single"]["losses"]))
        within = all(max(w["programs"], default=0) <= cluster["limit_bytes"] for w in workers)
        tail = ["", f"The Transformer (1 layer, d_model 32) at L = {cluster['length']}, trained by two worker "
                f"processes under `MultiWorkerMirroredStrategy` (global batch 2, {cluster['steps']} SGD steps), "
                f"each under {m.fmt_bytes(cluster['limit_bytes'])}: one worker's step as written "
                f"{m.fmt_bytes(cluster['single']['per_worker_naive_bytes'])}, rewritten "
                f"{', '.join(m.fmt_bytes(max(w['programs'], default=0)) for w in workers)} "
                f"({'within' if within else '**over**'}); losses {[round(x, 5) for x in workers[0]['losses']]}, "
                f"largest relative difference to one process on the global batch {diff:.1e}; "
                f"{cluster['workers_seconds']:.0f} s for the workers."]
    else:
        tail = []
    return [f"Mesh {data.get('mesh')}, {data.get('how', '')}; median of {data.get('repeats')} warm calls. "
            "Per-device peak over the bound (max of the source and target shards): tf_memsafe's exact per device "
            "(XLA's buffer assignment of each device's program), and the shared allocator's mean over the eight "
            "devices for both. " + summary, "",
            *md_table(["shape", "source", "target", "amounts to", "bound", "peak/bound", "allocator/bound",
                       "DTensor allocator/bound", "time (ours / DTensor)", "ratio", "equal"], body), *tail]


def compile_time_lines(data: dict) -> list[str]:
    from experiments import compile_time

    rows = [compile_time.Row(**r) for r in data["rows"]]
    naive = {(r.layer, r.length): r for r in rows if r.method == "naive"}
    body = []
    for r in rows:
        base = naive.get((r.layer, r.length))
        ratio = (r.first_call_s / base.first_call_s if r.method != "naive" and base is not None
                 and r.first_call_s is not None and base.first_call_s else None)
        first = seconds(r.first_call_s) if r.first_call_s is not None else f"> {data.get('timeout_s', 0):.0f} s"
        body.append([r.layer, f"{r.length:,}", r.method, first, m.num(ratio, ".3f"),
                     "-" if r.second_call_s is None else f"{r.second_call_s * 1e3:.1f} ms", r.rewrites or "-",
                     m.num(r.max_rel_diff, ".1e")])
    return [f"Batch {data.get('batch')}, {data.get('features')} features, {data.get('heads')} heads of "
            f"{data.get('key_dim')}, float32, `training=False`. The first call (trace, rewrite, XLA compile, one run), "
            "each in a fresh process; its time over the naive first call; the second call; the passes that "
            "rewrote; the largest difference over the largest magnitude against the naive output.", "",
            *md_table(["layer", "L", "method", "first call", "/ naive", "second call", "rewrites", "rel. diff"],
                      body)]


def random_key_lines(data: dict) -> list[str]:
    from experiments import random_key

    rows = [random_key.Row(**r) for r in data["rows"]]
    naive = {r.case: r for r in rows if r.variant == "naive"}
    body = []
    for r in rows:
        base = naive.get(r.case)
        ratio = r.median_s / base.median_s if r.variant != "naive" and base is not None and base.median_s else None
        body.append([r.case, r.shape, r.variant, seconds(r.first_call_s), f"{r.median_s * 1e3:.1f} ms",
                     m.num(ratio, ".3f"), r.rewrites or "-", m.num(r.max_rel_diff, ".1e")])
    return [f"Float32, limit {data.get('limit')} (every program fits). The first call (trace, rewrite, compile, one "
            f"call; `keras3_fit`: the first batch), the median of {data.get('repeats')} calls after it (batches), its "
            "time over the naive one, the passes that rewrote, and the largest difference against the naive "
            "values (0: bit for bit).", "",
            *md_table(["case", "shape", "variant", "first call", "median", "/ naive", "rewrites", "rel. diff"], body)]


def conv_loops_lines(data: dict) -> list[str]:
    from experiments import conv_loops

    rows = [conv_loops.Row(**r) for r in data["rows"]]
    body = [[r.keras, r.model, r.variant, m.fmt_bytes(r.limit_bytes) if r.limit_bytes else "-",
             m.fmt_bytes(r.xla_bytes) + (" (over)" if r.limit_bytes and r.xla_bytes > r.limit_bytes else ""),
             seconds(r.first_epoch_s), f"{r.median_step_s * 1e3:.0f} ms",
             m.num(r.step_over_naive, ".2f"), m.num(r.max_rel_diff, ".1e"), r.chunks or "-"] for r in rows]
    return [f"Batches of {data.get('batch')}, {data.get('batches')} an epoch, two epochs; the limit is the naive "
            f"step's figure / {data.get('ratio')}. XLA's largest figure among the programs `fit` compiled, the first "
            "epoch (traces, rewrite, compiles), the second epoch's median batch and its time over naive's, the losses' "
            "largest relative difference from naive's. `tf_naive_grads`: tf_memsafe with TensorFlow's gradients of "
            "the convolutions in the loops (as before `grappler_ext.loop_convolutions`); `tf_ungrown`: tf_memsafe "
            "with a loop that computes its gradients as it goes kept at the memory model's chunk (before such loops "
            "were grown into the room XLA's figure leaves). Chunks: the loops' (the nominal plan's, for `fit`'s "
            "run-time batch).", "",
            *md_table(["Keras", "model", "variant", "limit", "XLA", "first epoch", "step", "/ naive", "rel. diff",
                       "chunks"], body)]


def training_cell(row) -> str:
    """An SGPR row's training: iterations, "converged" when scipy's tests stopped L-BFGS, and the wall time."""
    if row.nit is None:
        return "-"
    took = "" if row.train_s is None else (f", {row.train_s:.0f} s" if row.train_s < 120 else
                                           f", {row.train_s / 60:.0f} min")
    return f"{row.nit} its{', converged' if row.converged else ''}{took}"


def footprint_cell(value: int | None, within: bool | None) -> str:
    return m.fmt_bytes(value) + (" (over)" if within is False else "")


# ---------------------------------------------------------------- the experiments


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str                                # for --only and --skip
    title: str                               # the section's heading
    module: str                              # has main(argv) -> int taking --quick and --out
    stem: str                                # its results: OUT/<stem>.json and OUT/<stem>.png
    what: str                                # what it measures, one or two sentences
    summarise: Callable[[dict], list[str]]   # its JSON (meta and rows) -> Markdown lines
    quick_stem: str = ""                     # where --quick writes instead, if elsewhere


EXPERIMENTS = (
    Experiment("knn", "kNN", "experiments.knn", "knn",
               "Brute-force k-nearest neighbours written the naive way (the full [queries, n] distance matrix, then "
               "`top_k`) for L2, L1 and cosine distances: XLA as written (`naive`), the same code under tf_memsafe's "
               "limit, a hand-written chunked `tf.while_loop`, KeOps, and NumPy (the exact reference for recall).",
               knn_lines),
    Experiment("kernel_matvec", "Kernel matvec", "experiments.kernel_matvec", "kernel_matvec",
               "Kernel matrix-vector products K(x, y) v (Gaussian, Matern-3/2) written the naive way (the full "
               "[rows, n] kernel matrix, then a matmul) by the same five methods as kNN; NumPy in float64 is the "
               "reference for the relative error.", kernel_matvec_lines),
    Experiment("overhead", "Overhead", "experiments.overhead", "overhead",
               "The splitter's cost, for forward functions and whole training steps (tape inside, Adam update): "
               "where the naive program fits, tf_memsafe must leave it alone at no cost in time; at 1/10 and 1/100 "
               "of its footprint, tf_memsafe's loop is timed against a hand-written `tf.while_loop` over the same "
               "chunks (for a training step: gradient accumulation over them).", overhead_lines),
    Experiment("bench_rewrites", "Rewrites benchmark", "experiments.bench_rewrites", "bench_rewrites",
               "Each match-and-replace pass alone, all of them, and none: XLA's footprint and the run time of a "
               "naive kNN (d = 3 and 64) and of GPflow's SGPR loss, with its own kernel and with a naively written "
               "one.", bench_rewrites_lines),
    Experiment("sgpr", "SGPR", "experiments.sgpr", "sgpr",
               "GPflow's SGPR, unchanged, without and with tf_memsafe: XLA's footprint and the time per number of "
               "data N and inducing points M, and the quality of the fit (ELBO, RMSE, NLPD).", sgpr_lines),
    Experiment("dynamic", "Run-time shapes", "experiments.dynamic", "dynamic",
               "A function whose first dimension is known only at run time (`input_signature` with `None`), split "
               "along it with one rewrite, against a trace per static shape: footprints within the limit, time, "
               "first calls.", dynamic_lines),
    Experiment("padded", "Padded batches", "experiments.padded", "padded",
               "Keras `fit` on `tf.data` padded batches, whose batch and length are both known only at run time: an "
               "attention classifier as written and under a limit (both Keras versions), footprints, losses, time.",
               padded_lines),
    Experiment("image_fit", "Vision Transformer fit", "experiments.image_fit", "image_fit",
               "keras.io's Vision Transformer written small, trained with `fit` on `tf.data` batches whose last is "
               "short (the batch unknown in the step), as written and under a third of its footprint (both Keras "
               "versions): footprints, losses, first epoch and steady steps, the loop's chunk.", image_fit_lines),
    Experiment("gpr", "GPflow GPR", "experiments.gpr", "gpr",
               "GPflow's GPR, unchanged, under limits 8x below its naive figure: predictions over many test points "
               "and triangular solves with many right-hand sides (split along them, the Cholesky factor read "
               "whole), and the training loss with its gradients (the factor held as packed blocks, the kernel "
               "matrix never whole: packed_cholesky).",
               gpr_lines),
    Experiment("wide_layer", "Wide layer", "experiments.wide_layer", "wide_layer",
               "A Dense(16384) on 2048 inputs trained with SGD and Adam (Keras 3 and tf_keras) under 700 MB, where "
               "the kernel, its gradient and the optimizer's slots crowd the limit: split along the kernel's "
               "columns, each column block's forward, gradient and update in one loop step, written in place.",
               wide_layer_lines),
    Experiment("encoder_layer", "Encoder layers at batch 4", "experiments.encoder_layer", "encoder_layer",
               "A Transformer encoder layer written the ordinary Keras way (MultiHeadAttention, a Dense feed-forward "
               "pair, two LayerNormalizations), one and two stacked, at batch 4 in Keras 3 and tf_keras: its forward, "
               "a training step with the tape inside, and `fit` on `.batch(4)` (the batch unknown in the step), each "
               "under a sixteenth of its own naive figure.", encoder_layer_lines),
    Experiment("compile_time", "Compile time of causal masks", "experiments.compile_time", "compile_time",
               "First calls of Keras attention layers whose causal masks are running sums of ones (Keras 3's "
               "`MultiHeadAttention` with dropout, tf_keras' `Attention`): XLA folds those scans at compile time; "
               "tf_memsafe's `constant_cumsum` makes them broadcast indices.", compile_time_lines),
    Experiment("random_key", "Stateless random draws", "experiments.random_key", "random_key",
               "Stateless random draws under XLA with their default `auto_select` algorithm (and Keras 3's `Dropout`, "
               "which draws that way): XLA derives the key inside every drawn element; tf_memsafe's `random_key` "
               "makes it once, bit for bit the same.", random_key_lines),
    Experiment("conv_loops", "Convolutions in loops", "experiments.conv_loops", "conv_loops",
               "Keras convolutional models (the image-classification tutorial's CNN, a convolutional autoencoder "
               "with `Conv2DTranspose`) trained with `fit` split along their batch under a quarter of their "
               "footprint: the convolutions' gradients in the loops built canonical, against TensorFlow's (XLA:CPU "
               "canonicalizes only top-level convolutions).", conv_loops_lines),
    Experiment("transformer", "Transformer", "experiments.transformer.sweep", "transformer_sweep",
               "The Transformer of TensorFlow's translation tutorial, unchanged, over sequence lengths L: XLA's "
               "footprint of its forward pass and of an Adam training step without and with tf_memsafe under a "
               "limit, the longest L within it, and the time per step where it ran.", transformer_lines,
               quick_stem="transformer_sweep_quick"),
    Experiment("distributed", "Relayout between DTensor layouts", "experiments.distributed", "distributed",
               "`tf_memsafe.relayout` against `dtensor.relayout` for every pair of layouts of a matrix and a vector "
               "on a 2 x 4 mesh of CPU devices: memory per device over Rink et al.'s bound (the larger of the "
               "source and target shards), time, values.", distributed_lines),
)


# ---------------------------------------------------------------- running


@dataclasses.dataclass
class Outcome:
    status: str                  # "ok", "failed" or "missing" (no such module)
    detail: str = ""             # the error's last line, or why missing
    started: float = 0.0         # time.time() at the start
    seconds: float | None = None


def missing_module(exp: Experiment, e: ModuleNotFoundError) -> bool:
    """Whether ``e`` says the experiment's own module (or its package) does not exist, not one it imports."""
    return e.name is not None and (exp.module == e.name or exp.module.startswith(e.name + "."))


def run(exp: Experiment, out: str, quick: bool) -> Outcome:
    """``exp``'s ``main`` with ``--out`` and ``--quick``; tf_memsafe is left disabled afterwards, whatever happened."""
    started = time.time()
    try:
        module = importlib.import_module(exp.module)
    except ModuleNotFoundError as e:
        if missing_module(exp, e):
            return Outcome("missing", f"module {exp.module} does not exist", started)
        return failed(exp, e, started)
    except Exception as e:  # noqa: BLE001 -- an experiment that cannot be imported is its failure, reported
        return failed(exp, e, started)
    try:
        code = module.main(["--out", out, *(["--quick"] if quick else [])])
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- one experiment's failure must not stop the others
        return failed(exp, e, started)
    finally:
        tf_memsafe.disable()   # overhead and bench_rewrites leave it enabled; each experiment starts afresh
        hook.clear_reports()
    if code:
        return Outcome("failed", f"{exp.module} failed: main returned {code}", started, time.time() - started)
    return Outcome("ok", "", started, time.time() - started)


def failed(exp: Experiment, e: BaseException, started: float) -> Outcome:
    from tqdm import tqdm

    tqdm.write("".join(traceback.format_exception(e)), file=sys.stderr)
    return Outcome("failed", m.failure(exp.module, e), started, time.time() - started)


# ---------------------------------------------------------------- the summary


def results_path(exp: Experiment, out: str, quick: bool) -> str | None:
    """``exp``'s JSON file in ``out`` (for the Transformer, the quick run's first with ``--quick``), or ``None``."""
    stems = [exp.stem, exp.quick_stem] if exp.quick_stem else [exp.stem]
    for stem in (reversed(stems) if quick else stems):
        path = os.path.join(out, stem + ".json")
        if os.path.exists(path):
            return path
    return None


def command(exp: Experiment, out: str, quick: bool) -> str:
    return " ".join(["python -m", exp.module, *(["--quick"] if quick else []),
                     *(["--out", out] if os.path.normpath(out) != results_dir(None, quick) else [])])


def machine_line() -> str:
    here = m.machine()
    gpus = [d.name for d in tf.config.list_physical_devices("GPU")]
    return (f"This report was written with TensorFlow {here['tensorflow']}, {here['cpus']} CPUs, "
            f"{', '.join(gpus) if gpus else 'no GPU'}, KeOps {here['keops']}; {platform.platform()}, "
            f"Python {platform.python_version()}.")


def recorded(data: dict | None) -> tuple[str, str]:
    """(the machine, the kind of run) as the JSON's meta records them."""
    if data is None:
        return "-", "-"
    shown = (("tensorflow", "TensorFlow {}"), ("cpus", "{} CPUs"), ("keops", "KeOps {}"), ("source", "sources {}"))
    machine = ", ".join(text.format(data[key]) for key, text in shown if key in data)
    kind = "not recorded" if "quick" not in data else ("quick" if data["quick"] else "full")
    return machine or "not recorded", kind


def section(exp: Experiment, path: str | None, data: dict | None, outcome: Outcome | None, out: str,
            quick: bool) -> tuple[list[str], list[str]]:
    """``exp``'s Markdown section, its further runs' after it, and the problems summarising them."""
    lines = [f"## {exp.title}", "", exp.what, ""]
    if outcome is not None and outcome.status == "failed":
        lines += [f"**This run failed**: {outcome.detail}"
                  + (" (the results below are from an earlier run)"
                     if path and os.path.getmtime(path) < outcome.started else ""), ""]
    if data is None:
        exists = importlib.util.find_spec(exp.module) is not None
        return lines + [f"not run: `{command(exp, out, quick)}`"
                        + ("" if exists else f" (module {exp.module} does not exist yet)"), ""], []
    text, problem = summarised(exp, path, data, out)
    lines += text
    problems = [problem] if problem else []
    said = {line for line in text if line and not line.startswith("|")}
    for path in further_runs(exp, out):
        lines += [f"### Further run: `{os.path.relpath(os.path.dirname(path), out)}/`", ""]
        try:
            with open(path, encoding="utf-8") as f:
                text, problem = summarised(exp, path, json.load(f), out)
        except (OSError, ValueError) as e:
            text, problem = [], m.failure(f"reading {path}", e)
            lines += [f"**Could not read** `{os.path.relpath(path, out)}`: {problem}", ""]
        # The legend the main run's table already gave is not repeated (its blank line neither).
        for line, after in zip(text, text[1:] + [""]):
            if not (line in said or (not line and after in said)):
                lines.append(line)
        problems += [problem] if problem else []
    return lines, problems


def further_runs(exp: Experiment, out: str) -> list[str]:
    """The JSON files of ``exp``'s runs with other options, each in a folder ``OUT/<stem>_<what>/`` (the
    SGPR training run to convergence, a timing measured again alone, ...), by folder name."""
    return sorted(glob.glob(os.path.join(glob.escape(out), glob.escape(exp.stem) + "_*", exp.stem + ".json")))


def summarised(exp: Experiment, path: str, data: dict, out: str) -> tuple[list[str], str]:
    """One results file's note, table and plot (linked from ``out``), and the problem summarising it ("")."""
    lines, problem = [], ""
    if data.get("note"):
        lines += [f"Note on this run: {data['note']}", ""]      # how the results were put together
    try:
        lines += exp.summarise(data)
    except Exception as e:  # noqa: BLE001 -- a JSON file this report cannot read is reported, not fatal
        problem = m.failure(f"summarising {os.path.relpath(path, out)}", e)
        lines += [f"**Could not summarise** `{os.path.relpath(path, out)}`: {problem}", ""]
    png = os.path.splitext(path)[0] + ".png"
    if os.path.exists(png):
        lines += [f"![{exp.title}]({os.path.relpath(png, out)})", ""]
    return lines, problem


def summary(out: str, quick: bool, outcomes: dict[str, Outcome]) -> tuple[str, list[str]]:
    """SUMMARY.md's text for the results in ``out``, and the problems met reading them."""
    found: dict[str, tuple[str | None, dict | None]] = {}
    problems: list[str] = []
    for exp in EXPERIMENTS:
        path = results_path(exp, out, quick)
        data = None
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                problems.append(m.failure(f"reading {path}", e))
        found[exp.name] = (path, data)
    head = ["experiment", "results", "run", "recorded with"] + (["this run"] if outcomes else [])
    body = []
    for exp in EXPERIMENTS:
        path, data = found[exp.name]
        machine, kind = recorded(data)
        row = [f"[{exp.title}](#{exp.title.lower().replace(' ', '-')})",
               f"`{os.path.basename(path)}`" if path else "none", kind, machine]
        if outcomes:
            o = outcomes.get(exp.name)
            row.append("-" if o is None else {"ok": f"ran ({o.seconds or 0:.0f} s)", "failed": "**FAILED**",
                                               "missing": "module missing"}[o.status])
        body.append(row)
    lines = ["# tf_memsafe experiments", "",
             "Written by `python -m experiments.report` from the JSON files beside it (each experiment's CSV, JSON "
             "and plot are here too; `--summary-only` rebuilds this page without running anything). Timings are of "
             "the machine that ran them.", "", "## Machine", "", machine_line(), "",
             *md_table(head, body)]
    for exp in EXPERIMENTS:
        text, trouble = section(exp, *found[exp.name], outcomes.get(exp.name), out, quick)
        lines += text
        problems += trouble
    return "\n".join(lines).rstrip() + "\n", problems


# ---------------------------------------------------------------- command line


def main(argv=None) -> int:
    names = [e.name for e in EXPERIMENTS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every experiment (smoke sizes)")
    parser.add_argument("--out", help=f"results folder of every experiment and of SUMMARY.md (default {RESULTS}; "
                        f"with --quick, {QUICK_RESULTS}: a smoke run never overwrites the committed results)")
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"run only these: {', '.join(names)}")
    parser.add_argument("--skip", nargs="+", choices=names, metavar="NAME", default=[], help="do not run these")
    parser.add_argument("--summary-only", action="store_true",
                        help="run nothing: rebuild SUMMARY.md from the JSON files in --out")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)
    chosen = [e for e in EXPERIMENTS if (not args.only or e.name in args.only) and e.name not in args.skip]
    outcomes: dict[str, Outcome] = {}
    if not args.summary_only:
        from tqdm import tqdm

        with tqdm(chosen, desc="experiments", unit="experiment") as bar:
            for exp in bar:
                bar.set_postfix_str(exp.name)
                outcomes[exp.name] = run(exp, args.out, args.quick)
    text, problems = summary(args.out, args.quick, outcomes)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "SUMMARY.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    for name, o in outcomes.items():
        print(f"{name:15} {o.status}" + (f" ({o.seconds:.0f} s)" if o.status == "ok" else f": {o.detail}"))
    for problem in problems:
        print(problem)
    print(f"summary written to {path}")
    return 1 if problems or any(o.status == "failed" for o in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
