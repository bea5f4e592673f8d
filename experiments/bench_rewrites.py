"""Benchmark of the match-and-replace passes: XLA footprint and run time with each pass on and off.

    python -m experiments.bench_rewrites [--quick] [--out experiments/results] [--repeats 5]

Workloads (the sizes of issue 6; ``--quick`` shrinks them for a smoke run):

* ``knn_d3``: naive kNN, n = m = 20000 points, d = 3, k = 10.  XLA fuses the [n, m, 3] broadcast
  into the sum, so ``pairwise_distance`` is expected to leave it alone;
* ``knn_d64``: the same at d = 64, where the broadcast is materialised (~100 GB: only measured,
  never run unless it fits ``--run-limit``);
* ``sgpr_stock``: GPflow SGPR training loss, SquaredExponential kernel (already in matmul form);
* ``sgpr_naive_kernel``: the same model with a kernel written with the [.., N, M, D] broadcast;
* ``chain_fits``: ``(A B) V``, A [4000, 64], B [64, 4000], V [4000, 16], under twice its figure:
  within its limit, only a rewrite that cuts FLOPs may fire (``matrix_chain``: ``A (B V)``);
* ``sum_fits``: ``sum(A B)`` of the same A and B under twice its figure: ``reduce_of_product``
  would remove the product, but the program fits, so no rewrite made for memory fires.

Configurations: ``off`` (tf_memsafe's rewrites off: the program as written), ``all`` (every pass of
the default pipeline), and ``only:<pass>`` for each pass. Each workload runs under a memory limit of
half its own figure as written (the ``*_fits`` ones: twice it): rewrites made for memory change only
programs over their limit (``grappler_ext.guard``), and are undone where XLA's figure rises with
them, so every firing row's footprint is at most the ``off`` row's (``raised`` says where not:
never, by design). For each (workload, configuration) the script records XLA's "Total bytes used"
(deterministic; compiled, not run) and, when the program fits ``--run-limit``, the median wall time
of ``--repeats`` runs after one warm-up. Results go to ``bench_rewrites.csv``,
``bench_rewrites.json`` and ``bench_rewrites.png`` in ``--out``.
Timings are of this machine and are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments._results import OUT_HELP, results_dir, write_outputs
from grappler_ext.pipeline import DEFAULT_ORDER
from tf_memsafe import hook


@dataclasses.dataclass
class Workload:
    name: str
    fn: Callable        # a Python function of tensors
    args: tuple         # its arguments (NumPy arrays or tensors); empty for closures over a model
    note: str
    limit_factor: float = 0.5   # its limit: this times its figure as written


@dataclasses.dataclass
class Row:
    workload: str
    config: str
    footprint_bytes: int
    seconds: float | None
    rewrites: int
    limit_bytes: int       # the limit it ran under: half the program's figure as written (fits: twice)
    raised: bool           # a rewrite fired and the figure is above the program's as written
    note: str


def naive_knn(k: int):
    def knn(queries, points):
        sq_dist = tf.reduce_sum(tf.square(queries[:, None, :] - points[None, :, :]), axis=-1)  # [Q, N]
        return tf.math.top_k(-sq_dist, k=k).indices                                             # [Q, K]
    return knn


def sgpr_model(n: int, m: int, d: int, kernel):
    import gpflow

    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, d))
    Y = np.sin(X[:, :1]) + 0.1 * rng.standard_normal((n, 1))
    return gpflow.models.SGPR((X, Y), kernel=kernel, inducing_variable=X[:: max(1, n // m)][:m].copy())


def naive_kernel(d: int):
    import gpflow

    class NaiveARDSquaredExponential(gpflow.kernels.Kernel):
        """k(x, y) = s^2 exp(-|(x - y) / l|^2 / 2) with the [.., N, M, D] broadcast."""

        def __init__(self):
            super().__init__()
            self.variance = gpflow.Parameter(1.0, transform=gpflow.utilities.positive())
            self.lengthscales = gpflow.Parameter(np.full(d, 3.0), transform=gpflow.utilities.positive())

        def K(self, X, X2=None):
            X2 = X if X2 is None else X2
            r2 = tf.reduce_sum(tf.square((X[:, None, :] - X2[None, :, :]) / self.lengthscales), -1)
            return self.variance * tf.exp(-0.5 * r2)

        def K_diag(self, X):
            return tf.fill(tf.shape(X)[:-1], tf.squeeze(self.variance))

    return NaiveARDSquaredExponential()


def workloads(quick: bool) -> list[Workload]:
    import gpflow

    rng = np.random.default_rng(0)
    n_knn = 2000 if quick else 20000
    n_gp, m_gp = (2000, 50) if quick else (20000, 500)
    pts = {d: rng.standard_normal((n_knn, d), dtype=np.float32) for d in (3, 64)}
    n_fit = 1000 if quick else 4000
    low = (rng.standard_normal((n_fit, 64), dtype=np.float32), rng.standard_normal((64, n_fit), dtype=np.float32))
    stock = sgpr_model(n_gp, m_gp, 3, gpflow.kernels.SquaredExponential())
    naive = sgpr_model(n_gp, m_gp, 40, naive_kernel(40))
    return [
        Workload("knn_d3", naive_knn(10), (pts[3], pts[3]), f"n = m = {n_knn}, d = 3, k = 10"),
        Workload("knn_d64", naive_knn(10), (pts[64], pts[64]), f"n = m = {n_knn}, d = 64, k = 10"),
        Workload("sgpr_stock", stock.training_loss, (), f"N = {n_gp}, M = {m_gp}, D = 3, float64"),
        Workload("sgpr_naive_kernel", naive.training_loss, (), f"N = {n_gp}, M = {m_gp}, D = 40, float64"),
        Workload("chain_fits", lambda a, b, v: (a @ b) @ v, (low[0], low[1], rng.standard_normal((n_fit, 16),
                 dtype=np.float32)), f"(A B) V, A [{n_fit}, 64], within its limit", limit_factor=2.0),
        Workload("sum_fits", lambda a, b: tf.reduce_sum(a @ b), low, f"sum(A B), A [{n_fit}, 64], within its limit",
                 limit_factor=2.0),
    ]


def configurations() -> dict[str, frozenset[str] | None]:
    """Configuration name -> passes disabled (``None``: measure with the rewrites off)."""
    configs: dict[str, frozenset[str] | None] = {"off": None, "all": frozenset()}
    for name in DEFAULT_ORDER:
        configs[f"only:{name}"] = frozenset(DEFAULT_ORDER) - {name}
    return configs


def time_it(fn, args, repeats: int) -> float:
    def run():
        out = fn(*args)
        tf.nest.map_structure(lambda t: t.numpy(), out)
    run()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(w: Workload, config: str, disabled: frozenset[str] | None, run_limit: int, repeats: int,
            as_written: int) -> Row:
    """One configuration of one workload under its share of its figure as written (``as_written``)."""
    args = tuple(tf.constant(a) for a in w.args)
    limit = int(as_written * w.limit_factor)
    mark = hook.report_mark()
    if disabled is None:
        footprint, rewrites = as_written, 0
    else:
        with tf_memsafe.options(disabled_passes=disabled, memory_limit=limit):
            footprint = tf_memsafe.memory_footprint(w.fn, *args)
        rewrites = sum(r.action == "rewritten" for rep in hook.reports_since(mark) for r in rep.records)
    seconds = None
    if footprint <= run_limit:
        with tf_memsafe.options(disabled_passes=frozenset(DEFAULT_ORDER) if disabled is None else disabled,
                                memory_limit=limit):
            seconds = time_it(tf.function(w.fn, jit_compile=True), args, repeats)
    return Row(w.name, config, footprint, seconds, rewrites, limit, bool(rewrites) and footprint > as_written, w.note)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r.workload for r in rows}, key=[r.workload for r in rows].index)
    configs = sorted({r.config for r in rows}, key=[r.config for r in rows].index)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        by = {r.workload: r for r in rows if r.config == config}
        xs = np.arange(len(names)) + i * width
        axes[0].bar(xs, [by[n].footprint_bytes / 1e6 for n in names], width, label=config)
        axes[1].bar(xs, [by[n].seconds or 0.0 for n in names], width, label=config)
    for ax, label in zip(axes, ["XLA footprint (MB, log scale)", "median time (s; 0 = not run)"]):
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=15)
        ax.set_ylabel(label)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("tf_memsafe match-and-replace passes, each on and off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--run-limit", default="8GB", help="run (and time) only programs that fit this")
    parser.add_argument("--workloads", nargs="*", help="names of the workloads to run (default: all)")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)
    run_limit = tf_memsafe.parse_memory_limit(args.run_limit).resolve(0)

    import gpflow
    from tqdm import tqdm

    tf.get_logger().setLevel("ERROR")  # one fresh trace per configuration is the point, not a mistake
    gpflow.config.set_default_float(np.float64)
    tf_memsafe.enable("1TB")  # each workload runs under half its own figure (measure)
    chosen = [w for w in workloads(args.quick) if not args.workloads or w.name in args.workloads]
    configs = configurations()
    rows = []
    for w in tqdm(chosen, desc="workloads"):
        as_written = tf_memsafe.memory_footprint(w.fn, *(tf.constant(a) for a in w.args), rewrite=False)
        for config, disabled in configs.items():
            rows.append(measure(w, config, disabled, run_limit, args.repeats, as_written))
    stem = os.path.join(args.out, "bench_rewrites")
    write_outputs(rows, Row, stem, {"tensorflow": tf.__version__})
    plot(rows, stem + ".png")
    fmt = tf_memsafe.format_bytes
    for r in rows:
        t = f"{r.seconds * 1e3:9.1f} ms" if r.seconds is not None else "  not run"
        print(f"{r.workload:18} {r.config:26} {fmt(r.footprint_bytes):>11} {t}  rewrites={r.rewrites}"
              f"{'  RAISED' if r.raised else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
