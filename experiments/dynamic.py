"""Loops along a dimension known only at run time against loops planned for each static shape.

    python -m experiments.dynamic [--quick] [--out experiments/results] [--repeats 7]

A function traced with ``input_signature=[tf.TensorSpec([None, 3])]`` (one trace, rewritten once,
compiled by XLA for each concrete shape it is called with) against the same function traced for
each shape (``TensorSpec([n, 3])``: a trace, a rewrite and a compile per shape), both under the same
limit, and the naive function (XLA as written) where it fits.  Workloads (float32, d = 3, M points):

* ``kernel_matvec``: ``exp(-D(q, p) / 2) @ v`` with ``D`` the [n, M] squared distances written the
  naive way and ``v`` [M, 4]: a loop along the queries joins its [c, 4] slices;
* ``kernel_regression``: one training step, ``mean((kernel_matvec(q / l, p / l, v) - y)**2)`` with
  its gradients for the lengthscales ``l`` [3] and the weights ``v`` [M, 4] (a tape inside) -- what
  Keras' ``fit`` traces on a ``tf.data`` pipeline whose last batch is short.

Per n: XLA's figure ("Total bytes used") of each program, whether it is within the limit, and the
median time of a call over ``--repeats`` calls, the methods interleaved; and once per workload, the
first call's time (trace, rewrite and compile) of the dynamic trace at its first n and of each
static trace.  The machine runs nothing else while it is timed (results say how it was run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments._results import OUT_HELP, machine_meta, max_rel_diff, results_dir, write_outputs

LIMIT = 20_000_000
M = 20_000
SIZES = (1_000, 4_099, 20_000)
QUICK_SIZES = (300, 1_001)
QUICK_M = 4_000
QUICK_LIMIT = 2_000_000


@dataclasses.dataclass
class Row:
    workload: str
    n: int
    method: str               # "naive", "static" (a trace per shape), "dynamic" (one [None, 3] trace)
    xla_bytes: int
    within_limit: bool
    first_call_s: float       # the first call at this n: trace + rewrite + compile (dynamic: a compile only,
                              # after its first n)
    median_s: float
    max_rel_diff: float       # against the naive function (the static split where naive is not run): the
                              # largest difference over the largest magnitude, per output


def _workloads(m: int):
    rng = np.random.default_rng(0)
    points = tf.constant(rng.random((m, 3), dtype=np.float32))
    weights = tf.Variable(rng.standard_normal((m, 4)).astype(np.float32))
    scales = tf.Variable(np.full([3], 0.3, np.float32))

    def sq_dist(a, b):
        return tf.reduce_sum(tf.square(a[:, None, :] - b[None]), -1)

    def kernel_matvec(q):
        return tf.exp(-sq_dist(q, points) / 2) @ weights

    def kernel_regression(q):
        target = tf.sin(q[:, :1] * 3.0) * tf.ones([1, 4])
        with tf.GradientTape() as tape:
            pred = tf.exp(-sq_dist(q / scales, points / scales) / 2) @ weights
            loss = tf.reduce_mean(tf.square(pred - target))
        return (loss,) + tuple(tape.gradient(loss, [scales, weights]))

    return {"kernel_matvec": kernel_matvec, "kernel_regression": kernel_regression}


def _flat(out) -> list[np.ndarray]:
    return [np.asarray(x) for x in tf.nest.flatten(out)]


def _timed(fn, q) -> float:
    start = time.perf_counter()
    out = fn(q)
    _flat(out)
    return time.perf_counter() - start


def run(sizes, m: int, repeats: int, limit: int = LIMIT) -> list[Row]:
    rows: list[Row] = []
    for name, body in _workloads(m).items():
        tf_memsafe.enable(limit)
        try:
            dynamic = tf.function(body, jit_compile=True, input_signature=[tf.TensorSpec([None, 3])])
            statics = {n: tf.function(body, jit_compile=True, input_signature=[tf.TensorSpec([n, 3])])
                       for n in sizes}
            queries = {n: tf.constant(np.random.default_rng(n).random((n, 3), dtype=np.float32)) for n in sizes}
            first = {}
            for n in sizes:
                first[("dynamic", n)] = _timed(dynamic, queries[n])
                first[("static", n)] = _timed(statics[n], queries[n])
            figures = {(meth, n): tf_memsafe.memory_footprint(fn, tf.TensorSpec([n, 3]))
                       for n in sizes for meth, fn in (("dynamic", dynamic), ("static", statics[n]))}
        finally:
            tf_memsafe.disable()
        naive = tf.function(body, jit_compile=True)
        for n in sizes:
            q = queries[n]
            naive_bytes = tf_memsafe.memory_footprint(body, tf.TensorSpec([n, 3]), rewrite=False)
            methods = {"dynamic": dynamic, "static": statics[n]}
            if naive_bytes <= 4 * limit:          # the naive program at this size is timed only where it is small
                first[("naive", n)] = _timed(naive, q)
                methods["naive"] = naive
                figures[("naive", n)] = naive_bytes
            reference = naive(q) if "naive" in methods else statics[n](q)
            times = {meth: [] for meth in methods}
            for _ in range(repeats):                 # interleaved: each round calls every method once
                for meth, fn in methods.items():
                    times[meth].append(_timed(fn, q))
            for meth, fn in methods.items():
                rows.append(Row(name, n, meth, figures[(meth, n)], figures[(meth, n)] <= limit,
                                round(first[(meth, n)], 3), round(statistics.median(times[meth]), 4),
                                max_rel_diff(fn(q), reference)))
                print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    sizes, m, limit = (QUICK_SIZES, QUICK_M, QUICK_LIMIT) if args.quick else (SIZES, M, LIMIT)
    rows = run(sizes, m, 2 if args.quick else args.repeats, limit)
    out = results_dir(args.out, args.quick)
    meta = {"limit_bytes": limit, "points": m, "repeats": args.repeats, "quick": args.quick,
            **machine_meta(),
            "how": "run alone on the machine; methods interleaved per round; median of the rounds"}
    write_outputs(rows, Row, os.path.join(out, "dynamic"), meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
