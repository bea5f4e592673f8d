"""What ``experiments/knn.py`` and ``experiments/kernel_matvec.py`` share.

Both scripts compare five ways of computing one reduction over a [rows, n] matrix written the naive
way in TensorFlow (``naive``: XLA as written; ``tf_memsafe``: the same code traced with tf_memsafe
enabled; ``hand``: a hand-written chunked ``tf.while_loop``; ``keops``: pykeops' ``LazyTensor``;
``numpy``: the float64 reference).  This module holds the parts that do not depend on the
reduction: data, XLA footprints, tracing under tf_memsafe, the largest chunk that fits a limit,
timing, the per-call time budget, pykeops' lazy import, and writing CSV/JSON.

Glossary of dimension letters: Q rows of the result (queries), N points reduced over, D the
coordinates of a point, C a chunk of points (or rows), K neighbours, V columns of the vector.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
import zlib
from collections.abc import Callable

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments import overhead
from experiments._results import write_outputs  # noqa: F401 - the scripts' writer, re-exported

METHODS = ("naive", "tf_memsafe", "hand", "keops", "numpy")
TF_METHODS = ("naive", "tf_memsafe", "hand")
DATA = ("uniform", "clustered")
CLUSTERS = 64                # Gaussian mixture: components, each with this share of the unit cube's side
CLUSTER_SCALE = 0.03
EPS32 = float(np.finfo(np.float32).eps)


def fmt_bytes(value: int | None) -> str:
    return tf_memsafe.format_bytes(value) if value is not None else "-"


def fmt_n(n: int) -> str:
    """1e4, 1e5, ... for powers of ten, the number otherwise."""
    exponent = math.log10(n) if n > 0 else 0.0
    return f"1e{int(exponent)}" if exponent == int(exponent) and n >= 1000 else str(n)


# ---------------------------------------------------------------- data


def make_points(data: str, n: int, d: int, role: str, seed: int = 0) -> np.ndarray:
    """``n`` float32 points in ``d`` dimensions: ``uniform`` in the unit cube or ``clustered``.

    ``clustered`` is a mixture of :data:`CLUSTERS` isotropic Gaussians (standard deviation
    :data:`CLUSTER_SCALE`) whose centres are uniform in the unit cube; the centres depend on ``d``
    and ``seed`` only, so that queries and points (``role``) are drawn from the same mixture.
    """
    rng = np.random.default_rng([seed, d, n, zlib.crc32(role.encode())])
    if data == "uniform":
        return rng.random((n, d), dtype=np.float32)
    if data == "clustered":
        centres = np.random.default_rng([seed, d]).random((CLUSTERS, d), dtype=np.float32)   # [CLUSTERS, D]
        which = rng.integers(0, CLUSTERS, n)
        noise = rng.standard_normal((n, d), dtype=np.float32)
        return centres[which] + np.float32(CLUSTER_SCALE) * noise                          # [N, D]
    raise ValueError(f"unknown data {data!r}: expected one of {DATA}")


def blocks(total: int, size: int):
    """Slices of ``range(total)`` of at most ``size`` elements."""
    size = max(1, int(size))
    for start in range(0, total, size):
        yield slice(start, min(total, start + size))


# ---------------------------------------------------------------- TensorFlow: footprints and traces


def footprint(fn: Callable, specs, rewrite: bool) -> tuple[int | None, str]:
    """XLA's "Total bytes used" for ``fn`` on ``specs`` (compiled, not run), or ``None`` and why."""
    try:
        return tf_memsafe.memory_footprint(fn, *specs, rewrite=rewrite), ""
    except Exception as e:  # noqa: BLE001 -- a failed compile is a result of the experiment, recorded
        return None, f"footprint not measured: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def tf_memsafe_footprint(fn: Callable, specs) -> tuple[int | None, str]:
    """``footprint`` with tf_memsafe's rewrites in force; warnings of the pipeline go into the note."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, note = footprint(fn, specs, rewrite=True)
    said = " | ".join(dict.fromkeys(str(c.message).splitlines()[0] for c in caught if "tf_memsafe" in str(c.message)))
    return value, "; ".join(s for s in (note, said) if s)


def naive_function(fn: Callable, args) -> Callable:
    """``fn`` as a jit tf.function traced with every tf_memsafe pass off: the program as written."""
    return overhead.naive_function(fn, args)[0]


def tf_memsafe_function(fn: Callable, args) -> tuple[Callable, str, str]:
    """``fn`` as a jit tf.function traced now, with tf_memsafe enabled: it, its plan, its status.

    The plan lists tf_memsafe's rewrites of this trace ("pass: record; ..."), empty if none.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # said once already, by the footprint measurement
        concrete, records, _, status = overhead.traced(fn, args)
    rewritten = [f"{r.pass_name}: {r.reason}" for r in records if r.action == "rewritten"]
    return concrete, "; ".join(dict.fromkeys(rewritten)), status


def largest_chunk(make_fn: Callable[[int], Callable], specs, n: int, limit: int,
                  smallest: int = 1) -> tuple[int | None, int | None]:
    """The largest chunk ``c`` in ``[smallest, n]`` whose ``make_fn(c)`` fits ``limit``, and its footprint.

    What a person does by hand, with XLA's figure as the judge: measure two chunk sizes, take the
    straight line through them (bytes = fixed + per-element x chunk) to the limit, keep 3 % to
    spare, and shrink by 15 % until the footprint fits.  ``(None, bytes at smallest)`` if nothing fits.
    """
    def fp(c: int) -> int:
        value, _ = footprint(make_fn(c), specs, rewrite=False)
        return value if value is not None else 2**62

    c1 = max(smallest, min(n, 1024))
    f1 = fp(c1)
    if f1 > limit:
        c = c1
        while c > smallest:
            c = max(smallest, c // 2)
            f = fp(c)
            if f <= limit:
                return c, f
        return None, f1
    if c1 == n:
        return c1, f1
    c2 = min(n, 4 * c1)
    f2 = fp(c2)
    if f2 <= limit and c2 == n:
        return c2, f2
    slope = max((f2 - f1) / (c2 - c1), 1.0)
    c = min(n, max(c1, int(c1 + 0.97 * (limit - f1) / slope)))
    while c > c1:
        f = fp(c)
        if f <= limit:
            return c, f
        c = max(c1, int(c * 0.85))
    return c1, f1


def plan_note(n: int, chunk: int) -> str:
    steps, tail = divmod(n, chunk)
    return f"{steps} x {chunk}" + (f" + {tail}" if tail else "") + f" of {n}"


# ---------------------------------------------------------------- timing and budget


def time_calls(call: Callable[[], object], repeats: int, enough_s: float = 3.0) -> tuple[float, float, object]:
    """(fastest seconds, first call's seconds, result) of ``call``: one warm-up call, then up to ``repeats``.

    The warm-up compiles (XLA, KeOps) and is not timed with the rest; timed calls stop early once
    they have taken ``enough_s`` in all (a 20-second call is timed once).  What it raises, it raises.
    """
    timed = time_interleaved({"call": call}, repeats, enough_s)["call"]
    if isinstance(timed, BaseException):
        raise timed
    return timed


def time_interleaved(calls: dict[str, Callable[[], object]], repeats: int,
                     enough_s: float = 10.0) -> dict[str, tuple[float, float, object] | BaseException]:
    """Per method, ``(fastest seconds, first call's seconds, result)`` of its call, or the exception it raised.

    Every call is made once first (the warm-up: compiling), then the methods take turns, one timed
    call each per round, for ``repeats`` rounds, each round starting one method further on (so no
    method always follows the same one); a method whose timed calls have taken ``enough_s`` in all
    sits out the later rounds (one timed call at least).  Taking turns spreads a slow spell of a
    shared machine over every method instead of charging it to whichever ran then, and the fastest
    call is kept: on a shared machine the noise only ever adds time (two runs of one program here
    differed by 10 % in their medians), so the minimum is the estimate of the program's own time
    (as ``timeit`` advises).  The ratios between methods are what the benchmarks claim.
    """
    out: dict[str, tuple[float, float, object] | BaseException] = {}
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    results: dict[str, object] = {}
    for meth, call in calls.items():
        try:
            start = time.perf_counter()
            results[meth] = call()
            first[meth] = time.perf_counter() - start
            times[meth] = []
        except Exception as e:  # noqa: BLE001 -- a method that fails is a result, recorded by the caller
            out[meth] = e
    order = list(times)
    for round_ in range(max(1, repeats)):
        shift = round_ % max(1, len(order))
        for meth in order[shift:] + order[:shift]:
            if meth not in times or (times[meth] and sum(times[meth]) >= enough_s):
                continue
            try:
                start = time.perf_counter()
                results[meth] = calls[meth]()
                times[meth].append(time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001
                out[meth] = e
                del times[meth]
    for meth, ts in times.items():
        out[meth] = (min(ts), first[meth], results[meth])
    return out


class Budget:
    """Predicts a call's seconds at a size from the last size it ran at (linear in the work).

    ``reason(key, work)`` says why not to run (the prediction exceeds ``seconds``), or "" to run.
    A skipped size keeps its prediction, so larger sizes are skipped too, from the measured origin.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._last: dict = {}   # key -> (work, seconds, description of the measurement)

    def record(self, key, work: float, seconds: float, label: str) -> None:
        self._last[key] = (work, seconds, f"{seconds:.2f} s measured at {label}")

    def reason(self, key, work: float) -> str:
        if key not in self._last:
            return ""
        last_work, last_s, origin = self._last[key]
        predicted = last_s * work / last_work
        if predicted <= self.seconds:
            return ""
        self._last[key] = (work, predicted, origin)
        return f"time: predicted {predicted:.0f} s per call > --time-budget {self.seconds:g} s ({origin})"


# ---------------------------------------------------------------- KeOps


_KEOPS: tuple[object | None, str] | None = None


def keops_lazytensor() -> tuple[object | None, str]:
    """pykeops' NumPy ``LazyTensor`` class, or ``None`` and why (imported once, lazily: an optional extra)."""
    global _KEOPS
    if _KEOPS is None:
        try:
            import pykeops
            from pykeops.numpy import LazyTensor

            pykeops.set_verbose(False)
            _KEOPS = (LazyTensor, "")
        except Exception as e:  # noqa: BLE001 -- any failure to import is the column's reason
            _KEOPS = (None, f"pykeops unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return _KEOPS


def reset_keops() -> None:
    """Forget the import attempt (tests block the import and must not leave that cached)."""
    global _KEOPS
    _KEOPS = None


def failure(method: str, e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{method} failed: {type(e).__name__}: {lines[-1][:300] if lines else ''}"


# ---------------------------------------------------------------- one size, every method


@dataclasses.dataclass
class Case:
    """One size of one configuration, as every method sees it.

    ``arrays()`` gives the NumPy arguments (generated only when some method runs); the TF programs
    take them as tensors, ``keops(LazyTensor, *arrays)`` and ``reference(n_ref, *arrays)`` (the NumPy
    method, on the first ``n_ref`` rows of the result) as arrays; ``check(reference, out, *arrays)``
    compares the first ``ref_rows`` rows of a result with the reference and returns named figures.
    """

    key: tuple                           # (problem, data, d): the budget's key with the method
    n: int                               # points reduced over
    rows: int                            # rows of the result (queries)
    ref_rows: int                        # rows the NumPy reference computes
    specs: tuple                         # tf.TensorSpecs of the TF programs' arguments
    naive: Callable                      # the program as written
    hand: Callable[[int], Callable]      # chunk -> the hand-written loop
    hand_extent: int                     # what the hand-written loop chunks (points or rows)...
    hand_unit: str                       # ... named
    hand_smallest: int
    arrays: Callable[[], tuple]
    keops: Callable
    reference: Callable
    check: Callable[..., dict]


@dataclasses.dataclass
class Outcome:
    """What one method did at one size (the scripts turn it into their rows)."""

    footprint_bytes: int | None = None   # XLA's "Total bytes used" (TF methods; compiled, not run)
    within_limit: bool | None = None
    seconds: float | None = None         # fastest timed call after a warm-up call
    first_call_s: float | None = None    # the warm-up call (XLA or KeOps compile included)
    rows_per_s: float | None = None
    checks: dict = dataclasses.field(default_factory=dict)
    checked_rows: int | None = None
    plan: str = ""                       # tf_memsafe's rewrites or the hand-written loop's chunks
    skipped: str = ""                    # why the method did not run ("" if it ran)
    note: str = ""


@dataclasses.dataclass
class Settings:
    methods: tuple[str, ...]
    limit: int
    run_limit: int
    repeats: int
    budget: Budget


def measure(case: Case, s: Settings) -> dict[str, Outcome]:
    """Every method at one size: footprints first (compiled only), then the runs that are allowed.

    A method is skipped, with its reason, when not selected, when its footprint exceeds the run
    limit, when KeOps is unavailable, when its predicted time exceeds the budget, or when it fails.
    """
    out = {meth: Outcome() for meth in METHODS}
    for meth, o in out.items():
        if meth not in s.methods:
            o.skipped = "not selected (--methods)"
    hand_chunk = None
    if "naive" in s.methods:
        out["naive"].footprint_bytes, out["naive"].note = footprint(case.naive, case.specs, rewrite=False)
    if "tf_memsafe" in s.methods:
        out["tf_memsafe"].footprint_bytes, out["tf_memsafe"].note = tf_memsafe_footprint(case.naive, case.specs)
    if "hand" in s.methods:
        hand_chunk, hand_bytes = largest_chunk(case.hand, case.specs, case.hand_extent, s.limit, case.hand_smallest)
        if hand_chunk is None:
            out["hand"].skipped = (f"memory: no chunk of {case.hand_unit} fits the limit "
                                   f"({fmt_bytes(hand_bytes)} at {min(case.hand_extent, 1024)})")
        else:
            out["hand"].footprint_bytes = hand_bytes
            out["hand"].plan = f"chunks of {case.hand_unit}: " + plan_note(case.hand_extent, hand_chunk)
    for meth in TF_METHODS:
        o = out[meth]
        if o.footprint_bytes is not None:
            o.within_limit = o.footprint_bytes <= s.limit
    lazy, keops_reason = keops_lazytensor() if "keops" in s.methods else (None, "")
    n_ref = min(case.rows, case.ref_rows)
    for meth, o in out.items():
        if o.skipped:
            continue
        if meth in TF_METHODS and o.footprint_bytes is None:
            o.skipped = o.note or "footprint not measured"
        elif o.footprint_bytes is not None and o.footprint_bytes > s.run_limit:
            o.skipped = f"memory: footprint {fmt_bytes(o.footprint_bytes)} > --run-limit {fmt_bytes(s.run_limit)}"
        elif meth == "keops" and lazy is None:
            o.skipped = keops_reason
        else:
            o.skipped = s.budget.reason((meth, *case.key), case.n * (n_ref if meth == "numpy" else case.rows))
    if all(o.skipped for o in out.values()):
        return out

    arrays = case.arrays()
    tensors = tuple(tf.constant(a) for a in arrays)
    calls = {}
    for meth in ("numpy", "naive", "tf_memsafe", "hand", "keops"):   # the reference first
        o = out[meth]
        if o.skipped:
            continue
        try:
            if meth == "numpy":
                calls[meth] = lambda: case.reference(n_ref, *arrays)
            elif meth == "keops":
                calls[meth] = lambda: case.keops(lazy, *arrays)
            else:
                if meth == "naive":
                    compiled = naive_function(case.naive, tensors)
                elif meth == "tf_memsafe":
                    compiled, o.plan, status = tf_memsafe_function(case.naive, tensors)
                    o.plan = o.plan or status
                else:
                    compiled = naive_function(case.hand(hand_chunk), tensors)
                calls[meth] = lambda compiled=compiled: compiled(*tensors).numpy()
        except Exception as e:  # noqa: BLE001 -- a method that fails at a size is a result, recorded
            o.skipped = failure(meth, e)
    results = {}
    for meth, timed in time_interleaved(calls, s.repeats).items():
        o = out[meth]
        if isinstance(timed, BaseException):
            o.skipped = failure(meth, timed)
            continue
        o.seconds, o.first_call_s, result = timed
        done = n_ref if meth == "numpy" else case.rows
        o.rows_per_s = done / o.seconds
        s.budget.record((meth, *case.key), case.n * done, o.seconds, f"n = {fmt_n(case.n)}")
        results[meth] = np.asarray(result)
    reference = results.get("numpy")
    for meth, result in results.items():
        o = out[meth]
        if reference is None:
            o.note = "; ".join(x for x in (o.note, "no reference at this size (numpy skipped)") if x)
            continue
        o.checks = case.check(reference, result[:n_ref], *arrays)
        o.checked_rows = n_ref
    return out


# ---------------------------------------------------------------- output


def num(x, spec: str) -> str:
    """``x`` formatted, or ``-`` for a missing value."""
    return format(x, spec) if x is not None else "-"


def speed_summary(rows: list, key: str, rate: str, suffix: str, target: float) -> tuple[list[dict], list[dict]]:
    """(speed ratios per size, largest n per method within the limit) of a benchmark's rows.

    ``key`` is the row attribute naming the workload (``metric``, ``kernel``), ``rate`` the
    throughput attribute, ``suffix`` how the ratios' throughput fields are named
    (``tf_memsafe_<suffix>``).
    """
    by = {(getattr(r, key), r.data, r.d, r.n, r.method): getattr(r, rate) for r in rows}
    ratios = []
    for size in dict.fromkeys((getattr(r, key), r.data, r.d, r.n) for r in rows):
        speed = {meth: by.get((*size, meth)) for meth in METHODS}
        tfms, hand, keops = speed["tf_memsafe"], speed["hand"], speed["keops"]
        vs_hand = tfms / hand if tfms and hand else None
        ratios.append({key: size[0], "data": size[1], "d": size[2], "n": size[3],
                       f"tf_memsafe_{suffix}": tfms, f"hand_{suffix}": hand, f"keops_{suffix}": keops,
                       f"naive_{suffix}": speed["naive"], "tf_memsafe_vs_hand": vs_hand,
                       "tf_memsafe_vs_keops": tfms / keops if tfms and keops else None,
                       "target_met": None if vs_hand is None else vs_hand >= target})
    reach = []
    for config in dict.fromkeys((getattr(r, key), r.data, r.d) for r in rows):
        for meth in METHODS:
            mine = [r for r in rows if (getattr(r, key), r.data, r.d) == config and r.method == meth]
            ran = [r.n for r in mine if not r.skipped and r.within_limit is not False]
            fits = [r.n for r in mine if r.within_limit]
            reach.append({key: config[0], "data": config[1], "d": config[2], "method": meth,
                          "largest_n_run": max(ran, default=None),
                          "largest_n_fits": max(fits, default=None) if meth in TF_METHODS else None})
    return ratios, reach


def summary_lines(ratios: list[dict], reach: list[dict], key: str, width: int, rate_name: str, target: float,
                  limit: int) -> list[str]:
    """The printed tables of :func:`speed_summary`: ratios per size, then the largest n per method."""
    lines = ["", f"tf_memsafe {rate_name} over the hand-written loop's (target >= {target}) and over KeOps'",
             f"{key:{width}} {'data':9} {'d':>3} {'n':>6} {'tfms/hand':>9} {'tfms/keops':>10} {'target':>6}"]
    for s in ratios:
        if s["tf_memsafe_vs_hand"] is None and s["tf_memsafe_vs_keops"] is None:
            continue
        met = "-" if s["target_met"] is None else ("yes" if s["target_met"] else "NO")
        lines.append(f"{s[key]:{width}} {s['data']:9} {s['d']:>3} {fmt_n(s['n']):>6} "
                     f"{num(s['tf_memsafe_vs_hand'], '9.3f')} {num(s['tf_memsafe_vs_keops'], '10.3f')} {met:>6}")
    lines += ["", f"largest n run within {fmt_bytes(limit)} (KeOps, NumPy: footprint not measured) "
              "/ largest n whose XLA footprint fits it (compiled only)",
              f"{key:{width}} {'data':9} {'d':>3} " + " ".join(f"{meth:>15}" for meth in METHODS)]
    for config in dict.fromkeys((r[key], r["data"], r["d"]) for r in reach):
        cells = []
        for meth in METHODS:
            r = next(x for x in reach if (x[key], x["data"], x["d"], x["method"]) == (*config, meth))
            cell = fmt_n(r["largest_n_run"]) if r["largest_n_run"] else "-"
            if meth in TF_METHODS:
                cell += " / " + (fmt_n(r["largest_n_fits"]) if r["largest_n_fits"] else "-")
            cells.append(f"{cell:>15}")
        lines.append(f"{config[0]:{width}} {config[1]:9} {config[2]:>3} " + " ".join(cells))
    return lines


def plot_throughput(rows: list, path: str, panel: str, rate: str, rate_label: str, title: str) -> None:
    """Log-log rate against n, one panel per (``panel`` attribute, d), a line per method and data set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(getattr(r, panel) for r in rows))
    dims = list(dict.fromkeys(r.d for r in rows))
    styles = {"uniform": "-", "clustered": "--", "mnist": ":"}
    colours = dict(zip(METHODS, ("tab:grey", "tab:blue", "tab:orange", "tab:green", "tab:purple")))
    fig, axes = plt.subplots(len(panels), len(dims), figsize=(4.2 * len(dims), 3.4 * len(panels)), squeeze=False)
    for i, name in enumerate(panels):
        for j, d in enumerate(dims):
            ax = axes[i][j]
            for data in dict.fromkeys(r.data for r in rows):
                for meth in METHODS:
                    pts = [(r.n, getattr(r, rate)) for r in rows
                           if (getattr(r, panel), r.d, r.data, r.method) == (name, d, data, meth) and getattr(r, rate)]
                    if pts:
                        xs, ys = zip(*pts)
                        ax.plot(xs, ys, styles.get(data, "-"), marker="o", ms=3, color=colours[meth],
                                label=f"{meth} ({data})")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{name}, d = {d}", fontsize=9)
            ax.set_xlabel("n (points)", fontsize=8)
            ax.set_ylabel(rate_label, fontsize=8)
            ax.tick_params(labelsize=7)
            if ax.lines:
                ax.legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    return {"tensorflow": tf.__version__, "cpus": os.cpu_count(), "keops": keops_lazytensor()[1] or "available"}
