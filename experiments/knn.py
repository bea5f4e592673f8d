"""Brute-force k-nearest neighbours: naive XLA, tf_memsafe, a hand-written loop, KeOps and NumPy.

    python -m experiments.knn [--quick] [--out experiments/results] [--limit 1GB] [--run-limit 8GB]
        [--sizes 1e4 1e5 1e6 1e7] [--dims 3 10 100] [--metrics l2 l1 cosine] [--data uniform clustered mnist]
        [--queries 10000] [--methods naive tf_memsafe hand keops numpy] [--time-budget 60] [--repeats 5]

The eXLA paper's first experiment: k = 10 neighbours of Q queries among n points in d dimensions,
float32, for three metrics written the naive way (the full [Q, n] matrix, then ``tf.math.top_k``):

* ``l2``: ``top_k(-sum((q[:, None] - p[None])**2, -1), k)``;
* ``l1``: ``top_k(-sum(abs(q[:, None] - p[None]), -1), k)``;
* ``cosine``: ``top_k(normalize(q) @ normalize(p)^T, k)`` (largest cosine similarity).

Methods (one row each per metric, data, d and n):

* ``naive``: that code, ``jit_compile=True``, tf_memsafe's passes off;
* ``tf_memsafe``: the same code traced after ``tf_memsafe.enable(--limit)`` (default 1 GB);
* ``hand``: a hand-written ``tf.while_loop`` over chunks of the points keeping a running top-k
  (top-k of each chunk, merged with the running k by another top-k), with the largest chunk whose
  XLA footprint fits ``--limit``.  Its per-chunk distance is what a careful person writes: for l2
  at d > 32 the matmul form ``|q|^2 - 2 q p^T + |p|^2`` (the form tf_memsafe's ``pairwise_distance``
  pass produces), the direct form otherwise;
* ``keops``: ``LazyTensor.argKmin`` of pykeops on the CPU (an optional extra, imported lazily; when
  it cannot be imported or compiled, the row's ``skipped`` column says why);
* ``numpy``: exact brute force in float64 (blocks of queries and points) on the first
  ``--ref-queries`` queries: the reference every other method's recall is computed against.

Columns: the XLA footprint of the TF methods ("Total bytes used", compiled, not run) and whether it
is within ``--limit``; the fastest timed call after a warm-up call (the methods take turns, one
call each, for ``--repeats`` rounds; a method sits out once its timed calls reach 10 s) and
queries per second; ``recall``: the share of the returned neighbours (distinct indices)
whose exact distance is at most the exact k-th neighbour's distance plus a float32 rounding
allowance (``16 eps sqrt(d)`` times the scale of the terms), so that ties and near-ties count;
``kth_rel_err``: the largest relative difference between the exact distance of the k-th neighbour
returned and the exact k-th distance.  A method is skipped at a size (``skipped`` says why) when
its footprint exceeds ``--run-limit`` (default 8 GB), or when its time per call, predicted
linearly in n from the previous size it ran at, exceeds ``--time-budget`` seconds.

Data: ``uniform`` in the unit cube, ``clustered`` (a mixture of 64 Gaussians), and ``mnist``
(d = 784, points from the training images, queries from the test images) through
``tensorflow_datasets``, only when its prepared files are already on this machine (nothing is
downloaded; otherwise one row says so).  Results go to ``knn.csv``, ``knn.json`` and ``knn.png`` in
``--out``, and a table is printed with the targets: tf_memsafe's queries per second over the
hand-written loop's (target >= 0.95) and over KeOps', and the largest n each method reaches within
the limit.  Timings are of this machine and are not asserted anywhere.
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
from experiments._results import OUT_HELP, results_dir

METRICS = ("l2", "l1", "cosine")
TARGET_SPEED = 0.95          # tf_memsafe / hand-written queries per second
PAIRWISE_D = 32              # above this d, l2 distances are faster as a matmul (tf_memsafe's pass agrees)
MNIST_D = 784


@dataclasses.dataclass
class Row:
    method: str                       # naive, tf_memsafe, hand, keops, numpy
    metric: str                       # l2, l1, cosine
    data: str                         # uniform, clustered, mnist
    d: int
    n: int                            # points
    queries: int
    k: int
    limit_bytes: int                  # --limit
    footprint_bytes: int | None       # XLA's "Total bytes used" (TF methods)
    within_limit: bool | None
    seconds: float | None             # fastest timed call (numpy: for the reference queries only)
    first_call_s: float | None        # the warm-up call (XLA or KeOps compile included)
    queries_per_s: float | None
    recall: float | None              # against numpy, ties allowed (see the module docstring)
    kth_rel_err: float | None
    checked_queries: int | None       # queries compared with the reference
    plan: str                         # tf_memsafe's rewrites, or the hand-written loop's chunks
    skipped: str                      # why the method did not run at this size ("" if it ran)
    note: str


# ---------------------------------------------------------------- the programs


def naive_knn(metric: str, k: int) -> Callable:
    """The kNN program written the naive way: the full [Q, N] matrix, then top-k."""
    if metric == "l2":
        def knn_l2(q, p):
            dist = tf.reduce_sum(tf.square(q[:, None, :] - p[None, :, :]), axis=-1)    # [Q, N]
            return tf.math.top_k(-dist, k=k).indices                                    # [Q, K]
        return knn_l2
    if metric == "l1":
        def knn_l1(q, p):
            dist = tf.reduce_sum(tf.abs(q[:, None, :] - p[None, :, :]), axis=-1)       # [Q, N]
            return tf.math.top_k(-dist, k=k).indices                                    # [Q, K]
        return knn_l1
    if metric == "cosine":
        def knn_cosine(q, p):
            qn = q / tf.norm(q, axis=1, keepdims=True)                                  # [Q, D]
            pn = p / tf.norm(p, axis=1, keepdims=True)                                  # [N, D]
            return tf.math.top_k(tf.matmul(qn, pn, transpose_b=True), k=k).indices      # [Q, K]
        return knn_cosine
    raise ValueError(f"unknown metric {metric!r}: expected one of {METRICS}")


def chunk_score(metric: str, d: int) -> tuple[Callable, Callable]:
    """(prepare(q) -> state, score(state, p_chunk) -> [Q, C], larger = nearer) for the hand-written loop."""
    if metric == "l2" and d > PAIRWISE_D:
        def prepare(q):
            return q, tf.reduce_sum(tf.square(q), axis=1)                               # [Q, D], [Q]

        def score(state, pc):
            q, q2 = state
            cross = tf.matmul(q, pc, transpose_b=True)                                  # [Q, C]
            return 2.0 * cross - q2[:, None] - tf.reduce_sum(tf.square(pc), axis=1)[None, :]
        return prepare, score
    if metric == "l2":
        return (lambda q: q), lambda q, pc: -tf.reduce_sum(tf.square(q[:, None, :] - pc[None, :, :]), axis=-1)
    if metric == "l1":
        return (lambda q: q), lambda q, pc: -tf.reduce_sum(tf.abs(q[:, None, :] - pc[None, :, :]), axis=-1)
    if metric == "cosine":
        def normalize(x):
            return x / tf.norm(x, axis=1, keepdims=True)
        return normalize, lambda qn, pc: tf.matmul(qn, normalize(pc), transpose_b=True)
    raise ValueError(f"unknown metric {metric!r}")


def hand_knn(metric: str, k: int, d: int, n: int, chunk: int) -> Callable:
    """kNN by a ``tf.while_loop`` over ``chunk`` points at a time with a running top-k (then the tail).

    Each step: top-k of the chunk's scores, offset to global indices, merged with the running k by a
    top-k of the 2k candidates.  The remainder of ``n % chunk`` points is merged once after the loop.
    A chunk of all ``n`` points is no loop at all: top-k of the scores.
    """
    prepare, score = chunk_score(metric, d)
    steps, tail = divmod(n, chunk)

    def merge(vals, idx, state, pc, start):
        v, j = tf.math.top_k(score(state, pc), k=min(k, pc.shape[0]))                  # [Q, K]
        cand_v = tf.concat([vals, v], axis=1)                                           # [Q, 2K]
        cand_i = tf.concat([idx, j + start], axis=1)                                    # [Q, 2K]
        vals, pos = tf.math.top_k(cand_v, k=k)                                          # [Q, K]
        return vals, tf.gather(cand_i, pos, batch_dims=1)

    def knn_hand(q, p):
        state = prepare(q)
        if chunk >= n:   # one chunk: no loop (XLA:CPU runs a one-trip loop's top-k ~50x slower, measured)
            return tf.math.top_k(score(state, p), k=k).indices                          # [Q, K]
        vals = tf.fill([q.shape[0], k], tf.constant(-np.inf, q.dtype))                 # [Q, K]
        idx = tf.zeros([q.shape[0], k], tf.int32)                                       # [Q, K]

        def body(i, vals, idx):
            start = i * chunk
            pc = tf.slice(p, tf.stack([start, 0]), [chunk, d])                          # [C, D]
            return (i + 1, *merge(vals, idx, state, pc, start))

        if steps:
            _, vals, idx = tf.while_loop(lambda i, *_: i < steps, body, (tf.constant(0), vals, idx),
                                         maximum_iterations=steps)
        if tail:
            vals, idx = merge(vals, idx, state, p[steps * chunk:], tf.constant(steps * chunk))
        return idx

    return knn_hand


def keops_knn(LazyTensor, metric: str, q: np.ndarray, p: np.ndarray, k: int) -> np.ndarray:
    """The same search with KeOps' lazy [Q, N] matrix and its ``argKmin`` reduction."""
    if metric == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        p = p / np.linalg.norm(p, axis=1, keepdims=True)
    qi, pj = LazyTensor(q[:, None, :]), LazyTensor(p[None, :, :])                     # [Q, 1, D], [1, N, D]
    if metric == "l2":
        dist = ((qi - pj) ** 2).sum(-1)
    elif metric == "l1":
        dist = (qi - pj).abs().sum(-1)
    else:
        dist = -(qi | pj)
    return dist.argKmin(k, dim=1)                                                       # [Q, K]


# ---------------------------------------------------------------- exact answers in NumPy


def exact_distances(metric: str, q: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """float64 distances of each query to its own candidates: q [R, D], pts [R, K, D] -> [R, K]."""
    q = q.astype(np.float64)[:, None, :]
    pts = pts.astype(np.float64)
    if metric == "l2":
        return np.sum((q - pts) ** 2, axis=-1)
    if metric == "l1":
        return np.sum(np.abs(q - pts), axis=-1)
    cos = np.sum(q * pts, axis=-1) / (np.linalg.norm(q, axis=-1) * np.linalg.norm(pts, axis=-1))
    return 1.0 - cos


def exact_knn(metric: str, q: np.ndarray, p: np.ndarray, k: int) -> np.ndarray:
    """Exact k nearest (float64, brute force in blocks): indices [R, K], nearest first."""
    n, d = p.shape
    p64 = p.astype(np.float64) if p.nbytes <= 2**31 else None
    if metric == "cosine":
        p_norm = np.linalg.norm(p.astype(np.float64), axis=1)                          # [N]
    p_sq = np.sum(np.square(p.astype(np.float64)), axis=1)                              # [N]
    rows = max(1, min(len(q), 2**24 // n))                                              # [rows, N] float64 <= 128 MiB
    out = np.empty((len(q), k), np.int64)
    for qs in m.blocks(len(q), rows):
        qb = q[qs].astype(np.float64)                                                   # [B, D]
        dist = np.empty((len(qb), n))                                                   # [B, N]
        cols = n if metric != "l1" else max(1, 2**22 // (len(qb) * d))
        for ps in m.blocks(n, cols):
            pb = p64[ps] if p64 is not None else p[ps].astype(np.float64)              # [C, D]
            if metric == "l2":
                dist[:, ps] = np.sum(qb**2, axis=1)[:, None] - 2 * qb @ pb.T + p_sq[ps][None, :]
            elif metric == "l1":
                dist[:, ps] = np.sum(np.abs(qb[:, None, :] - pb[None, :, :]), axis=-1)
            else:
                dist[:, ps] = 1.0 - (qb @ pb.T) / (np.linalg.norm(qb, axis=1)[:, None] * p_norm[ps][None, :])
        part = np.argpartition(dist, k - 1, axis=1)[:, :k]                              # [B, K] unordered
        order = np.argsort(np.take_along_axis(dist, part, axis=1), axis=1)
        out[qs] = np.take_along_axis(part, order, axis=1)
    return out


def tolerance(metric: str, q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Per query: how far float32 arithmetic may move a distance ([R]); ties within it count as found."""
    d = q.shape[1]
    scale = 16 * m.EPS32 * math.sqrt(d)
    if metric == "l2":
        return scale * (np.sum(np.square(q, dtype=np.float64), 1) + np.max(np.sum(np.square(p, dtype=np.float64), 1)))
    if metric == "l1":
        return scale * (np.sum(np.abs(q), 1, dtype=np.float64) + np.max(np.sum(np.abs(p), 1, dtype=np.float64)))
    return np.full(len(q), 2 * scale)


def recall(metric: str, q: np.ndarray, p: np.ndarray, idx: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(recall, kth_rel_err) of ``idx`` [R, K] against the exact ``ref`` [R, K] (see the module docstring)."""
    n = len(p)
    idx = np.asarray(idx, np.int64)
    valid = (idx >= 0) & (idx < n)
    safe = np.where(valid, idx, 0)
    got = exact_distances(metric, q, p[safe])                                           # [R, K]
    kth = np.sort(exact_distances(metric, q, p[ref]), axis=1)[:, -1]                    # [R]
    tol = tolerance(metric, q, p)                                                       # [R]
    first = np.ones_like(valid)                                                         # a repeated index counts once
    order = np.argsort(safe, axis=1, kind="stable")
    ranked = np.take_along_axis(safe, order, axis=1)
    repeat = np.concatenate([np.zeros((len(idx), 1), bool), ranked[:, 1:] == ranked[:, :-1]], axis=1)
    np.put_along_axis(first, order, ~repeat, axis=1)
    found = valid & first & (got <= kth[:, None] + tol[:, None])
    got_kth = np.sort(np.where(valid, got, np.inf), axis=1)[:, -1]
    err = np.abs(got_kth - kth) / np.maximum(kth, tol)
    return float(found.sum() / found.size), float(np.max(err))


# ---------------------------------------------------------------- data


def load_mnist(n_queries: int, data_dir: str | None = None) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """MNIST through ``tensorflow_datasets`` as (points [60000, 784], queries [Q, 784], "") in [0, 1].

    Only if the prepared files are already on this machine (``builder.is_prepared()`` under
    ``data_dir``): nothing is downloaded.  Otherwise ``(None, None, why)``.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        return None, None, f"mnist: tensorflow_datasets not importable ({e})"
    builder = tfds.builder("mnist", data_dir=data_dir)
    if not mnist_prepared(builder):
        return None, None, f"mnist: no prepared files in {builder.data_dir} (nothing is downloaded)"

    def images(split: str, count: int | None) -> np.ndarray:
        ds = builder.as_dataset(split=split)
        ds = (ds if count is None else ds.take(count)).batch(8192)
        pixels = np.concatenate([batch["image"] for batch in tfds.as_numpy(ds)])      # [N, 28, 28, 1] uint8
        return pixels.reshape(len(pixels), -1).astype(np.float32) / np.float32(255.0)  # [N, 784]

    return images("train", None), images("test", n_queries), ""


def mnist_prepared(builder) -> bool:
    return builder.is_prepared()


# ---------------------------------------------------------------- one size


@dataclasses.dataclass
class Config:
    data: str
    d: int
    sizes: list[int]
    arrays: Callable[[int], tuple[np.ndarray, np.ndarray]] | None   # n -> (queries, points)
    queries: int
    skipped: str = ""


def measure(s: m.Settings, metric: str, data: str, d: int, n: int, queries: int, k: int, ref_queries: int,
            arrays: Callable[[], tuple[np.ndarray, np.ndarray]]) -> list[Row]:
    """One row per method at this size; ``arrays()`` gives (queries, points) when something runs."""
    case = m.Case(
        key=(metric, data, d), n=n, rows=queries, ref_rows=ref_queries,
        specs=(tf.TensorSpec([queries, d], tf.float32), tf.TensorSpec([n, d], tf.float32)),
        naive=naive_knn(metric, k), hand=lambda chunk: hand_knn(metric, k, d, n, chunk),
        hand_extent=n, hand_unit="points", hand_smallest=k, arrays=arrays,
        keops=lambda lazy, q, p: keops_knn(lazy, metric, q, p, k),
        reference=lambda rows, q, p: exact_knn(metric, q[:rows], p, k),
        check=lambda ref, idx, q, p: dict(zip(("recall", "kth_rel_err"), recall(metric, q[:len(ref)], p, idx, ref))))
    rows = []
    for meth, o in m.measure(case, s).items():
        rows.append(Row(method=meth, metric=metric, data=data, d=d, n=n, queries=queries, k=k, limit_bytes=s.limit,
                        footprint_bytes=o.footprint_bytes, within_limit=o.within_limit, seconds=o.seconds,
                        first_call_s=o.first_call_s, queries_per_s=o.rows_per_s, recall=o.checks.get("recall"),
                        kth_rel_err=o.checks.get("kth_rel_err"), checked_queries=o.checked_rows, plan=o.plan,
                        skipped=o.skipped, note=o.note))
    return rows


# ---------------------------------------------------------------- summary and output


def summary(rows: list[Row]) -> tuple[list[dict], list[dict]]:
    """(speed ratios per size, largest n per method within the limit)."""
    return m.speed_summary(rows, "metric", "queries_per_s", "qps", TARGET_SPEED)


def table(rows: list[Row], limit: int) -> str:
    num = m.num
    head = (f"{'metric':6} {'data':9} {'d':>3} {'n':>6} {'method':10} {'footprint':>10} {'fits':4} {'s/call':>8} "
            f"{'queries/s':>10} {'recall':>6}  skipped / plan")
    lines = [f"kNN, k = {rows[0].k if rows else '-'}, limit {m.fmt_bytes(limit)}", head, "-" * len(head)]
    for r in rows:
        if r.skipped.startswith("not selected"):
            continue
        fits = "-" if r.within_limit is None else ("yes" if r.within_limit else "NO")
        tail = r.skipped if r.skipped else r.plan
        lines.append(f"{r.metric:6} {r.data:9} {r.d:>3} {m.fmt_n(r.n):>6} {r.method:10} "
                     f"{m.fmt_bytes(r.footprint_bytes):>10} "
                     f"{fits:4} {num(r.seconds, '8.3f')} {num(r.queries_per_s, '10.0f')} {num(r.recall, '6.3f')}  "
                     f"{tail[:110]}")
    lines += m.summary_lines(*summary(rows), "metric", 6, "queries/s", TARGET_SPEED, limit)
    return "\n".join(lines)


def plot(rows: list[Row], path: str, limit: int) -> None:
    title = f"brute-force kNN (k = 10), tf_memsafe limit {m.fmt_bytes(limit)}; XLA:CPU, {os.cpu_count()} cores"
    m.plot_throughput(rows, path, "metric", "queries_per_s", "queries / s", title)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = lambda text: int(float(text))
    parser.add_argument("--quick", action="store_true",
                        help="smoke preset: n 1000 and 4000, 300 queries, d 3 and 40, uniform data, limit 2MB")
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument("--limit", help="tf_memsafe's memory limit and the hand-written loop's (default 1GB)")
    parser.add_argument("--run-limit", default="8GB", help="run a TF method only if its footprint fits this")
    parser.add_argument("--sizes", nargs="+", type=size, help="n, the number of points (default 1e4 1e5 1e6 1e7)")
    parser.add_argument("--dims", nargs="+", type=int, help="d (default 3 10 100)")
    parser.add_argument("--metrics", nargs="+", choices=METRICS)
    parser.add_argument("--data", nargs="+", choices=(*m.DATA, "mnist"), help="default uniform clustered mnist")
    parser.add_argument("--queries", type=int, help="default 10000")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--methods", nargs="+", choices=m.METHODS, default=list(m.METHODS))
    parser.add_argument("--time-budget", type=float, help="seconds per call, predicted from the previous size (60)")
    parser.add_argument("--repeats", type=int, help="timed calls after the warm-up (default 5; 1 with --quick)")
    parser.add_argument("--ref-queries", type=int, help="queries the NumPy reference answers (default 1000)")
    parser.add_argument("--mnist-dir", help="tensorflow_datasets data_dir to look for MNIST in")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)
    quick = args.quick
    limit = tf_memsafe.parse_memory_limit(args.limit or ("2MB" if quick else "1GB")).resolve(0)
    run_limit = tf_memsafe.parse_memory_limit(args.run_limit).resolve(0)
    sizes = args.sizes or ([1000, 4000] if quick else [10**4, 10**5, 10**6, 10**7])
    dims = args.dims or ([3, 40] if quick else [3, 10, 100])
    metrics = args.metrics or list(METRICS)
    datas = args.data or (["uniform"] if quick else [*m.DATA, "mnist"])
    queries = args.queries or (300 if quick else 10000)
    ref_queries = args.ref_queries or (queries if quick else 1000)
    settings = m.Settings(methods=tuple(args.methods), limit=limit, run_limit=run_limit,
                          repeats=args.repeats or (1 if quick else 5),
                          budget=m.Budget(args.time_budget or (10.0 if quick else 60.0)))

    from tqdm import tqdm

    tf.get_logger().setLevel("ERROR")   # a fresh trace per size is the point, not a mistake
    configs = []
    for data in datas:
        if data == "mnist":
            points, mnist_queries, why = load_mnist(queries, args.mnist_dir)
            if points is None:
                configs.append(Config(data, MNIST_D, [], None, queries, why))
                continue
            ns = sorted({x for x in sizes if x < len(points)} | {len(points)})
            configs.append(Config(data, MNIST_D, ns, lambda n, pts=points, qs=mnist_queries: (qs, pts[:n]),
                                  len(mnist_queries)))
        else:
            for d in dims:
                configs.append(Config(data, d, sizes, lambda n, data=data, d=d: (
                    m.make_points(data, queries, d, "queries"), m.make_points(data, n, d, "points")), queries))
    was_enabled = tf_memsafe.is_enabled()
    tf_memsafe.enable(limit)   # before the tf_memsafe functions are created; naive ones turn the passes off
    rows: list[Row] = []
    try:
        with tqdm(total=len(metrics) * sum(len(c.sizes) for c in configs), desc="knn") as bar:
            for metric in metrics:
                for c in configs:
                    if c.arrays is None:
                        rows.append(Row(method="all", metric=metric, data=c.data, d=c.d, n=0, queries=c.queries,
                                        k=args.k, limit_bytes=limit, footprint_bytes=None, within_limit=None,
                                        seconds=None, first_call_s=None, queries_per_s=None, recall=None,
                                        kth_rel_err=None, checked_queries=None, plan="", skipped=c.skipped,
                                        note=""))
                        continue
                    for n in c.sizes:
                        bar.set_postfix_str(f"{metric} {c.data} d={c.d} n={m.fmt_n(n)}")
                        rows += measure(settings, metric, c.data, c.d, n, c.queries, args.k, ref_queries,
                                        lambda c=c, n=n: c.arrays(n))
                        bar.update()
    finally:
        if not was_enabled:
            tf_memsafe.disable()
    stem = os.path.join(args.out, "knn")
    ratios, reach = summary(rows)
    m.write_outputs(rows, Row, stem, {**m.machine(), "quick": quick, "limit_bytes": limit, "run_limit_bytes": run_limit,
                                     "time_budget_s": settings.budget.seconds, "repeats": settings.repeats,
                                     "queries": queries, "k": args.k,
                                     "targets": {"tf_memsafe_vs_hand_min": TARGET_SPEED},
                                     "speed": ratios, "reach": reach})
    plot(rows, stem + ".png", limit)
    print(table(rows, limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
