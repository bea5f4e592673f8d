"""GPflow's GPR, unchanged, under limits 8x below its naive figure: predictions, solves, loss.

    python -m experiments.gpr [--quick] [--out experiments/results]

Workloads (float64, ``SquaredExponential`` on 3-D inputs, GPflow 2.11 as shipped):

* ``predict``: ``GPR.predict_f`` at ``T`` test points (mean and marginal variance): ``K(X, X*)``
  [N, T] and ``A = L⁻¹ K(X, X*)`` are split along the test points, ``L`` [N, N] read whole;
* ``solve``: ``sum((L⁻¹ B)², 0)`` for a lower-triangular ``L`` [N, N] and ``R`` right-hand sides
  ``B = cos(a bᵀ)`` [N, R] computed in the function from ``a`` [N] and ``b`` [R], as a kernel
  matrix is (the variances' pattern), split along the right-hand sides.  (Right-hand sides given
  as an input are held whole: the limit could not be 8x below a program that is mostly its input.)
* ``loss``: ``GPR.training_loss`` with its gradients (tape inside).  Its Cholesky factor couples
  every entry: the factor is held as packed lower-triangular blocks, the kernel matrix computed a
  tile at a time and never whole, the gradient's [N, N] tensors never formed (``packed_cholesky``):
  N² / 2 entries where the program as written holds about five [N, N] buffers.

For each: XLA's "Total bytes used" as written, and with tf_memsafe under ``figure / 8`` (compiled,
not run: at full size the naive programs need tens of GB), with the rewrite's status and time.
The values are compared with the unsplit program at the ``check`` sizes, where both run, and both
are timed there: the fastest of ``REPEATS`` warm calls each, the two programs taking turns
(``_methods.time_interleaved``), so ``tfms_s / naive_s`` is what the loops, the blocked factor and
the blocked solves cost where the program as written fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
import tensorflow as tf

import tf_memsafe  # before the first XLA compile: it manages XLA_FLAGS
from experiments._methods import time_interleaved
from experiments._results import OUT_HELP, machine_meta, max_rel_diff, results_dir, write_outputs
from tf_memsafe import hook

DIVISOR = 8
REPEATS = 5
FULL = {"predict": dict(n=20_000, t=100_000), "solve": dict(n=2_000, t=100_000), "loss": dict(n=20_000, t=0)}
CHECK = {"predict": dict(n=2_000, t=20_000), "solve": dict(n=1_000, t=20_000), "loss": dict(n=3_000, t=0)}
QUICK = {"predict": dict(n=300, t=8_000), "solve": dict(n=300, t=8_000), "loss": dict(n=600, t=0)}


@dataclasses.dataclass
class Row:
    workload: str
    n: int
    t: int                    # test points (predict) or right-hand sides (solve); 0 for the loss
    kind: str                 # "footprint" (compiled only) or "check" (both run, values compared)
    naive_bytes: int
    limit_bytes: int
    tfms_bytes: int
    within_limit: bool
    rewrite_s: float          # trace + rewrite + compile of the tf_memsafe program
    status: str
    max_rel_diff: float | None  # against the unsplit program ("check" rows)
    naive_s: float | None = None  # the fastest warm call as written ("check" rows)
    tfms_s: float | None = None   # the fastest warm call with tf_memsafe, the two taking turns


def _model(n: int):
    import gpflow

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3))
    y = np.sin(x[:, :1]) + 0.1 * rng.standard_normal((n, 1))
    return gpflow.models.GPR((x, y), kernel=gpflow.kernels.SquaredExponential(lengthscales=np.ones(3)))


def workload(name: str, n: int, t: int):
    """``(fn, args)`` of one workload at its sizes."""
    rng = np.random.default_rng(1)
    if name == "solve":
        lower = tf.constant(np.tril(rng.standard_normal((n, n))) + n ** 0.5 * 4 * np.eye(n))

        def solve(lower, a, b):
            rhs = tf.cos(a[:, None] * b[None, :])                                        # [N, R]
            return tf.reduce_sum(tf.square(tf.linalg.triangular_solve(lower, rhs, lower=True)), 0)

        return solve, (lower, tf.constant(rng.standard_normal(n)), tf.constant(rng.standard_normal(t)))
    model = _model(n)
    if name == "predict":
        return model.predict_f, (tf.constant(rng.standard_normal((t, 3))),)

    def loss_and_gradients():
        with tf.GradientTape() as tape:
            loss = model.training_loss()
        return (loss,) + tuple(tape.gradient(loss, model.trainable_variables))

    return loss_and_gradients, ()


def measure(name: str, n: int, t: int, check: bool) -> Row:
    fn, args = workload(name, n, t)
    naive = tf_memsafe.memory_footprint(fn, *args, rewrite=False)
    limit = naive // DIVISOR
    mark = hook.report_mark()
    start = time.perf_counter()
    with tf_memsafe.options(memory_limit=limit):
        got_bytes = tf_memsafe.memory_footprint(fn, *args)
        seconds = time.perf_counter() - start
        reports = hook.reports_since(mark)
    status = reports[-1].status if reports else "no trace"
    row = Row(name, n, t, "check" if check else "footprint", naive, limit, got_bytes, got_bytes <= limit,
              round(seconds, 2), status, None)
    if check:
        rewritten, as_written = tf.function(fn, jit_compile=True), tf.function(fn, jit_compile=True)

        def tfms():
            with tf_memsafe.options(memory_limit=limit):
                return rewritten(*args)

        def naive_call():
            with hook.suspended():
                return as_written(*args)

        timed = time_interleaved({"naive": naive_call, "tf_memsafe": tfms}, REPEATS)
        (row.naive_s, _, expected), (row.tfms_s, _, got) = timed["naive"], timed["tf_memsafe"]
        row.max_rel_diff = max_rel_diff(got, expected)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument("--workloads", nargs="*", choices=sorted(FULL), help="default: all")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.quick)

    import gpflow

    tf.get_logger().setLevel("ERROR")
    gpflow.config.set_default_float(np.float64)
    tf_memsafe.enable("80%")
    rows = []
    for name in args.workloads or list(FULL):
        if args.quick:
            rows.append(measure(name, **QUICK[name], check=True))
            continue
        rows.append(measure(name, **CHECK[name], check=True))
        rows.append(measure(name, **FULL[name], check=False))
        print(rows[-2], rows[-1], sep="\n", flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_outputs(rows, Row, os.path.join(args.out, "gpr"), {"quick": args.quick, "divisor": DIVISOR, **machine_meta()})
    fmt = tf_memsafe.format_bytes
    for r in rows:
        diff = "-" if r.max_rel_diff is None else f"{r.max_rel_diff:.1e}"
        if r.naive_s is not None:
            diff += f", warm call {r.naive_s:.3f} s -> {r.tfms_s:.3f} s ({r.tfms_s / r.naive_s:.2f}x)"
        print(f"{r.workload:8} n={r.n:<6} t={r.t:<7} {r.kind:9} {fmt(r.naive_bytes):>10} -> {fmt(r.tfms_bytes):>10} "
              f"(limit {fmt(r.limit_bytes)}, {'within' if r.within_limit else 'OVER'}) {r.rewrite_s:7.1f} s "
              f"{r.status:10} diff {diff}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
