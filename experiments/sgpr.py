"""GPflow's SGPR, unchanged, on a 3-D road-network regression problem under a memory limit (issue 9).

    python -m experiments.sgpr [--quick] [--out experiments/results] [--limit 1GB] [--run-limit 8GB]
        [--sizes 1e4 3e4 1e5 3e5 1e6] [--inducing 500 1000 2000] [--kernels se matern32]
        [--data PATH] [--train | --no-train] [--train-max-n 1e4] [--maxiter 50] [--train-hours H]
        [--repeats 3] [--seed 0] [--test-points T] [--resume [--redo]] [--note TEXT]

The model is ``gpflow.models.SGPR`` as GPflow ships it, float64, with a ``SquaredExponential``
(``se``) or ``Matern32`` (``matern32``) kernel with ARD lengthscales (initially ones), the inducing
points a fixed random subset of the training inputs (seeded), everything else GPflow's defaults.

**Data.**  :func:`road_network` generates a problem shaped like UCI's "3D Road Network" (3droad:
434,874 rows; inputs OSM road id, longitude, latitude; target altitude): points along random
polyline roads in North Jutland's bounding box, altitude a smooth terrain of the two coordinates
plus a slowly varying effect of the road id, plus 1 m of noise; seedable, any number of rows.
``--data PATH`` (CSV, comma- or space-separated, an optional header line, or ``.npy``; last column
the target) is used instead.  For each size N the data set has N + N/9 rows (a random subset of
the file's, or generated), shuffled and split 90/10 into training and test sets; inputs and target
are standardised with the training set's mean and standard deviation.  RMSE and NLPD are in
standardised units.  Sizes beyond a file's rows are replaced by the largest that fits it.
``--test-points T`` holds out T rows instead of N/9 (the issue's predictions over a million test
points: ``--sizes 1e4 --test-points 1e6`` trains at N = 1e4 and predicts, and ``--sizes 1e6
--no-train --test-points 1e6`` measures the prediction programs at N = 1e6, compiled only).
Predictions whose program needs more than ``--run-limit`` (compiled first, never run) are not
run: the note says so.

**Each point** (kernel, N, M), a fresh model each time:

* ``tf_memsafe``: ``tf_memsafe.enable(--limit)``, then ``gpflow.optimizers.Scipy().eval_func``
  builds the loss-and-gradient function exactly as ``minimize`` does (a ``tf.function`` with
  ``jit_compile=True``: the packed variables assigned, ``training_loss`` under a ``GradientTape``
  inside, the gradients packed).  Its first call is traced, rewritten and compiled while XLA dumps
  its programs, and ``tf_memsafe_bytes`` is that compile's "Total bytes used" (as ``python -m
  tf_memsafe`` reads it); ``tf_memsafe_s`` is the fastest of further calls (``_methods.time_calls``),
  or, when the first call took over ``LONG_CALL_S`` (the largest points: minutes per call),
  that call itself (compiling is then under 2 % of it; ``note`` says so).
  Training (``N <= --train-max-n``): ``Scipy().minimize(model.training_loss, ...,
  compile=True, tf_fun_args={"jit_compile": True}, options={"maxiter": --maxiter})`` (with
  ``--train-hours H``, a step callback ends it after H hours: ``converged`` false, ``note`` says
  so; the issue's "largest N that converges within two hours" is ``--train-hours 2``) -- GPflow's
  documented compile cache gives it the very function just timed -- then ``predict_y`` and
  ``predict_log_density`` on the test set, each in its own ``tf.function(jit_compile=True)``
  (``predict_bytes``: the larger of the two, measured from their compiles the same way; untrained,
  compiled only with ``tf_memsafe.memory_footprint``).  ``tf_memsafe.disable()`` after.
* ``naive``: the same loss-and-gradient program as written, ``tf_memsafe.memory_footprint(...,
  rewrite=False)`` (compiled, never run; ``naive_source = "measured"``), or, where XLA cannot
  compile it, the memory model's estimate of it (``"model"``; ``naive_model_bytes`` always holds
  the estimate).  Where it fits ``--run-limit``, a fresh model goes through the same steps with
  tf_memsafe disabled, and the results are compared (``check``): the first loss to 1e-8 and the
  gradients to 1e-6 (relative, by norm), the two trainings' final ELBO to 1e-8 relative, RMSE to
  1e-6 relative, NLPD to 1e-6 (over ``max(1, |NLPD|)``).  The split program sums in another order,
  and L-BFGS can amplify that rounding into another path (SE, N = 1e4, M = 500, 50 iterations:
  ELBO 5e-6 apart), so the naive programs are also evaluated at tf_memsafe's trained parameters
  (``same_params_*``: loss to 1e-8, gradient, RMSE, NLPD as above; ``same_params_check``).

The full sweep takes hours on 2 cores (at N = 1e6 one loss-and-gradient evaluation takes minutes):
the results are written after every point, and ``--resume`` keeps the points an earlier run with
the same settings left in ``--out`` (failed points are measured again; the JSON's ``note`` says how
many were carried over), so a sweep can be run in parts; ``--redo`` measures the points the run
names again (after a change to tf_memsafe that affects them) and keeps the rest.

Results: ``sgpr.csv``, ``sgpr.json`` and ``sgpr.png`` (footprints against N on log axes with the
limit, naive measured and model-predicted marked apart; seconds per loss-and-gradient against N;
RMSE and NLPD against M) in ``--out``, and a table on stdout.  ``--quick``: the se kernel, N 2000
and 4000, M 50 and 100, a 3 MB limit (the naive programs need 4.3-17 MB), 10 L-BFGS iterations at
N = 2000, one timed call: about a minute on 2 cores.  Timings are of this machine and are not
asserted anywhere.

Glossary of dimension letters: N training points, T test points, M inducing points, D input
coordinates (3), P packed trainable parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import sys
import time
import warnings

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments import _methods as m
from experiments._results import OUT_HELP, results_dir
from tf_memsafe import hook, xla_flags

KERNELS = {"se": "SquaredExponential", "matern32": "Matern32"}
UCI_3DROAD_ROWS = 434_874
TEST_SHARE = 0.1                 # of each data set: the test set
TF_FUN_ARGS = {"jit_compile": True}
# Agreement with the naive program where it runs (see the module docstring for each measure).
TOLERANCES = {"loss": 1e-8, "grad": 1e-6, "elbo": 1e-8, "rmse": 1e-6, "nlpd": 1e-6}
LONG_CALL_S = 300.0              # a first call longer than this is the timing (see the module docstring)

# The generated road network (degrees of longitude and latitude; metres of altitude).
LON, LAT = (8.15, 11.20), (56.58, 57.76)      # North Jutland's bounding box, as in 3droad
ROADS, SEGMENTS, HILLS = 600, 40, 40
FIRST_ID, ID_STRIDE = 1.4e8, 1e5              # OSM-like road ids, growing roughly west to east
EMBANKMENT_M, NOISE_M = 3.0, 1.0


@dataclasses.dataclass
class Row:
    kernel: str                                  # se (SquaredExponential) or matern32, ARD lengthscales
    n: int                                       # training points
    m: int                                       # inducing points
    n_test: int
    data: str                                    # "road_network" (generated) or the --data file's name
    limit_bytes: int                             # --limit
    naive_bytes: int | None = None               # the loss-and-gradient program as written (see naive_source)
    naive_source: str = ""                       # "measured" (XLA, compiled only) or "model" (tf_memsafe's estimate)
    naive_model_bytes: int | None = None         # the memory model's estimate of the naive program
    naive_within_limit: bool | None = None
    tf_memsafe_bytes: int | None = None          # XLA's figure for the rewritten program that ran
    tf_memsafe_within_limit: bool | None = None
    status: str = ""                             # tf_memsafe's report on that trace: rewritten, unchanged, failed
    plan: str = ""                               # the splitter's rewrites
    predict_bytes: int | None = None             # tf_memsafe's predict_y and predict_log_density programs: the larger
    predict_within_limit: bool | None = None
    naive_predict_bytes: int | None = None       # where the naive predictions ran
    tf_memsafe_s: float | None = None            # fastest seconds per loss-and-gradient evaluation
    tf_memsafe_first_call_s: float | None = None  # the first call: trace, rewrite and XLA compile included
    naive_s: float | None = None
    naive_first_call_s: float | None = None
    naive_skipped: str = ""                      # why the naive program did not run ("" if it did)
    loss_rel_err: float | None = None            # first evaluation against naive: |loss - naive| / |naive|
    grad_rel_err: float | None = None            # ... ||gradient - naive|| / ||naive||
    trained: bool = False
    maxiter: int = 0
    nit: int | None = None                       # L-BFGS iterations
    converged: bool | None = None                # scipy's success: a convergence test met before --maxiter
    train_s: float | None = None                 # minimize(), compile included
    elbo: float | None = None                    # final ELBO (minus the final training loss)
    rmse: float | None = None                    # test set, standardised units
    nlpd: float | None = None                    # test set, mean negative log predictive density, standardised
    naive_nit: int | None = None
    naive_converged: bool | None = None
    naive_train_s: float | None = None
    naive_elbo: float | None = None
    naive_rmse: float | None = None
    naive_nlpd: float | None = None
    elbo_rel_err: float | None = None            # the two trainings' results: |tf_memsafe - naive| / |naive|
    rmse_rel_err: float | None = None
    nlpd_err: float | None = None                # |nlpd - naive| / max(1, |naive|)
    check: str = ""                              # "pass", "FAIL: ..." or "" (the naive program did not run)
    same_params_loss_rel_err: float | None = None  # at tf_memsafe's trained parameters, the naive programs' loss...
    same_params_grad_rel_err: float | None = None  # ... gradient, ...
    same_params_rmse_rel_err: float | None = None  # ... RMSE ...
    same_params_nlpd_err: float | None = None      # ... and NLPD against tf_memsafe's there
    same_params_check: str = ""                  # the same tolerances (loss as ELBO's) at those parameters
    skipped: str = ""                            # why nothing ran at this point ("" if it ran)
    note: str = ""


# ---------------------------------------------------------------- data


def _terrain(lon: np.ndarray, lat: np.ndarray, hills: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """Altitude in metres: a gentle slope plus Gaussian hills (one at a time: [N] buffers only)."""
    centres, heights, widths = hills                                     # [H, 2], [H], [H]
    alt = 10.0 + 20.0 * (lat - LAT[0]) / (LAT[1] - LAT[0])               # [N]
    for (c_lon, c_lat), h, w in zip(centres, heights, widths):
        alt += h * np.exp(-((lon - c_lon) ** 2 + (lat - c_lat) ** 2) / (2.0 * w * w))
    return alt


def road_network(n: int = UCI_3DROAD_ROWS, seed: int = 0) -> np.ndarray:
    """``n`` rows (road id, longitude, latitude, altitude): a stand-in for UCI's 3droad, [n, 4] float64.

    The roads (``ROADS`` random-walk polylines of ``SEGMENTS`` pieces in North Jutland's box) and
    the terrain depend on ``seed`` only; points are drawn uniformly along a uniformly chosen road,
    0.0002 degrees off it.  Altitude = terrain(longitude, latitude) + ``EMBANKMENT_M`` x
    sin(6 pi u), u the road id's place in [0, 1), + N(0, ``NOISE_M``^2).
    """
    net = np.random.default_rng([seed, 0])
    lo, hi = np.array([LON[0], LAT[0]]), np.array([LON[1], LAT[1]])
    start = net.uniform(lo, hi, (ROADS, 2))                                            # [R, 2]
    heading = net.uniform(0, 2 * np.pi, (ROADS, 1)) + np.cumsum(net.normal(0, 0.25, (ROADS, SEGMENTS)), 1)
    step = net.uniform(0.002, 0.02, (ROADS, 1, 1)) * np.stack([np.cos(heading), np.sin(heading)], -1)  # [R, S, 2]
    vertices = np.clip(start[:, None] + np.concatenate([np.zeros((ROADS, 1, 2)), np.cumsum(step, 1)], 1),
                       lo, hi)                                                         # [R, S + 1, 2]
    order = np.argsort(np.argsort(start[:, 0] + net.normal(0, 0.5, ROADS)))            # mapped west to east
    road_id = FIRST_ID + ID_STRIDE * order + net.integers(0, int(ID_STRIDE), ROADS)    # [R]
    hills = (net.uniform(lo, hi, (HILLS, 2)), net.uniform(5.0, 40.0, HILLS), net.uniform(0.05, 0.5, HILLS))

    pts = np.random.default_rng([seed, 1, n])
    road = pts.integers(0, ROADS, n)                                                   # [N]
    pos = pts.uniform(0, SEGMENTS, n)
    seg = np.minimum(pos.astype(np.int64), SEGMENTS - 1)
    frac = (pos - seg)[:, None]                                                        # [N, 1]
    xy = (1 - frac) * vertices[road, seg] + frac * vertices[road, seg + 1] + pts.normal(0, 2e-4, (n, 2))  # [N, 2]
    u = (road_id[road] - FIRST_ID) / (ID_STRIDE * ROADS)                               # [N] in [0, 1)
    altitude = (_terrain(xy[:, 0], xy[:, 1], hills) + EMBANKMENT_M * np.sin(6 * np.pi * u)
                + pts.normal(0, NOISE_M, n))                                           # [N]
    return np.column_stack([road_id[road], xy, altitude])                              # [N, 4]


def load_table(path: str) -> np.ndarray:
    """A ``.npy`` array or a CSV (comma- or space-separated, optional header line) as [rows, columns] float64.

    Rows with a value that is not finite are dropped.  The last column is the target.
    """
    if path.endswith(".npy"):
        table = np.load(path)
    else:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        delimiter = "," if "," in first else None
        try:
            [float(v) for v in first.replace(",", " ").split()]
            header = 0
        except ValueError:
            header = 1
        table = np.loadtxt(path, delimiter=delimiter, skiprows=header, ndmin=2)
    table = np.asarray(table, np.float64)
    if table.ndim != 2 or table.shape[1] < 2:
        raise ValueError(f"{path}: expected a table of inputs and a target column, got shape {table.shape}")
    return table[np.all(np.isfinite(table), axis=1)]


def held_out_rows(n_train: int) -> int:
    """Test rows that go with ``n_train`` training rows: 10 % of the whole."""
    return max(1, round(n_train * TEST_SHARE / (1 - TEST_SHARE)))


def largest_train(rows: int, test_points: int | None = None) -> int:
    """The largest N whose data set (N + test rows: ``test_points``, or 10 %) fits in ``rows`` rows."""
    if test_points is not None:
        return max(0, rows - test_points)
    n = int(rows * (1 - TEST_SHARE)) + 2     # held_out_rows rounds: the answer is a row or two from 90 %
    while n > 1 and n + held_out_rows(n) > rows:
        n -= 1
    return n


@dataclasses.dataclass
class Split:
    """A standardised 90/10 split (training statistics applied to both sets)."""

    x_train: np.ndarray     # [N, D]
    y_train: np.ndarray     # [N, 1]
    x_test: np.ndarray      # [T, D]
    y_test: np.ndarray      # [T, 1]
    x_mean: np.ndarray      # [D]
    x_std: np.ndarray       # [D]
    y_mean: float
    y_std: float


def prepare(table: np.ndarray, n_train: int, seed: int = 0, n_test: int | None = None) -> Split:
    """``n_train`` + ``n_test`` (default ``held_out_rows(n_train)``) random rows of ``table`` (target
    last), split and standardised."""
    n_test = held_out_rows(n_train) if n_test is None else n_test
    if n_train + n_test > len(table):
        raise ValueError(f"{n_train} training + {n_test} test rows requested from a table of {len(table)}")
    rows = np.random.default_rng([seed, n_train]).permutation(len(table))[:n_train + n_test]
    x, y = table[rows, :-1], table[rows, -1:]                                          # [N + T, D], [N + T, 1]
    x_mean, x_std = x[:n_train].mean(0), x[:n_train].std(0)
    y_mean, y_std = float(y[:n_train].mean()), float(y[:n_train].std())
    x_std = np.where(x_std > 0, x_std, 1.0)
    y_std = y_std if y_std > 0 else 1.0
    x, y = (x - x_mean) / x_std, (y - y_mean) / y_std
    return Split(x[:n_train], y[:n_train], x[n_train:], y[n_train:], x_mean, x_std, y_mean, y_std)


# ---------------------------------------------------------------- model and programs


def make_model(split: Split, m_inducing: int, kernel: str, seed: int = 0):
    """GPflow's SGPR, float64, ARD lengthscales of ones, inducing points a seeded subset of the inputs."""
    import gpflow

    n, d = split.x_train.shape
    chosen = np.random.default_rng([seed, n, m_inducing]).choice(n, m_inducing, replace=False)
    k = getattr(gpflow.kernels, KERNELS[kernel])(lengthscales=np.ones(d))
    return gpflow.models.SGPR((split.x_train, split.y_train), kernel=k,
                              inducing_variable=split.x_train[np.sort(chosen)].copy())


def predictors(model, split: Split) -> tuple:
    """The test-set predictions as two Python functions, each for its own ``tf.function(jit_compile=True)``.

    Two programs, as one calls them; each runs on its own, so the larger footprint is the peak, and
    a prediction over the limit is named by its own record.
    """
    x_test, y_test = tf.constant(split.x_test), tf.constant(split.y_test)

    def predict_y():
        return model.predict_y(x_test)[0]                                # [T, 1] mean

    def predict_log_density():
        return model.predict_log_density((x_test, y_test))               # [T]
    return predict_y, predict_log_density


def joined(*parts: str) -> str:
    """The non-empty ``parts``, "; "-separated (how notes are written)."""
    return "; ".join(p for p in parts if p)


def compiled_bytes(folder: str) -> int | None:
    """The "Total bytes used" of the programs XLA compiled into ``folder`` (summed), ``None`` if none."""
    reports = xla_flags.memory_reports(folder)
    return sum(total for _, total in reports) if reports else None


@dataclasses.dataclass
class Settings:
    """The sweep's options that every point uses."""

    limit: int
    run_limit: int
    repeats: int
    train: bool
    train_max_n: int
    maxiter: int
    seed: int
    train_hours: float | None = None       # L-BFGS stops after this wall time (not converged), if set


@dataclasses.dataclass
class Side:
    """What one program (naive or tf_memsafe) did at one point."""

    bytes: int | None = None
    seconds: float | None = None
    first_call_s: float | None = None
    loss: float | None = None
    grad: np.ndarray | None = None
    naive_bytes: int | None = None         # tf_memsafe side: the same program compiled as written
    naive_note: str = ""
    model_bytes: int | None = None         # ... and the memory model's estimate of it
    status: str = ""
    plan: str = ""
    predict_bytes: int | None = None
    nit: int | None = None
    converged: bool | None = None
    train_s: float | None = None
    elbo: float | None = None
    rmse: float | None = None
    nlpd: float | None = None
    final_x: np.ndarray | None = None      # tf_memsafe side: the trained parameters [P], ...
    final_loss: float | None = None        # ... and its loss and gradient there
    final_grad: np.ndarray | None = None
    at_loss: float | None = None           # naive side: loss, gradient, RMSE, NLPD at tf_memsafe's final_x
    at_grad: np.ndarray | None = None
    at_rmse: float | None = None
    at_nlpd: float | None = None
    note: str = ""


def scores(predict_fns, split: Split) -> tuple[float, float]:
    """(RMSE, NLPD) on the test set from the compiled ``predict_y`` and ``predict_log_density``."""
    mean, log_density = (fn().numpy() for fn in predict_fns)                          # [T, 1], [T]
    return float(np.sqrt(np.mean((mean - split.y_test) ** 2))), float(-np.mean(log_density))


class Deadline:
    """A GPflow step callback that ends L-BFGS (scipy stops on StopIteration) once ``hours`` of
    wall time have passed since ``start``; ``stopped`` then says so."""

    def __init__(self, start: float, hours: float):
        self.start, self.hours, self.stopped = start, hours, ""

    def __call__(self, step, variables, values):
        if time.perf_counter() - self.start > self.hours * 3600:
            self.stopped = f"the {self.hours:g} h training budget ran out after {step + 1} iterations"
            raise StopIteration(self.stopped)


def run_side(split: Split, kernel: str, m_inducing: int, s: Settings, train: bool, rewritten: bool,
             at: np.ndarray | None = None) -> Side:
    """One fresh model: its loss-and-gradient timed, then (``train``) optimised and its predictions scored.

    ``rewritten``: tf_memsafe is enabled (by the caller); the naive footprint of the same program
    and the trace's report are recorded too, and the loss and gradient at the trained parameters.
    ``at``: after training, evaluate loss, gradient, RMSE and NLPD at these parameters too.
    """
    import gpflow

    out = Side()
    model = make_model(split, m_inducing, kernel, s.seed)
    variables = model.trainable_variables
    opt = gpflow.optimizers.Scipy()
    evaluate = opt.eval_func(model.training_loss, variables, tf_fun_args=TF_FUN_ARGS)   # what minimize builds
    x0 = opt.initial_parameters(variables).numpy()                                     # [P]
    mark = hook.report_mark()
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        start = time.perf_counter()
        loss, grad = evaluate(x0)
        out.first_call_s = time.perf_counter() - start
        if out.first_call_s > LONG_CALL_S:
            out.seconds, out.note = out.first_call_s, "seconds: one call, compile included"
        else:
            out.seconds, _, (loss, grad) = m.time_calls(lambda: evaluate(x0), s.repeats)
        out.bytes = compiled_bytes(folder)
    out.loss, out.grad = float(loss), np.asarray(grad)
    program = next(iter(opt.compile_cache.values()))                                  # GPflow's public cache
    spec = tf.TensorSpec(x0.shape, tf.float64)
    if rewritten:
        name = program.get_concrete_function(spec).graph.name
        mine = [r for r in hook.reports_since(mark) if r.function_name == name]
        if mine:
            out.status, out.model_bytes = mine[-1].status, mine[-1].model_before_bytes
            out.plan = "; ".join(dict.fromkeys(f"{r.pass_name}: {r.reason}" for r in mine[-1].records
                                               if r.action == "rewritten"))
        else:
            out.status = "not seen by tf_memsafe"
        out.naive_bytes, out.naive_note = m.footprint(program, (spec,), rewrite=False)
    if not train:
        if rewritten:
            figures = [m.footprint(fn, (), rewrite=True) for fn in predictors(model, split)]
            out.predict_bytes = None if any(b is None for b, _ in figures) else max(b for b, _ in figures)
            out.note = joined(out.note, *(note for _, note in figures))
        return out

    start = time.perf_counter()
    budget = Deadline(start, s.train_hours) if s.train_hours is not None else None
    result = opt.minimize(model.training_loss, variables, compile=True, tf_fun_args=TF_FUN_ARGS,
                          options={"maxiter": s.maxiter}, step_callback=budget)
    out.train_s = time.perf_counter() - start
    out.nit, out.elbo, out.converged = int(result.nit), -float(result.fun), bool(result.success)
    if budget is not None and budget.stopped:
        out.note = joined(out.note, "L-BFGS stopped: " + budget.stopped)
    if len(opt.compile_cache) != 1:
        out.note = joined(out.note, "minimize compiled a second loss-and-gradient function")
    too_large = predictions_over(model, split, s, rewritten)
    out.note = joined(out.note, too_large)
    predict_fns = [] if too_large else [tf.function(fn, jit_compile=True) for fn in predictors(model, split)]
    figures = []
    for fn in predict_fns:
        with xla_flags.dump_all_compiles(in_memory=True) as folder:
            fn()                                                                       # compiled here
            figures.append(compiled_bytes(folder))
    out.predict_bytes = None if None in figures or not figures else max(figures)
    if predict_fns:
        out.rmse, out.nlpd = scores(predict_fns, split)
    if rewritten:
        out.final_x = np.asarray(result.x)
        loss, grad = evaluate(out.final_x)
        out.final_loss, out.final_grad = float(loss), np.asarray(grad)
    if at is not None:
        loss, grad = evaluate(at)                                                      # assigns ``at`` to the model
        out.at_loss, out.at_grad = float(loss), np.asarray(grad)
        if predict_fns:
            out.at_rmse, out.at_nlpd = scores(predict_fns, split)
    return out


def predictions_over(model, split: Split, s: Settings, rewritten: bool) -> str:
    """Why the test-set predictions must not run (a program's footprint, compiled only, over
    ``--run-limit``: the naive ``predict_y`` over a million test points needs 16 GB), or "".

    tf_memsafe's programs are built to fit ``--limit``: they are held to the larger of the two
    (a small ``--run-limit``, there to keep the naive side from running, must not stop them).
    """
    bound = max(s.run_limit, s.limit) if rewritten else s.run_limit
    for fn in predictors(model, split):
        figure, _ = m.footprint(fn, (), rewrite=rewritten)
        if figure is not None and figure > bound:
            return (f"predictions not run: `{fn.__name__}` footprint {m.fmt_bytes(figure)} > "
                    + (f"--run-limit {m.fmt_bytes(bound)}" if bound == s.run_limit else
                       f"--limit {m.fmt_bytes(bound)}"))
    return ""


# ---------------------------------------------------------------- one point


def rel(a: float | None, b: float | None, floor: float = 0.0) -> float | None:
    """|a - b| / max(|b|, floor), or ``None`` if either is missing."""
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), floor) if max(abs(b), floor) > 0 else abs(a - b)


def rel_norm(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    """||a - b|| / ||b||: a gradient's small entries carry the absolute error of its large ones."""
    if a is None or b is None:
        return None
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(errors: dict[str, float | None]) -> str:
    """"pass" when every measured error is within :data:`TOLERANCES`, else "FAIL: " and those over."""
    over = [f"{k} {v:.1e} > {TOLERANCES[k]:g}" for k, v in errors.items() if v is not None and v > TOLERANCES[k]]
    return "FAIL: " + ", ".join(over) if over else "pass"


def measure(split: Split, data: str, kernel: str, m_inducing: int, s: Settings) -> Row:
    """Every measurement at one (kernel, N, M): tf_memsafe first, then the naive program where it fits."""
    n = len(split.x_train)
    train = s.train and n <= s.train_max_n
    row = Row(kernel=kernel, n=n, m=m_inducing, n_test=len(split.x_test), data=data, limit_bytes=s.limit,
              trained=train, maxiter=s.maxiter)
    if m_inducing > n:
        row.skipped = f"M = {m_inducing} > N = {n}"
        return row

    tf_memsafe.enable(s.limit)   # before the functions are built (and traced)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tfms = run_side(split, kernel, m_inducing, s, train, rewritten=True)
    except Exception as e:  # noqa: BLE001 -- a point that fails is a result, recorded
        row.skipped = m.failure("tf_memsafe", e)
        return row
    finally:
        tf_memsafe.disable()
        gc.collect()
    said = [str(c.message).splitlines()[0] for c in caught if "tf_memsafe" in str(c.message)]
    row.note = joined(tfms.note, *dict.fromkeys(said))
    row.tf_memsafe_bytes, row.status, row.plan = tfms.bytes, tfms.status, tfms.plan
    row.tf_memsafe_within_limit = None if tfms.bytes is None else tfms.bytes <= s.limit
    row.predict_bytes = tfms.predict_bytes
    row.predict_within_limit = None if tfms.predict_bytes is None else tfms.predict_bytes <= s.limit
    row.tf_memsafe_s, row.tf_memsafe_first_call_s = tfms.seconds, tfms.first_call_s
    row.nit, row.train_s, row.elbo, row.rmse, row.nlpd = tfms.nit, tfms.train_s, tfms.elbo, tfms.rmse, tfms.nlpd
    row.converged = tfms.converged
    row.naive_model_bytes = tfms.model_bytes
    if tfms.naive_bytes is not None:
        row.naive_bytes, row.naive_source = tfms.naive_bytes, "measured"
    elif tfms.model_bytes is not None:
        row.naive_bytes, row.naive_source = tfms.model_bytes, "model"
        row.note = joined(row.note, tfms.naive_note)
    row.naive_within_limit = None if row.naive_bytes is None else row.naive_bytes <= s.limit

    if row.naive_bytes is None:
        row.naive_skipped = tfms.naive_note or "naive footprint unknown"
    elif row.naive_bytes > s.run_limit:
        row.naive_skipped = (f"memory: {row.naive_source} footprint {m.fmt_bytes(row.naive_bytes)} > "
                             f"--run-limit {m.fmt_bytes(s.run_limit)}")
    else:
        try:
            naive = run_side(split, kernel, m_inducing, s, train, rewritten=False, at=tfms.final_x)
        except Exception as e:  # noqa: BLE001 -- recorded, as above
            row.naive_skipped = m.failure("naive", e)
        else:
            row.naive_s, row.naive_first_call_s = naive.seconds, naive.first_call_s
            row.naive_predict_bytes = naive.predict_bytes
            row.naive_nit, row.naive_train_s, row.naive_elbo = naive.nit, naive.train_s, naive.elbo
            row.naive_converged = naive.converged
            row.naive_rmse, row.naive_nlpd = naive.rmse, naive.nlpd
            row.loss_rel_err, row.grad_rel_err = rel(tfms.loss, naive.loss), rel_norm(tfms.grad, naive.grad)
            row.elbo_rel_err = rel(tfms.elbo, naive.elbo)
            row.rmse_rel_err = rel(tfms.rmse, naive.rmse)
            row.nlpd_err = rel(tfms.nlpd, naive.nlpd, floor=1.0)
            row.check = check({"loss": row.loss_rel_err, "grad": row.grad_rel_err, "elbo": row.elbo_rel_err,
                               "rmse": row.rmse_rel_err, "nlpd": row.nlpd_err})
            if naive.at_loss is not None:
                row.same_params_loss_rel_err = rel(tfms.final_loss, naive.at_loss)
                row.same_params_grad_rel_err = rel_norm(tfms.final_grad, naive.at_grad)
                row.same_params_rmse_rel_err = rel(tfms.rmse, naive.at_rmse)
                row.same_params_nlpd_err = rel(tfms.nlpd, naive.at_nlpd, floor=1.0)
                row.same_params_check = check({"elbo": row.same_params_loss_rel_err,
                                               "grad": row.same_params_grad_rel_err,
                                               "rmse": row.same_params_rmse_rel_err,
                                               "nlpd": row.same_params_nlpd_err})
            if naive.note:
                row.note = joined(row.note, "naive: " + naive.note)
        finally:
            gc.collect()
    return row


# ---------------------------------------------------------------- summary and output


def reach(rows: list[Row]) -> list[dict]:
    """Per kernel and M: the largest N whose naive and tf_memsafe programs fit the limit."""
    out = []
    for kernel, m_inducing in dict.fromkeys((r.kernel, r.m) for r in rows):
        mine = [r for r in rows if (r.kernel, r.m) == (kernel, m_inducing) and not r.skipped]
        out.append({"kernel": kernel, "m": m_inducing,
                    "naive_largest_n_fits": max((r.n for r in mine if r.naive_within_limit), default=None),
                    "tf_memsafe_largest_n_fits": max((r.n for r in mine if r.tf_memsafe_within_limit
                                                      and r.predict_within_limit is not False), default=None)})
    return out


def table(rows: list[Row], limit: int) -> str:
    num = m.num
    head = (f"{'kernel':8} {'N':>6} {'M':>5} {'naive':>10} {'':5} {'tf_memsafe':>10} {'fits':4} {'predict':>9} "
            f"{'s/eval':>8} {'naive s':>8} {'nit':>5} {'ELBO':>12} {'RMSE':>7} {'NLPD':>7}  check / naive skipped")
    lines = [f"GPflow SGPR loss and gradient (tape inside), float64; limit {m.fmt_bytes(limit)}", head, "-" * len(head)]
    for r in rows:
        if r.skipped:
            lines.append(f"{r.kernel:8} {m.fmt_n(r.n):>6} {r.m:>5}  {r.skipped[:120]}")
            continue
        source = "model" if r.naive_source == "model" else ""
        fits = "-" if r.tf_memsafe_within_limit is None else ("yes" if r.tf_memsafe_within_limit else "NO")
        if r.predict_within_limit is False:
            fits += "*"
        tail = joined(r.check, r.same_params_check and "same parameters: " + r.same_params_check) or (
            r.naive_skipped and "naive: " + r.naive_skipped)
        nit = num(r.nit, 'd') + ("c" if r.converged else "")
        lines.append(f"{r.kernel:8} {m.fmt_n(r.n):>6} {r.m:>5} {m.fmt_bytes(r.naive_bytes):>10} {source:5} "
                     f"{m.fmt_bytes(r.tf_memsafe_bytes):>10} {fits:4} {m.fmt_bytes(r.predict_bytes):>9} "
                     f"{num(r.tf_memsafe_s, '.3f'):>8} {num(r.naive_s, '.3f'):>8} {nit:>5} "
                     f"{num(r.elbo, '.2f'):>12} {num(r.rmse, '.4f'):>7} {num(r.nlpd, '.4f'):>7}  {tail[:90]}")
    lines += ["", "naive: XLA's footprint of the program as written, compiled only ('model': the memory model's "
              "estimate); fits: tf_memsafe's within the limit (*: its predictions are not); s/eval: seconds per "
              "loss and gradient; nit, ELBO, RMSE, NLPD: tf_memsafe's training (c: L-BFGS converged before --maxiter; "
              "RMSE, NLPD standardised)",
              "", f"largest N within {m.fmt_bytes(limit)}", f"{'kernel':8} {'M':>5} {'naive':>8} {'tf_memsafe':>10}"]
    for x in reach(rows):
        naive, tfms = x["naive_largest_n_fits"], x["tf_memsafe_largest_n_fits"]
        lines.append(f"{x['kernel']:8} {x['m']:>5} {m.fmt_n(naive) if naive else '-':>8} "
                     f"{m.fmt_n(tfms) if tfms else '-':>10}")
    checked, same = [r for r in rows if r.check], [r for r in rows if r.same_params_check]
    lines.append(f"\nagreement with the naive program: {sum(r.check == 'pass' for r in checked)} of {len(checked)} "
                 f"points where it ran pass (loss {TOLERANCES['loss']:g}, gradients {TOLERANCES['grad']:g}, "
                 f"ELBO {TOLERANCES['elbo']:g}, RMSE {TOLERANCES['rmse']:g}, NLPD {TOLERANCES['nlpd']:g}); "
                 f"at tf_memsafe's trained parameters, {sum(r.same_params_check == 'pass' for r in same)} of "
                 f"{len(same)}")
    return "\n".join(lines)


def plot(rows: list[Row], path: str, limit: int, title: str) -> None:
    """Per kernel: footprints vs N (with the limit), seconds per loss-and-gradient vs N, RMSE and NLPD vs M."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = list(dict.fromkeys(r.kernel for r in rows))
    ms = sorted({r.m for r in rows})
    ns = sorted({r.n for r in rows})
    colour_m = {v: plt.cm.viridis(i / max(1, len(ms) - 1) * 0.85) for i, v in enumerate(ms)}
    colour_n = {v: plt.cm.plasma(i / max(1, len(ns) - 1) * 0.85) for i, v in enumerate(ns)}
    fig, axes = plt.subplots(len(kernels), 4, figsize=(17, 3.8 * len(kernels)), squeeze=False)
    for i, kernel in enumerate(kernels):
        mine = [r for r in rows if r.kernel == kernel and not r.skipped]
        ax_fp, ax_t, ax_rmse, ax_nlpd = axes[i]
        for v in ms:
            pts = sorted((r for r in mine if r.m == v), key=lambda r: r.n)
            c = colour_m[v]
            tf_pts = [(r.n, r.tf_memsafe_bytes) for r in pts if r.tf_memsafe_bytes]
            if tf_pts:
                ax_fp.plot(*zip(*tf_pts), "-o", color=c, ms=4, label=f"tf_memsafe, M = {v}")
            pred_pts = [(r.n, r.predict_bytes) for r in pts if r.predict_bytes]
            if pred_pts:
                ax_fp.plot(*zip(*pred_pts), ":^", color=c, ms=4, lw=1, label=f"tf_memsafe predictions, M = {v}")
            naive_pts = [(r.n, r.naive_bytes) for r in pts if r.naive_bytes]
            if naive_pts:
                ax_fp.plot(*zip(*naive_pts), "--", color=c, lw=1)
                for source, face in (("measured", c), ("model", "none")):
                    sel = [(r.n, r.naive_bytes) for r in pts if r.naive_bytes and r.naive_source == source]
                    if sel:
                        ax_fp.plot(*zip(*sel), "s", color=c, mfc=face, ms=5, ls="none",
                                   label=f"naive ({source}), M = {v}")
            for attr, style, label in (("tf_memsafe_s", "-o", "tf_memsafe"), ("naive_s", "--s", "naive")):
                t_pts = [(r.n, getattr(r, attr)) for r in pts if getattr(r, attr)]
                if t_pts:
                    ax_t.plot(*zip(*t_pts), style, color=c, ms=4, label=f"{label}, M = {v}")
        ax_fp.axhline(limit, color="tab:red", ls=":", lw=1.2, label=f"limit {m.fmt_bytes(limit)}")
        for ax, attr, naive_attr, label in ((ax_rmse, "rmse", "naive_rmse", "test RMSE"),
                                            (ax_nlpd, "nlpd", "naive_nlpd", "test NLPD")):
            for v in ns:
                pts = sorted((r.m, getattr(r, attr)) for r in mine if r.n == v and getattr(r, attr) is not None)
                if pts:
                    ax.plot(*zip(*pts), "-o", color=colour_n[v], ms=4, label=f"N = {m.fmt_n(v)}")
                naive = sorted((r.m, getattr(r, naive_attr)) for r in mine
                                if r.n == v and getattr(r, naive_attr) is not None)
                if naive:
                    ax.plot(*zip(*naive), "x", color="black", ms=6, ls="none")
            ax.set_xlabel("M (inducing points)", fontsize=8)
            ax.set_ylabel(label + " (standardised)", fontsize=8)
            ax.set_title(f"{kernel}: {label} vs M (x: naive)", fontsize=9)
            if not ax.lines:
                ax.text(0.5, 0.5, "not trained", ha="center", va="center", transform=ax.transAxes)
        for ax, ylabel, name in ((ax_fp, "XLA footprint (bytes)", "footprint"),
                                 (ax_t, "seconds per loss + gradient", "time per evaluation")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("N (training points)", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(f"{kernel}: {name} vs N", fontsize=9)
        for ax in axes[i]:
            ax.tick_params(labelsize=7)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CARRIED = "{} of the {} points were carried over from an earlier run with the same settings (--resume)"


def carried_over(path: str, meta: dict) -> tuple[list[Row], str] | str:
    """The rows of an earlier run at ``path`` made with the same settings (``meta``), less the points
    that failed (measured again), and that run's remark (``--note``: its note less the count of
    carried points); or why they cannot be kept.  No file: no rows."""
    if not os.path.exists(path):
        return [], ""
    with open(path, encoding="utf-8") as f:
        earlier = json.load(f)
    differ = [f"{k} {earlier.get(k)!r} there, {v!r} here" for k, v in meta.items() if earlier.get(k) != v]
    if differ:
        return (f"--resume: {path} was written with other settings ({'; '.join(differ)}): run with its settings, "
                "or write to another --out")
    names = {f.name for f in dataclasses.fields(Row)}
    rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in earlier.get("rows", [])]
    count = re.escape(CARRIED).replace(re.escape("{}"), r"\d+")
    remark = re.sub(f"^{count}(; )?", "", earlier.get("note", ""))
    return [r for r in rows if not r.skipped or r.skipped.startswith("M = ")], remark


def restore(previous: tf_memsafe.Options | None) -> None:
    """Enable tf_memsafe again with ``previous`` options, if it was enabled before ``main``."""
    if previous is None:
        return
    rest = {f.name: getattr(previous, f.name) for f in dataclasses.fields(previous)
            if f.name not in ("memory_limit_bytes", "memory_limit_fraction")}
    limit = previous.memory_limit_bytes
    tf_memsafe.enable(limit if limit is not None else f"{previous.memory_limit_fraction * 100:.12g}%", **rest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = lambda text: int(float(text))
    parser.add_argument("--quick", action="store_true",
                        help="smoke preset: se kernel, N 2000 and 4000, M 50 and 100, limit 3MB, 10 iterations at "
                             "N 2000")
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument("--limit", help="tf_memsafe's memory limit (default 1GB)")
    parser.add_argument("--run-limit", default="8GB", help="run the naive program only if its footprint fits this")
    parser.add_argument("--sizes", nargs="+", type=size, help="N, training points (default 1e4 3e4 1e5 3e5 1e6)")
    parser.add_argument("--inducing", nargs="+", type=int, help="M, inducing points (default 500 1000 2000)")
    parser.add_argument("--kernels", nargs="+", choices=tuple(KERNELS), help="default se matern32 (se with --quick)")
    parser.add_argument("--data", help="a CSV or .npy table, last column the target, instead of the generated one")
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="optimise with L-BFGS and score the test set (at N <= --train-max-n)")
    parser.add_argument("--train-max-n", type=size, help="largest N trained (default 1e4; 2000 with --quick)")
    parser.add_argument("--maxiter", type=int, help="L-BFGS iterations at most (default 50; 10 with --quick)")
    parser.add_argument("--train-hours", type=float,
                        help="stop L-BFGS after this many hours of training (recorded as not converged)")
    parser.add_argument("--repeats", type=int, help="timed calls after the first (default 3; 1 with --quick)")
    parser.add_argument("--test-points", type=size,
                        help="T, test points per size (default: 10 %% of the data set, N / 9); predictions over "
                             "T = 1e6 are the issue's target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true",
                        help="keep the points already in --out's sgpr.json (written with the same settings) and "
                             "measure only the others; results are written after every point either way")
    parser.add_argument("--redo", action="store_true",
                        help="with --resume, measure the points this run names (--sizes x --kernels x --inducing) "
                             "again and keep the rest (after a change to tf_memsafe that affects them)")
    parser.add_argument("--note", help="a remark on how the run was made, written into the JSON's note (an earlier "
                                       "run's remark is kept with --resume unless this replaces it)")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)
    if args.redo and not args.resume:
        parser.error("--redo measures points of an earlier run again: it needs --resume")
    quick = args.quick
    limit = tf_memsafe.parse_memory_limit(args.limit or ("3MB" if quick else "1GB")).resolve(0)
    run_limit = tf_memsafe.parse_memory_limit(args.run_limit).resolve(0)
    sizes = args.sizes or ([2000, 4000] if quick else [10**4, 3 * 10**4, 10**5, 3 * 10**5, 10**6])
    inducing = args.inducing or ([50, 100] if quick else [500, 1000, 2000])
    kernels = args.kernels or (["se"] if quick else list(KERNELS))
    settings = Settings(limit=limit, run_limit=run_limit, repeats=args.repeats or (1 if quick else 3),
                        train=args.train, train_max_n=args.train_max_n or (2000 if quick else 10**4),
                        maxiter=args.maxiter or (10 if quick else 50), seed=args.seed,
                        train_hours=args.train_hours)

    import gpflow
    from tqdm import tqdm

    tf.get_logger().setLevel("ERROR")   # a fresh trace per point is the point, not a mistake
    if args.data:
        loaded = load_table(args.data)
        data = os.path.basename(args.data)
        source = f"{args.data}: {loaded.shape[0]} rows x {loaded.shape[1]} columns"
        cap = largest_train(len(loaded), args.test_points)
        sizes = sorted({min(n, cap) for n in sizes})
        tables = lambda n: loaded
    else:
        data, source = "road_network", (f"road_network(seed={args.seed}): generated, N + "
                                        f"{args.test_points or 'N/9'} rows per size")
        tables = lambda n: road_network(n + (args.test_points or held_out_rows(n)), args.seed)
    sizes = sorted(set(sizes))
    stem = os.path.join(args.out, "sgpr")
    meta = {"quick": quick, "limit_bytes": limit, "run_limit_bytes": run_limit, "data": source, "seed": args.seed,
            "maxiter": settings.maxiter, "train_hours": settings.train_hours,
            "train_max_n": settings.train_max_n if settings.train else 0, "repeats": settings.repeats,
            "test_points": args.test_points}
    earlier = carried_over(stem + ".json", meta) if args.resume else ([], "")
    if isinstance(earlier, str):
        parser.error(earlier)
    rows, remark = earlier
    if args.redo:
        rows = [r for r in rows if not (r.n in sizes and r.kernel in kernels and r.m in inducing)]
    remark = args.note if args.note is not None else remark if rows else ""
    carried = len(rows)
    done = {(r.kernel, r.n, r.m) for r in rows}
    order = lambda r: (r.n, kernels.index(r.kernel) if r.kernel in kernels else len(kernels), r.m)

    def write() -> None:
        rows.sort(key=order)
        note = joined(CARRIED.format(carried, len(rows)) if carried else "", remark)
        m.write_outputs(rows, Row, stem, {**m.machine(), **meta, "tolerances": TOLERANCES, "reach": reach(rows),
                                         **({"note": note} if note else {})})

    previous = tf_memsafe.get_options() if tf_memsafe.is_enabled() else None
    tf_memsafe.disable()   # the naive programs must be traced as written; each point enables it for itself
    todo = [(n, kernel, m_inducing) for n in sizes for kernel in kernels for m_inducing in inducing
            if (kernel, n, m_inducing) not in done]
    try:
        with gpflow.config.as_context(gpflow.config.Config(float=np.float64, jitter=1e-6)), \
                tqdm(total=len(todo), desc="sgpr") as bar:
            for n in sorted({n for n, _, _ in todo}):
                split = prepare(tables(n), n, args.seed, args.test_points)
                for _, kernel, m_inducing in [t for t in todo if t[0] == n]:
                    bar.set_postfix_str(f"{kernel} N={m.fmt_n(n)} M={m_inducing}")
                    rows.append(measure(split, data, kernel, m_inducing, settings))
                    write()                # a sweep stopped part-way keeps its points (see --resume)
                    gc.collect()
                    bar.update()
                del split
                gc.collect()
    finally:
        restore(previous)
    write()
    plot(rows, stem + ".png", limit,
         f"GPflow SGPR (float64, ARD) on {data}: tf_memsafe limit {m.fmt_bytes(limit)}; XLA:CPU, "
         f"{os.cpu_count()} cores")
    print(table(rows, limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
