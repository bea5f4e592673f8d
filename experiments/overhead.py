"""Cost of the splitter: its overhead where the program fits, and its speed beyond the limit.

    python -m experiments.overhead [--quick] [--out experiments/results] [--repeats 7] [--workloads ...]
        [--modes forward training]

Workloads (float32, each a plain Python function of tensors, compiled with ``jit_compile=True``;
``D(x, y)`` is the [N, M] matrix of squared distances written the naive way,
``sum((x[:, None] - y[None])**2, -1)``):

* ``knn``: ``top_k(-D(q, p), 10).indices``, d = 3;
* ``kernel_matvec``: ``exp(-D(x, y) / 2) @ v``, d = 3, v: [M, 4];
* ``logsumexp``: ``reduce_logsumexp(-D(x, y), axis=1)``, d = 3;
* ``attention``: ``softmax(q k^T / 8) v``, d = 64;
* ``causal_attention``: the same with ``band_part`` and ``where`` masking the upper triangle;
* ``matrix_chain``: ``(A B) v`` with A [N, 64], B [64, N], v [N, 4], written left to right: the
  [N, N] product first.  ``matrix_chain`` reorders it to ``A (B v)`` whether or not the program fits
  (it cuts the FLOPs by far more than ``chain_order.FLOP_MARGIN``): the ``fits`` case shows what
  such a rewrite does to a program that fits (issue 29: it must never slow one down).

Each runs in two modes (``--modes``, default both):

* ``forward``: the function above;
* ``training``: a whole training step, as in ``tests/integration/test_training_steps.py``: one
  ``tf.function(jit_compile=True)`` computing a loss built on the workload's function, its
  gradients with a ``GradientTape`` inside, and a ``tf_keras`` Adam update (learning rate 0.01; the
  optimizer is built before tracing).  The losses: ``kernel_matvec``, kernel regression
  ``mean((kernel_matvec(x / l, z / l, w) - y)**2)`` with trainable lengthscales l [3], inducing
  inputs z [M, 3] and weights w [M, 4]; ``logsumexp``, InfoNCE over all pairs with logits
  ``-D(a, b)``, ``a = x P``, ``b = y P`` and a trainable projection P [3, 3] (``mean(logsumexp(a, b) +
  |a - b|^2)``); ``attention`` and ``causal_attention``, ``mean((attention(x Wq, x Wk, x Wv) - t)**2)``
  with trainable Wq, Wk, Wv [64, 64].  kNN has no training mode (``top_k``'s indices have no
  gradient).

Sizes make the naive program's XLA footprint ("Total bytes used") 100-400 MB.  Three cases each:

* ``fits``: limit = 2 x the naive footprint.  The splitter must leave the program alone (the
  number of rewrites, from ``tf_memsafe``'s reports, is recorded); the median time of the
  tf_memsafe-enabled function over the naive one is the overhead (target <= 1.05 forward, <= 1.10
  for a training step);
* ``limit/10`` and ``limit/100``: limit = 1/10 and 1/100 of the naive footprint.  Recorded: the
  rewritten program's footprint and whether it is within the limit, and its median time against
  a hand-written loop over row chunks (``jit_compile=True``) with the chunk the splitter chose, read
  from its record ("... 38 x 520 + 240 of 20000": steps x chunk + tail of length).  If that cannot
  be read, or the hand-written loop over those chunks does not fit the limit (the splitter's loop
  can need less: kernel regression's step at 1/10, 1.1 MB against 4.2 MB over 5 chunks of 200),
  the hand-written loop takes a smaller chunk that makes it fit the limit (the largest of those
  tried: chunk counts growing by 1.5 x, or from the splitter's by 1.1 x), or if none fits, the
  splitter's chunk over the limit (the note says so).  Target:
  hand / rewritten >= 0.95.  Forward, the loop is a ``tf.while_loop`` writing each chunk's result
  to a ``TensorArray``, concatenated.  Training, it is gradient accumulation: a ``tf.while_loop``
  whose body computes one chunk's share of the loss and its gradients (a ``GradientTape`` inside
  the body), summed over the chunks, then one Adam update.  A limit below the bytes of the
  arguments and the result (``floor``; training: also the variables and Adam's moments) cannot be
  met by any loop over rows: the row says so instead of timing anything.

Every timed function is run once to compile and warm up; then the naive, rewritten and
hand-written functions are called in turn (interleaved, one process; each round in the next of
their orders, so that none always runs right after the naive program), ``--repeats`` times each,
and the median is kept.  A training step's variables and Adam's state are reset to the same
initial values before every call (outside the timed region), so every call does the same work.
The naive program is run only when it fits ``--run-limit`` (default 4 GB).  Each rewritten and
hand-written result is compared with the naive one (``err_*``: largest absolute difference over
the largest magnitude; for kNN, the share of indices that differ; for a training step, the worst
such figure over two steps from the initial state: their losses, i.e. the loss before and after
the first step, and the variables and Adam's moments after them).  Results go to
``overhead.csv``, ``overhead.json`` and ``overhead.png`` in ``--out``; timings are of this machine
and are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tf_keras as keras

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments._results import OUT_HELP, results_dir, write_outputs
from grappler_ext.pipeline import DEFAULT_ORDER
from grappler_ext.splitter import LoopPlan
from tf_memsafe import hook

TARGET_OVERHEAD = 1.05      # enabled / naive where the program fits
TARGET_OVERHEAD_TRAINING = 1.10   # the same for a whole training step
TARGET_SPEED = 0.95         # hand-written / rewritten beyond the limit
FRACTIONS = (10, 100)       # limits of 1/10 and 1/100 of the naive footprint
MODES = ("forward", "training")
LEARNING_RATE = 1e-2


@dataclasses.dataclass
class Workload:
    name: str
    fn: Callable          # the naive program: a Python function of tensors
    rows_fn: Callable     # rows_fn(x_rows, first_row, *rest): the result's rows for rows of args[0]
    args: tuple           # NumPy arrays; the hand-written loop slices the rows of args[0]
    note: str
    dtype: tf.DType = tf.float32   # of the result
    mode = "forward"

    def hand(self, chunk: int, steps: int, tail: int) -> Callable:
        """The hand-written loop over ``steps`` chunks of ``chunk`` rows of ``args[0]``, then ``tail`` rows."""
        return hand_chunked(self.rows_fn, self.dtype, chunk, steps, tail)

    def reset(self) -> None:
        """Nothing to reset: the function has no state."""

    def outcome(self, fn: Callable, args) -> np.ndarray:
        """What is compared with the naive program: the result (this call compiles ``fn``)."""
        return fn(*args).numpy()

    def state_bytes(self) -> int:
        return 0


@dataclasses.dataclass(eq=False)
class TrainingWorkload:
    """A training step: ``loss``'s gradients (tape inside) and an Adam update of ``variables``.

    The variables and the optimizer (built here, before any trace) are shared by the naive,
    rewritten and hand-written steps; :meth:`reset` puts them all back to their initial values.
    """

    name: str
    loss: Callable        # loss(variables, *inputs): the naive loss, a scalar
    rows_loss: Callable   # rows_loss(variables, first, rows, inputs): the share of the loss of rows
                          # [first, first + C) (rows: those of the first ``row_args`` inputs; inputs: all)
    row_args: int
    args: tuple           # NumPy arrays; the hand-written loop slices the rows of the first ``row_args``
    initial: tuple        # NumPy arrays: the variables' initial values
    note: str
    mode = "training"

    def __post_init__(self):
        self.variables = [tf.Variable(value, name=f"v{i}") for i, value in enumerate(self.initial)]
        self.optimizer = keras.optimizers.Adam(LEARNING_RATE)
        self.optimizer.build(self.variables)
        self.state = self.variables + list(self.optimizer.variables())   # what a step changes
        self.start = [v.numpy() for v in self.state]

        def training_step(*inputs):
            with tf.GradientTape() as tape:
                loss = self.loss(self.variables, *inputs)
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.variables), self.variables))
            return loss

        self.fn = training_step

    def hand(self, chunk: int, steps: int, tail: int) -> Callable:
        """Hand-written gradient accumulation over ``steps`` chunks of ``chunk`` rows, then ``tail`` rows."""
        return hand_training_step(self, chunk, steps, tail)

    def reset(self) -> None:
        for v, value in zip(self.state, self.start):
            v.assign(value)

    def outcome(self, fn: Callable, args) -> list[np.ndarray]:
        """Two steps from the initial state (the first compiles ``fn``): their losses, then the state."""
        self.reset()
        losses = [fn(*args).numpy(), fn(*args).numpy()]    # the loss before and after the first step
        return losses + [v.numpy() for v in self.state]

    def state_bytes(self) -> int:
        return sum(value.nbytes for value in self.start)


@dataclasses.dataclass
class Row:
    workload: str
    case: str                           # "fits", "limit/10", "limit/100"
    size: str
    limit_bytes: int
    naive_bytes: int                    # XLA footprint of the program as written
    rewritten_bytes: int                # ... with tf_memsafe enabled at limit_bytes
    within_limit: bool
    status: str                         # tf_memsafe's report on the timed trace: "unchanged", "rewritten", ...
    rewrites: int                       # rewritten records in the reports of the timed trace
    floor_bytes: int                    # arguments + result (+ variables and Adam's moments): no loop over
                                        # rows goes below this
    split: str                          # the splitter's record ("" if it did not split)
    hand_chunk: int | None              # rows per step of the hand-written loop
    hand_steps: int | None
    hand_tail: int | None
    hand_chunk_source: str              # "splitter", "fallback" or "" (no hand-written loop)
    hand_bytes: int | None
    naive_trace_s: float                # tracing the naive function (tf_memsafe's passes off)
    rewritten_trace_s: float            # tracing it with tf_memsafe at limit_bytes (the passes' own cost)
    naive_s: float | None               # medians over interleaved runs
    rewritten_s: float | None
    hand_s: float | None
    ratio_vs_naive: float | None        # rewritten_s / naive_s ("fits": the overhead)
    speed_vs_hand: float | None         # hand_s / rewritten_s (beyond the limit)
    err_rewritten: float | None         # against the naive result (see the module docstring)
    err_hand: float | None
    warnings: str                       # warnings raised while tracing and measuring the rewritten function
    note: str
    mode: str = "forward"               # "forward" or "training" (a whole Adam step); absent in older results
    naive_first_s: float | None = None  # the first call: trace + compile + first run (naive: passes off)
    rewritten_first_s: float | None = None  # ... with tf_memsafe at limit_bytes (its trace runs the passes)


# ---------------------------------------------------------------- workloads


def sq_dist(x, y):
    return tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), axis=-1)   # [N, M]


def knn(q, p):
    return tf.math.top_k(-sq_dist(q, p), k=10).indices                          # [N, 10]


def knn_rows(q, first, p):
    del first
    return knn(q, p)                                                            # [C, 10]


def matrix_chain(a, b, v):
    return (a @ b) @ v                                                   # [N, N] first, as written


def matrix_chain_rows(a, first, b, v):
    return (a @ b) @ v


def kernel_matvec(x, y, v):
    return tf.matmul(tf.exp(-0.5 * sq_dist(x, y)), v)                           # [N, 4]


def kernel_matvec_rows(x, first, y, v):
    del first
    return kernel_matvec(x, y, v)                                               # [C, 4]


def logsumexp(x, y):
    return tf.reduce_logsumexp(-sq_dist(x, y), axis=1)                          # [N]


def logsumexp_rows(x, first, y):
    del first
    return logsumexp(x, y)                                                      # [C]


def attention(q, k, v):
    scores = tf.matmul(q, k, transpose_b=True) / 8.0                            # [N, M]
    return tf.matmul(tf.nn.softmax(scores, axis=-1), v)                         # [N, 64]


def attention_rows(q, first, k, v):
    del first
    return attention(q, k, v)                                                   # [C, 64]


def causal_attention(q, k, v):
    scores = tf.matmul(q, k, transpose_b=True) / 8.0                            # [N, M]
    lower = tf.linalg.band_part(tf.ones_like(scores), -1, 0)                    # 1 where m <= n
    scores = tf.where(lower > 0, scores, tf.fill(tf.shape(scores), -1e9))
    return tf.matmul(tf.nn.softmax(scores, axis=-1), v)                         # [N, 64]


def causal_attention_rows(q, first, k, v):
    scores = tf.matmul(q, k, transpose_b=True) / 8.0                            # [C, M]
    rows = first + tf.range(tf.shape(q)[0])                                     # global row numbers
    lower = tf.range(tf.shape(k)[0])[None, :] <= rows[:, None]                  # [C, M]: m <= n
    scores = tf.where(lower, scores, tf.fill(tf.shape(scores), -1e9))
    return tf.matmul(tf.nn.softmax(scores, axis=-1), v)                         # [C, 64]


# ---------------------------------------------------------------- training losses
# Each is a mean over rows of its first input; its ``_rows`` twin gives the share of rows
# [first, first + C) of that mean (their sum over all chunks is the loss), for the hand-written step.


def kernel_regression(variables, x, y):
    lengthscales, z, w = variables                                              # [D], [M, D], [M, 4]
    return tf.reduce_mean(tf.square(kernel_matvec(x / lengthscales, z / lengthscales, w) - y))


def kernel_regression_rows(variables, first, rows, inputs):
    lengthscales, z, w = variables
    (x, y), n = rows, inputs[0].shape[0]
    fit = kernel_matvec_rows(x / lengthscales, first, z / lengthscales, w)     # [C, 4]
    return tf.reduce_sum(tf.square(fit - y)) / (n * y.shape[1])


def info_nce(variables, x, y):
    """-log softmax_j(-D(a, b))_ii averaged over i: logsumexp_j(-D(a, b)_ij) + |a_i - b_i|^2."""
    (projection,) = variables                                                   # [D, D]
    a, b = x @ projection, y @ projection                                       # [N, D] each
    return tf.reduce_mean(logsumexp(a, b) + tf.reduce_sum(tf.square(a - b), -1))


def info_nce_rows(variables, first, rows, inputs):
    (projection,) = variables
    (x, y_rows), (_, y), n = rows, inputs, inputs[0].shape[0]
    a, a_pair, b = x @ projection, y_rows @ projection, y @ projection          # [C, D], [C, D], [N, D]
    return tf.reduce_sum(logsumexp_rows(a, first, b) + tf.reduce_sum(tf.square(a - a_pair), -1)) / n


def attention_mse(attend):
    """MSE of ``attend(x Wq, x Wk, x Wv)`` against a target, with trainable Wq, Wk, Wv."""
    def loss(variables, x, target):
        w_q, w_k, w_v = variables                                               # [d, d] each
        return tf.reduce_mean(tf.square(attend(x @ w_q, x @ w_k, x @ w_v) - target))

    return loss


def attention_mse_rows(attend_rows):
    def rows_loss(variables, first, rows, inputs):
        w_q, w_k, w_v = variables
        (x_rows, target), x = rows, inputs[0]
        out = attend_rows(x_rows @ w_q, first, x @ w_k, x @ w_v)                # [C, d]
        return tf.reduce_sum(tf.square(out - target)) / (x.shape[0] * x.shape[1])

    return rows_loss


def workloads(quick: bool, modes=MODES) -> list[Workload | TrainingWorkload]:
    """The workloads in ``modes``; full sizes give naive footprints of ~190-310 MiB on XLA:CPU (TF 2.21)."""
    chosen = []
    if "forward" in modes:
        chosen += forward_workloads(quick)
    if "training" in modes:
        chosen += training_workloads(quick)
    return chosen


def forward_workloads(quick: bool) -> list[Workload]:
    """The six forward workloads; full sizes give naive footprints of ~250-300 MB."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    n_dist, n_lse, n_attn, n_causal = (4000, 3000, 2000, 2000) if quick else (8000, 6000, 6000, 8000)
    n_chain = 2000 if quick else 8000
    return [
        Workload("knn", knn, knn_rows, (normal(n_dist, 3), normal(n_dist, 3)),
                 f"N = M = {n_dist}, d = 3, k = 10", tf.int32),
        Workload("kernel_matvec", kernel_matvec, kernel_matvec_rows,
                 (normal(n_dist, 3), normal(n_dist, 3), normal(n_dist, 4)), f"N = M = {n_dist}, d = 3, v: 4 columns"),
        Workload("logsumexp", logsumexp, logsumexp_rows, (normal(n_lse, 3), normal(n_lse, 3)),
                 f"N = M = {n_lse}, d = 3"),
        Workload("attention", attention, attention_rows, tuple(normal(n_attn, 64) for _ in range(3)),
                 f"N = M = {n_attn}, d = 64"),
        Workload("causal_attention", causal_attention, causal_attention_rows,
                 tuple(normal(n_causal, 64) for _ in range(3)), f"N = M = {n_causal}, d = 64"),
        Workload("matrix_chain", matrix_chain, matrix_chain_rows,
                 (normal(n_chain, 64), normal(64, n_chain), normal(n_chain, 4)),
                 f"A: [{n_chain}, 64], B: [64, {n_chain}], v: [{n_chain}, 4]"),
    ]


def training_workloads(quick: bool) -> list[TrainingWorkload]:
    """The four training steps; full sizes give naive footprints of 190-310 MiB (quick: 19-49 MiB)."""
    rng = np.random.default_rng(1)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    n_kernel, n_lse, n_attn = (1000, 1500, 2000) if quick else (4000, 4000, 4000)
    x = normal(n_kernel, 3)
    kernel = TrainingWorkload(
        "kernel_matvec", kernel_regression, kernel_regression_rows, 2, (x, np.sin(x @ normal(3, 4))),
        (rng.uniform(0.5, 1.5, 3).astype(np.float32), normal(n_kernel, 3), normal(n_kernel, 4) / n_kernel),
        f"kernel regression, N = M = {n_kernel}, d = 3, 4 outputs")
    x = normal(n_lse, 3)
    nce = TrainingWorkload(
        "logsumexp", info_nce, info_nce_rows, 2, (x, x + 0.5 * normal(n_lse, 3)),
        (np.eye(3, dtype=np.float32) + 0.1 * normal(3, 3),), f"InfoNCE, N = M = {n_lse}, d = 3")
    attn = [TrainingWorkload(
        name, attention_mse(attend), attention_mse_rows(attend_rows), 2, (normal(n_attn, 64), normal(n_attn, 64)),
        tuple(normal(64, 64) / 8 for _ in range(3)), f"MSE, L = {n_attn}, d = 64")
        for name, attend, attend_rows in (("attention", attention, attention_rows),
                                          ("causal_attention", causal_attention, causal_attention_rows))]
    return [kernel, nce, *attn]


# ---------------------------------------------------------------- the hand-written loop


def hand_chunked(rows_fn: Callable, dtype: tf.DType, chunk: int, steps: int, tail: int) -> Callable:
    """``rows_fn`` over ``steps`` chunks of ``chunk`` rows of the first argument, then ``tail`` rows.

    What a person writes by hand: a ``tf.while_loop`` with ``maximum_iterations``, each step's rows
    written to a ``TensorArray``, concatenated after the loop; the remainder computed once after it.
    """
    def chunked(x, *rest):
        row_shape = x.shape[1:]                                                 # x: [N, ...]

        def body(i, results):
            start = i * chunk
            rows = tf.slice(x, tf.concat([[start], tf.zeros([len(row_shape)], tf.int32)], 0),
                            [chunk, *row_shape])                                # [C, ...]
            return i + 1, results.write(i, rows_fn(rows, start, *rest))

        results = tf.TensorArray(dtype, size=steps, infer_shape=True)
        _, results = tf.while_loop(lambda i, _: i < steps, body, (tf.constant(0), results),
                                   maximum_iterations=steps)
        out = results.concat()                                                  # [steps * C, ...]
        if tail:
            first = steps * chunk
            out = tf.concat([out, rows_fn(x[first:], tf.constant(first), *rest)], axis=0)
        return out

    return chunked


def hand_training_step(w: TrainingWorkload, chunk: int, steps: int, tail: int) -> Callable:
    """``w``'s training step with its gradients accumulated over chunks of rows: what a person writes.

    A ``tf.while_loop`` (``maximum_iterations``) whose body slices ``chunk`` rows of the first
    ``w.row_args`` inputs, computes their share of the loss and its gradients under a tape, and adds
    them to the running sums; the ``tail`` rows once after it; then one Adam update of the sums.
    """
    def share(first, size, inputs):
        """The loss of rows [first, first + size) and its gradients."""
        rows = [tf.slice(x, tf.concat([[first], tf.zeros([x.shape.rank - 1], tf.int32)], 0), [size, *x.shape[1:]])
                for x in inputs[:w.row_args]]                                   # [C, ...] each
        with tf.GradientTape() as tape:
            part = w.rows_loss(w.variables, first, rows, inputs)
        return part, tape.gradient(part, w.variables)

    def step(*inputs):
        def body(i, loss, grads):
            part, part_grads = share(i * chunk, chunk, inputs)
            return i + 1, loss + part, [g + p for g, p in zip(grads, part_grads)]

        zeros = [tf.zeros_like(v) for v in w.variables]
        loss0 = tf.zeros([], w.variables[0].dtype)
        _, loss, grads = tf.while_loop(lambda i, *_: i < steps, body, (tf.constant(0), loss0, zeros),
                                       maximum_iterations=steps)
        if tail:
            part, part_grads = share(tf.constant(steps * chunk), tail, inputs)
            loss, grads = loss + part, [g + p for g, p in zip(grads, part_grads)]
        w.optimizer.apply_gradients(zip(grads, w.variables))
        return loss

    return step


def plan_rows(plan: LoopPlan, n_rows: int) -> tuple[int, int, int]:
    """(chunk, steps, tail) of a loop over the ``n_rows`` rows of argument 0 like the splitter's ``plan``.

    A split of that very axis gives the splitter's chunk exactly; a split of another axis of some
    other length gives as many chunks over the rows (the same number of loop steps).
    """
    if plan.split_input == (0, 0) and plan.length == n_rows:
        return plan.chunk, plan.steps, plan.tail
    count = plan.steps + (plan.tail > 0)
    chunk = math.ceil(n_rows / count)
    return chunk, n_rows // chunk, n_rows % chunk


def fallback_plan(w: Workload | TrainingWorkload, args, limit: int, count: int = 2, growth: float = 1.5,
                  most: int | None = None) -> tuple[int, int, int, int] | None:
    """A large chunk whose hand-written loop fits ``limit``: (chunk, steps, tail, bytes), or ``None``.

    Tries ``count`` chunks, then more (by default 2, 3, 4, 6, 9, ...: each count ``growth`` x the
    last) until XLA's footprint fits, up to ``most`` chunks (default: one row each).
    """
    n = args[0].shape[0]
    tried = None
    while count <= min(n, most or n):
        chunk = math.ceil(n / count)
        if chunk != tried:
            tried, steps, tail = chunk, n // chunk, n % chunk
            footprint = naive_footprint(w.hand(chunk, steps, tail), args)
            if footprint <= limit:
                return chunk, steps, tail, footprint
        count = max(count + 1, int(count * growth))
    return None


# ---------------------------------------------------------------- measuring


def naive_footprint(fn, args) -> int:
    return tf_memsafe.memory_footprint(fn, *args, rewrite=False)


def traced(fn, args, **options) -> tuple[Callable, list, float, str]:
    """``fn`` as a jit tf.function traced now under ``options``: it, its records, seconds taken, hook status."""
    compiled = tf.function(fn, jit_compile=True)
    mark = hook.report_mark()
    start = time.perf_counter()
    with tf_memsafe.options(**options):
        concrete = compiled.get_concrete_function(*args)
    seconds = time.perf_counter() - start
    reports = hook.reports_since(mark)
    mine = [rep for rep in reports if rep.function_name == concrete.graph.name]    # not loop bodies
    status = mine[-1].status if mine else "not seen by tf_memsafe"
    return concrete, [r for rep in reports for r in rep.records], seconds, status


def naive_function(fn, args) -> tuple[Callable, float]:
    """``fn`` traced with every tf_memsafe pass off (the program exactly as written), seconds taken."""
    concrete, _, seconds, _ = traced(fn, args, disabled_passes=frozenset(DEFAULT_ORDER))
    return concrete, seconds


def first_call(fn, args, reset: Callable[[], None]) -> float:
    """Seconds of ``fn``'s first call on ``args`` (XLA compiles it, then it runs), its results read;
    the state is reset before and after (a training step's variables)."""
    reset()
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), fn(*args))
    seconds = time.perf_counter() - start
    reset()
    return seconds


def interleaved_medians(fns: dict[str, Callable | None], args, repeats: int,
                        reset: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds of each function, called in turn ``repeats`` times after a warm-up.

    Round r calls the functions in the r-th of their permutations (cycling): a call right after the
    naive program (which leaves hundreds of MB of freshly touched memory and cold caches behind) is
    measured slower, so every function gets that place equally often.  ``reset`` runs before every
    call, untimed (a training step's variables back to their initial values).
    """
    def run(fn):
        reset()
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn(*args))
        return time.perf_counter() - start

    active = {name: fn for name, fn in fns.items() if fn is not None}
    for fn in active.values():
        run(fn)                                                # compile and warm up
    orders = list(itertools.permutations(active))
    times: dict[str, list[float]] = {name: [] for name in active}
    for round_ in range(repeats):
        for name in orders[round_ % len(orders)]:
            times[name].append(run(active[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def error(result, reference) -> float | None:
    """Largest absolute difference over the largest magnitude (the worst of a list's); integers: share differing."""
    if result is None or reference is None:
        return None
    if isinstance(reference, list):
        return max(error(r, ref) for r, ref in zip(result, reference, strict=True))
    if np.issubdtype(reference.dtype, np.integer):
        return float(np.mean(result != reference))
    scale = float(np.max(np.abs(reference))) or 1.0
    return float(np.max(np.abs(result.astype(np.float64) - reference))) / scale


def hand_plan(w: Workload | TrainingWorkload, args, limit: int,
              split: LoopPlan | None) -> tuple[tuple[int, int, int] | None, str, int | None, str]:
    """The hand-written loop's (chunk, steps, tail), where it comes from, its bytes, and a note.

    The splitter's chunks where the hand-written loop fits the limit with them; else the largest
    smaller chunk that fits (the splitter's loop can need less than a hand-written one over the same
    chunks); else the splitter's, over the limit, or none.
    """
    fmt = tf_memsafe.format_bytes
    plan = plan_rows(split, args[0].shape[0]) if split is not None else None
    if plan is not None:
        footprint = naive_footprint(w.hand(*plan), args)
        if footprint <= limit:
            return plan, "splitter", footprint, ""
    if plan is None:
        found = fallback_plan(w, args, limit)
    else:   # over the limit with the splitter's chunks: more chunks in proportion, then 10 % more at a time
        start = math.ceil((plan[1] + (plan[2] > 0)) * footprint / limit)
        found = fallback_plan(w, args, limit, count=start, growth=1.1, most=4 * start)
    if found is None and plan is None:
        return None, "", None, "no hand-written loop over rows fits the limit"
    if found is None:
        return plan, "splitter", footprint, (f"no hand-written loop over rows fits the limit: the splitter's "
                                             f"chunks, {fmt(footprint)}")
    said = (f"hand-written loop over the splitter's chunks ({plan[1]} x {plan[0]}) over the limit ({fmt(footprint)}): "
            "a smaller chunk that fits" if plan is not None else "")
    return found[:3], "fallback", found[3], said


def measure(w: Workload | TrainingWorkload, case: str, limit: int, run_limit: int, repeats: int,
            naive_bytes: int) -> Row:
    args = tuple(tf.constant(a) for a in w.args)
    naive, naive_trace_s = naive_function(w.fn, args)
    with warnings.catch_warnings(record=True) as caught:  # the pipeline warns when it cannot fit the limit
        warnings.simplefilter("always")
        rewritten, records, trace_s, status = traced(w.fn, args, memory_limit=limit)
        with tf_memsafe.options(memory_limit=limit):
            rewritten_bytes = tf_memsafe.memory_footprint(w.fn, *args)
    rewrites = [r for r in records if r.action == "rewritten"]
    splits = [r for r in rewrites if r.pass_name == "splitter"]
    split = next((r for r in splits if isinstance(r.plan, LoopPlan)), splits[0] if splits else None)  # with a plan
    floor = (sum(a.nbytes for a in w.args) + w.state_bytes()
             + sum(t.shape.num_elements() * t.dtype.size for t in rewritten.outputs))
    plan, source, hand, hand_bytes, notes = None, "", None, None, []
    if floor > limit:
        held = "arguments, variables, Adam's moments and result" if w.state_bytes() else "arguments + result"
        notes.append(f"infeasible: {held} ({tf_memsafe.format_bytes(floor)}) exceed the limit")
    elif case != "fits":
        plan, source, hand_bytes, said = hand_plan(w, args, limit, split.plan if split is not None else None)
        notes += [said] if said else []
        if plan is not None:
            hand = naive_function(w.hand(*plan), args)[0]
    if case != "fits" and not rewrites:
        said = next((str(c.message).splitlines()[0][:300] for c in caught), "")   # a failed pass leaves no record
        notes.append("not rewritten: " + (records[0].reason if records else said or "no record"))
    if naive_bytes > run_limit:
        naive = None
        notes.append(f"naive not run: footprint over --run-limit {tf_memsafe.format_bytes(run_limit)}")
    # Where the naive program fits, the enabled function is timed even unchanged: that is the overhead.
    fns = {"naive": naive, "rewritten": rewritten if rewrites or case == "fits" else None, "hand": hand}
    first = {name: first_call(fn, args, w.reset) for name, fn in fns.items() if fn is not None}   # compiles
    results = {name: w.outcome(fn, args) for name, fn in fns.items() if fn is not None}
    times = interleaved_medians(fns, args, repeats, w.reset)
    naive_s, rewritten_s, hand_s = times.get("naive"), times.get("rewritten"), times.get("hand")
    reference = results.get("naive")
    return Row(
        workload=w.name, case=case, size=w.note, limit_bytes=limit, naive_bytes=naive_bytes,
        rewritten_bytes=rewritten_bytes, within_limit=rewritten_bytes <= limit, status=status,
        rewrites=len(rewrites),
        floor_bytes=floor, split=split.reason if split is not None else "",
        hand_chunk=plan[0] if plan else None, hand_steps=plan[1] if plan else None,
        hand_tail=plan[2] if plan else None, hand_chunk_source=source, hand_bytes=hand_bytes,
        naive_trace_s=naive_trace_s, rewritten_trace_s=trace_s,
        naive_first_s=naive_trace_s + first["naive"] if "naive" in first else None,
        rewritten_first_s=trace_s + first["rewritten"] if "rewritten" in first else None,
        naive_s=naive_s, rewritten_s=rewritten_s, hand_s=hand_s,
        ratio_vs_naive=rewritten_s / naive_s if rewritten_s and naive_s else None,
        speed_vs_hand=hand_s / rewritten_s if hand_s and rewritten_s else None,
        err_rewritten=error(results.get("rewritten"), reference), err_hand=error(results.get("hand"), reference),
        warnings=" | ".join(dict.fromkeys(str(c.message) for c in caught)), note="; ".join(notes), mode=w.mode)


# ---------------------------------------------------------------- output


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys((r.workload, r.mode) for r in rows))
    by = {(r.workload, r.mode, r.case): r for r in rows}
    xs = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(max(13, 1.3 * len(names) + 5), 4.8))

    fits = [by.get((*n, "fits")) for n in names]
    colors = ["tab:orange" if mode == "training" else "tab:blue" for _, mode in names]
    bars = axes[0].bar(xs, [r.ratio_vs_naive or 0.0 if r else 0.0 for r in fits], 0.6, color=colors)
    axes[0].bar_label(bars, fmt="%.3f", fontsize=8)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].axhline(TARGET_OVERHEAD, color="tab:red", ls="--", lw=1, label=f"target {TARGET_OVERHEAD} (forward)")
    if any(mode == "training" for _, mode in names):
        axes[0].axhline(TARGET_OVERHEAD_TRAINING, color="tab:red", ls=":", lw=1,
                        label=f"target {TARGET_OVERHEAD_TRAINING} (training step)")
    axes[0].set_ylabel("median time, enabled / naive")
    axes[0].set_title("where the naive program fits (limit = 2 x its footprint)")

    width = 0.8 / len(FRACTIONS)
    for i, frac in enumerate(FRACTIONS):
        sel = [by.get((*n, f"limit/{frac}")) for n in names]
        heights = [r.speed_vs_hand or 0.0 if r else 0.0 for r in sel]
        pos = xs - 0.4 + width * (i + 0.5)
        bars = axes[1].bar(pos, heights, width, label=f"limit = footprint / {frac}")
        axes[1].bar_label(bars, labels=[f"{h:.2f}" if h else "" for h in heights], fontsize=8)
        for x, r in zip(pos, sel):
            if r is not None and r.speed_vs_hand is None:
                label = "infeasible" if r.floor_bytes > r.limit_bytes else "n/a"
                axes[1].text(x, 0.02, label, ha="center", va="bottom", fontsize=8, rotation=90)
    axes[1].axhline(TARGET_SPEED, color="tab:red", ls="--", lw=1, label=f"target {TARGET_SPEED}")
    axes[1].set_ylabel("speed vs hand-written loop (hand / rewritten time)")
    axes[1].set_title("beyond the limit: splitter vs hand-written chunked loop")
    labels = [name if mode == "forward" else f"{name}\n(training step)" for name, mode in names]
    for ax in axes:
        ax.set_xticks(xs, labels, rotation=15, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("tf_memsafe splitter: overhead and speed (XLA:CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[Row]) -> str:
    fmt = tf_memsafe.format_bytes

    def ms(s):
        return f"{s * 1e3:.1f}" if s is not None else "-"

    def ratio(x):
        return f"{x:.3f}" if x is not None else "-"

    head = (f"{'workload':17} {'mode':8} {'case':9} {'before':>9} {'after':>9} {'limit':>9} {'within':6} {'rw':>2} "
            f"{'chunks':>13} {'naive ms':>9} {'tfms ms':>9} {'hand ms':>9} {'tfms/naive':>10} {'hand/tfms':>9} "
            f"{'1st naive s':>11} {'1st tfms s':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        chunks = (f"{r.hand_steps}x{r.hand_chunk}" + (f"+{r.hand_tail}" if r.hand_tail else "")
                  if r.hand_chunk else "-")
        lines.append(f"{r.workload:17} {r.mode:8} {r.case:9} {fmt(r.naive_bytes):>9} {fmt(r.rewritten_bytes):>9} "
                     f"{fmt(r.limit_bytes):>9} {'yes' if r.within_limit else 'NO':6} {r.rewrites:>2} {chunks:>13} "
                     f"{ms(r.naive_s):>9} {ms(r.rewritten_s):>9} {ms(r.hand_s):>9} "
                     f"{ratio(r.ratio_vs_naive):>10} {ratio(r.speed_vs_hand):>9} "
                     f"{ratio(r.naive_first_s):>11} {ratio(r.rewritten_first_s):>10}")
        if r.note:
            lines.append(f"{'':17} {'':8} note: {r.note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and 2 repeats, for a smoke run")
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument("--repeats", type=int, help="timed calls of each function (default 7; 2 with --quick)")
    parser.add_argument("--run-limit", default="4GB", help="run the naive program only if it fits this")
    parser.add_argument("--workloads", nargs="*", help="names of the workloads to run (default: all)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="forward functions, whole training steps, or both (default)")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)
    repeats = args.repeats or (2 if args.quick else 7)
    run_limit = tf_memsafe.parse_memory_limit(args.run_limit).resolve(0)

    from tqdm import tqdm

    tf.get_logger().setLevel("ERROR")  # fresh traces per case are the point, not a mistake
    every = workloads(args.quick, MODES)
    chosen = [w for w in every if w.mode in args.modes and (not args.workloads or w.name in args.workloads)]
    unknown = set(args.workloads or ()) - {w.name for w in every}
    if unknown:
        parser.error(f"unknown workload(s) {sorted(unknown)}")
    tf_memsafe.enable("1TB")  # each case sets its own limit in an options() scope
    rows = []
    with tqdm(total=len(chosen) * (1 + len(FRACTIONS)), desc="overhead") as bar:
        for w in chosen:
            naive_bytes = naive_footprint(w.fn, tuple(tf.constant(a) for a in w.args))
            cases = [("fits", 2 * naive_bytes)] + [(f"limit/{f}", naive_bytes // f) for f in FRACTIONS]
            for case, limit in cases:
                bar.set_postfix_str(f"{w.name} {w.mode} {case}")
                rows.append(measure(w, case, limit, run_limit, repeats, naive_bytes))
                bar.update()
    stem = os.path.join(args.out, "overhead")
    write_outputs(rows, Row, stem, {"tensorflow": tf.__version__, "repeats": repeats, "quick": args.quick,
                                    "targets": {"ratio_vs_naive_max": TARGET_OVERHEAD,
                                                "ratio_vs_naive_max_training": TARGET_OVERHEAD_TRAINING,
                                                "speed_vs_hand_min": TARGET_SPEED}})
    plot(rows, stem + ".png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
