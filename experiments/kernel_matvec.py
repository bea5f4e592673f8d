"""Kernel matrix-vector products K(x, y) @ v: naive XLA, tf_memsafe, a hand-written loop, KeOps and NumPy.

    python -m experiments.kernel_matvec [--quick] [--out experiments/results] [--limit 1GB] [--run-limit 8GB]
        [--sizes 1e4 1e5 1e6] [--rows 10000] [--dims 3 10 100] [--kernels gaussian matern32]
        [--data uniform clustered] [--methods naive tf_memsafe hand keops numpy] [--time-budget 60]

``x``: [rows, d] (the rows of the result), ``y``: [n, d] (the points reduced over), ``v``: [n, 1],
float32, both kernels written the naive way (the full [rows, n] kernel matrix, then a matmul), with
``r2 = sum((x[:, None] - y[None])**2, -1)`` and the lengthscale ``l = sqrt(d / 6)`` (uniform data in
the unit cube has mean squared distance d / 6):

* ``gaussian``: ``exp(-r2 / (2 l^2)) @ v``;
* ``matern32``: ``(1 + sqrt(3) r / l) exp(-sqrt(3) r / l) @ v`` with ``r = sqrt(r2)``.

Methods, as in ``experiments/knn.py``: ``naive`` (XLA, tf_memsafe's passes off), ``tf_memsafe`` (the
same code traced after ``tf_memsafe.enable(--limit)``, default 1 GB), ``hand`` (the chunked
``tf.while_loop`` of ``experiments/overhead.py`` over rows of ``x``, each chunk's products written to
a ``TensorArray``, with the largest chunk whose XLA footprint fits ``--limit``; its per-chunk
squared distances are the matmul form ``|x|^2 - 2 x y^T + |y|^2`` at d > 32, the direct form
otherwise), ``keops`` (a ``LazyTensor`` sum reduction of pykeops on the CPU, imported lazily; when it
cannot be imported or compiled, ``skipped`` says why) and ``numpy`` (float64, in blocks, on the first
``--ref-rows`` rows: the reference).  ``rel_err``: the largest absolute difference from the
reference over the largest magnitude of the reference.

Columns, skipping rules (``--run-limit``, ``--time-budget`` predicted linearly in n from the previous
size) and outputs (``kernel_matvec.csv``, ``.json``, ``.png`` in ``--out``, and a printed table with
tf_memsafe's speed over the hand-written loop's, target >= 0.95, and over KeOps', and the largest n
each method reaches within the limit) follow ``experiments/knn.py``.  Timings are of this machine
and are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments import _methods as m
from experiments import overhead
from experiments._results import OUT_HELP, results_dir

KERNELS = ("gaussian", "matern32")
TARGET_SPEED = 0.95          # tf_memsafe / hand-written rows per second
PAIRWISE_D = 32              # above this d, squared distances are faster as a matmul (tf_memsafe's pass agrees)
SQRT3 = math.sqrt(3.0)


@dataclasses.dataclass
class Row:
    method: str                       # naive, tf_memsafe, hand, keops, numpy
    kernel: str                       # gaussian, matern32
    data: str                         # uniform, clustered
    d: int
    n: int                            # points reduced over (columns of K)
    rows: int                         # rows of K and of the result
    columns: int                      # columns of v
    limit_bytes: int                  # --limit
    footprint_bytes: int | None       # XLA's "Total bytes used" (TF methods)
    within_limit: bool | None
    seconds: float | None             # fastest timed call (numpy: for the reference rows only)
    first_call_s: float | None        # the warm-up call (XLA or KeOps compile included)
    rows_per_s: float | None
    rel_err: float | None             # against numpy: max |out - ref| / max |ref|
    checked_rows: int | None
    plan: str                         # tf_memsafe's rewrites, or the hand-written loop's chunks
    skipped: str                      # why the method did not run at this size ("" if it ran)
    note: str


def lengthscale(d: int) -> float:
    return math.sqrt(d / 6.0)


# ---------------------------------------------------------------- the programs


def kernel_of(kernel: str, d: int) -> Callable:
    """The kernel as a function of squared distances (TensorFlow)."""
    ls = lengthscale(d)
    if kernel == "gaussian":
        return lambda r2: tf.exp(r2 * (-0.5 / ls**2))
    if kernel == "matern32":
        def matern32(r2):
            sr = tf.sqrt(r2) * (SQRT3 / ls)
            return (1.0 + sr) * tf.exp(-sr)
        return matern32
    raise ValueError(f"unknown kernel {kernel!r}: expected one of {KERNELS}")


def naive_matvec(kernel: str, d: int) -> Callable:
    """K(x, y) @ v written the naive way: the [rows, n] squared distances, the kernel, a matmul."""
    k = kernel_of(kernel, d)

    def kernel_matvec(x, y, v):
        r2 = tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), axis=-1)        # [Q, N]
        return tf.matmul(k(r2), v)                                                      # [Q, V]

    kernel_matvec.__name__ = f"{kernel}_matvec"
    return kernel_matvec


def hand_matvec(kernel: str, d: int, rows: int, chunk: int) -> Callable:
    """``overhead.hand_chunked`` over chunks of ``chunk`` rows of x, with the per-chunk form a careful person writes."""
    k = kernel_of(kernel, d)

    def chunk_rows(xc, first, y, v):
        del first
        if d > PAIRWISE_D:
            cross = tf.matmul(xc, y, transpose_b=True)                                  # [C, N]
            r2 = tf.reduce_sum(tf.square(xc), 1)[:, None] - 2.0 * cross + tf.reduce_sum(tf.square(y), 1)[None, :]
            r2 = tf.maximum(r2, 0.0)                                                    # rounding can go below 0
        else:
            r2 = tf.reduce_sum(tf.square(xc[:, None, :] - y[None, :, :]), axis=-1)     # [C, N]
        return tf.matmul(k(r2), v)                                                      # [C, V]

    steps, tail = divmod(rows, chunk)
    return overhead.hand_chunked(chunk_rows, tf.float32, chunk, steps, tail)


def keops_matvec(LazyTensor, kernel: str, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The same product as a KeOps sum reduction over a lazy [rows, n] kernel matrix."""
    ls = lengthscale(x.shape[1])
    xi, yj, vj = LazyTensor(x[:, None, :]), LazyTensor(y[None, :, :]), LazyTensor(v[None, :, :])
    r2 = ((xi - yj) ** 2).sum(-1)
    if kernel == "gaussian":
        kij = (r2 * (-0.5 / ls**2)).exp()
    else:
        sr = r2.sqrt() * (SQRT3 / ls)
        kij = (1.0 + sr) * (-sr).exp()
    return (kij * vj).sum(dim=1)                                                        # [Q, V]


def exact_matvec(kernel: str, x: np.ndarray, y: np.ndarray, v: np.ndarray) -> np.ndarray:
    """K(x, y) @ v in float64, in blocks of points: [R, V]."""
    ls = lengthscale(x.shape[1])
    x64 = x.astype(np.float64)
    x_sq = np.sum(x64**2, axis=1)[:, None]                                              # [R, 1]
    out = np.zeros((len(x), v.shape[1]))
    for ps in m.blocks(len(y), max(1, 2**23 // len(x))):
        yb = y[ps].astype(np.float64)                                                   # [C, D]
        r2 = np.maximum(x_sq - 2 * x64 @ yb.T + np.sum(yb**2, axis=1)[None, :], 0.0)    # [R, C]
        if kernel == "gaussian":
            kb = np.exp(-0.5 * r2 / ls**2)
        else:
            sr = np.sqrt(r2) * (SQRT3 / ls)
            kb = (1.0 + sr) * np.exp(-sr)
        out += kb @ v[ps].astype(np.float64)
    return out


def rel_err(reference: np.ndarray, out: np.ndarray) -> dict:
    scale = float(np.max(np.abs(reference))) or 1.0
    return {"rel_err": float(np.max(np.abs(np.asarray(out, np.float64) - reference))) / scale}


# ---------------------------------------------------------------- one size


def measure(s: m.Settings, kernel: str, data: str, d: int, n: int, rows: int, columns: int, ref_rows: int) -> list[Row]:
    def arrays():
        v = np.random.default_rng([1, n, columns]).standard_normal((n, columns), dtype=np.float32)
        return m.make_points(data, rows, d, "queries"), m.make_points(data, n, d, "points"), v

    case = m.Case(
        key=(kernel, data, d), n=n, rows=rows, ref_rows=ref_rows,
        specs=(tf.TensorSpec([rows, d], tf.float32), tf.TensorSpec([n, d], tf.float32),
               tf.TensorSpec([n, columns], tf.float32)),
        naive=naive_matvec(kernel, d), hand=lambda chunk: hand_matvec(kernel, d, rows, chunk),
        hand_extent=rows, hand_unit="rows", hand_smallest=1, arrays=arrays,
        keops=lambda lazy, x, y, v: keops_matvec(lazy, kernel, x, y, v),
        reference=lambda r, x, y, v: exact_matvec(kernel, x[:r], y, v),
        check=lambda ref, out, *_: rel_err(ref, out))
    result = []
    for meth, o in m.measure(case, s).items():
        result.append(Row(method=meth, kernel=kernel, data=data, d=d, n=n, rows=rows, columns=columns,
                          limit_bytes=s.limit, footprint_bytes=o.footprint_bytes, within_limit=o.within_limit,
                          seconds=o.seconds, first_call_s=o.first_call_s, rows_per_s=o.rows_per_s,
                          rel_err=o.checks.get("rel_err"), checked_rows=o.checked_rows, plan=o.plan,
                          skipped=o.skipped, note=o.note))
    return result


# ---------------------------------------------------------------- summary and output


def summary(rows: list[Row]) -> tuple[list[dict], list[dict]]:
    """(speed ratios per size, largest n per method within the limit)."""
    return m.speed_summary(rows, "kernel", "rows_per_s", "rows_per_s", TARGET_SPEED)


def table(rows: list[Row], limit: int) -> str:
    num = m.num
    head = (f"{'kernel':8} {'data':9} {'d':>3} {'n':>6} {'method':10} {'footprint':>10} {'fits':4} {'s/call':>8} "
            f"{'rows/s':>9} {'rel_err':>8}  skipped / plan")
    lines = [f"kernel matvec, limit {m.fmt_bytes(limit)}", head, "-" * len(head)]
    for r in rows:
        if r.skipped.startswith("not selected"):
            continue
        fits = "-" if r.within_limit is None else ("yes" if r.within_limit else "NO")
        lines.append(f"{r.kernel:8} {r.data:9} {r.d:>3} {m.fmt_n(r.n):>6} {r.method:10} "
                     f"{m.fmt_bytes(r.footprint_bytes):>10} {fits:4} {num(r.seconds, '8.3f')} "
                     f"{num(r.rows_per_s, '9.0f')} {num(r.rel_err, '8.1e')}  {(r.skipped or r.plan)[:110]}")
    lines += m.summary_lines(*summary(rows), "kernel", 8, "rows/s", TARGET_SPEED, limit)
    return "\n".join(lines)


def plot(rows: list[Row], path: str, limit: int) -> None:
    title = f"kernel matvec, tf_memsafe limit {m.fmt_bytes(limit)}; XLA:CPU, {os.cpu_count()} cores"
    m.plot_throughput(rows, path, "kernel", "rows_per_s", "rows of K v / s", title)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = lambda text: int(float(text))
    parser.add_argument("--quick", action="store_true",
                        help="smoke preset: n 2000 and 8000, 1000 rows, d 3 and 40, uniform data, limit 4MB")
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument("--limit", help="tf_memsafe's memory limit and the hand-written loop's (default 1GB)")
    parser.add_argument("--run-limit", default="8GB", help="run a TF method only if its footprint fits this")
    parser.add_argument("--sizes", nargs="+", type=size, help="n, the number of points (default 1e4 1e5 1e6)")
    parser.add_argument("--rows", type=int, help="rows of x and of the result (default 10000)")
    parser.add_argument("--columns", type=int, default=1, help="columns of v")
    parser.add_argument("--dims", nargs="+", type=int, help="d (default 3 10 100)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS)
    parser.add_argument("--data", nargs="+", choices=m.DATA, help="default uniform clustered")
    parser.add_argument("--methods", nargs="+", choices=m.METHODS, default=list(m.METHODS))
    parser.add_argument("--time-budget", type=float, help="seconds per call, predicted from the previous size (60)")
    parser.add_argument("--repeats", type=int, help="timed calls after the warm-up (default 5; 1 with --quick)")
    parser.add_argument("--ref-rows", type=int, help="rows the NumPy reference computes (default 1000)")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)
    quick = args.quick
    limit = tf_memsafe.parse_memory_limit(args.limit or ("4MB" if quick else "1GB")).resolve(0)
    run_limit = tf_memsafe.parse_memory_limit(args.run_limit).resolve(0)
    sizes = args.sizes or ([2000, 8000] if quick else [10**4, 10**5, 10**6])
    dims = args.dims or ([3, 40] if quick else [3, 10, 100])
    kernels = args.kernels or list(KERNELS)
    datas = args.data or (["uniform"] if quick else list(m.DATA))
    n_rows = args.rows or (1000 if quick else 10000)
    ref_rows = args.ref_rows or (n_rows if quick else 1000)
    settings = m.Settings(methods=tuple(args.methods), limit=limit, run_limit=run_limit,
                          repeats=args.repeats or (1 if quick else 5),
                          budget=m.Budget(args.time_budget or (10.0 if quick else 60.0)))

    from tqdm import tqdm

    tf.get_logger().setLevel("ERROR")   # a fresh trace per size is the point, not a mistake
    was_enabled = tf_memsafe.is_enabled()
    tf_memsafe.enable(limit)   # before the tf_memsafe functions are created; naive ones turn the passes off
    rows: list[Row] = []
    try:
        with tqdm(total=len(kernels) * len(datas) * len(dims) * len(sizes), desc="kernel_matvec") as bar:
            for kernel in kernels:
                for data in datas:
                    for d in dims:
                        for n in sizes:
                            bar.set_postfix_str(f"{kernel} {data} d={d} n={m.fmt_n(n)}")
                            rows += measure(settings, kernel, data, d, n, n_rows, args.columns, ref_rows)
                            bar.update()
    finally:
        if not was_enabled:
            tf_memsafe.disable()
    stem = os.path.join(args.out, "kernel_matvec")
    ratios, reach = summary(rows)
    m.write_outputs(rows, Row, stem, {**m.machine(), "quick": quick, "limit_bytes": limit,
                                     "run_limit_bytes": run_limit, "time_budget_s": settings.budget.seconds,
                                     "repeats": settings.repeats, "result_rows": n_rows, "columns": args.columns,
                                     "targets": {"tf_memsafe_vs_hand_min": TARGET_SPEED},
                                     "speed": ratios, "reach": reach})
    plot(rows, stem + ".png", limit)
    print(table(rows, limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
