"""Redistribution between DTensor layouts: ``tf_memsafe.relayout`` against DTensor's own, per device.

    python -m experiments.distributed [--quick] [--out experiments/results]

On a 2 x 4 mesh of logical CPU devices, for every pair of distinct layouts of an f32[4096, 4096] matrix
(7 layouts: each dimension sharded over x, over y, or not, no axis twice) and of an f32[2^24] vector
(3 layouts): 48 pairs.  Per pair, the memory each device needs beyond the source it holds, over Rink et
al.'s bound (the larger of the source and target shards, per device):

* ``peak_over_bound`` -- tf_memsafe's, exact per device: the most any device's compiled assembly program
  allocates (XLA's buffer assignment: outputs and temporaries, not the shards it reads);
* ``allocator_over_bound`` and ``dtensor_allocator_over_bound`` -- the process allocator's peak above
  what was held before the call, over eight devices (the logical devices share one allocator, so this
  is a mean per device; DTensor's relayout has no per-device program to read), median of the repeats;

and the median time of a warm call of each (interleaved, the shards read back), with their ratio.
Values are compared with DTensor's shard by shard.  The measurement runs in a child process, which
splits the CPU into eight logical devices before TensorFlow's runtime starts.  The machine runs nothing
else while it is timed.

Then the Transformer of ``experiments/transformer`` trained by two worker processes under
``MultiWorkerMirroredStrategy``, each under tf_memsafe's limit, against one process training the same
global batch (``experiments/multi_worker.py`` says how): its losses and each worker's XLA figure.

Writes ``distributed.json`` (``relayout``: one row per pair; ``multi_worker``), ``distributed.csv`` (the
relayout rows) and ``distributed.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

from experiments._results import OUT_HELP, results_dir

MATRIX, VECTOR, REPEATS = (4096, 4096), (1 << 24,), 7
QUICK_MATRIX, QUICK_VECTOR, QUICK_REPEATS = (256, 512), (1 << 16,), 2
MESH = (("x", 2), ("y", 4))
# A quick run's pairs: one of each kind of collective and their mixtures, and the vector's.
QUICK_PAIRS = {(("x", "y"), ("y", "x")), (("x", None), (None, "x")), (("x", "y"), (None, None)),
               ((None, None), ("x", "y")), (("x", None), ("y", None)), (("y", None), ("y", "x")),
               (("x",), (None,)), ((None,), ("y",)), (("x",), ("y",))}
# The multi-worker Transformer run: sequence length, steps, per-worker limit.  The quick run's limit is
# just under a worker's naive step (4.75 MB): its loops are not starved, so no growth search (about
# 30 s a worker, not 50, at 3 MiB).
MULTI_WORKER, QUICK_MULTI_WORKER = (1024, 3, 8 * 2**20), (256, 2, 4 * 2**20)


@dataclasses.dataclass
class Row:
    shape: str                        # "4096x4096"
    source: str                       # "(x, -)": each dimension's mesh axis, "-" for none
    target: str
    collectives: str                  # what the changed axes amount to
    bound_bytes: int                  # max(source shard, target shard), per device
    plan_peak_over_bound: float       # the plan's figure
    peak_over_bound: float            # XLA's: the most a device's assembly program allocates
    allocator_over_bound: float | None   # the shared allocator's peak over 8 devices, tf_memsafe (None: no stats)
    dtensor_allocator_over_bound: float | None
    time_s: float                     # median warm call, tf_memsafe
    dtensor_time_s: float
    time_ratio: float                 # time_s / dtensor_time_s
    equal: bool                       # shards equal DTensor's


def _layouts(rank: int) -> list[tuple[str | None, ...]]:
    return [s for s in itertools.product([None, "x", "y"], repeat=rank)
            if len([a for a in s if a]) == len({a for a in s if a})]


def _text(specs) -> str:
    return "(" + ", ".join(a or "-" for a in specs) + ")"


def measure(matrix: tuple[int, ...], vector: tuple[int, ...], repeats: int, quick: bool = False) -> list[Row]:
    """Every pair's row (in this process, whose TensorFlow runtime must not have started); a quick run
    measures the pairs of :data:`QUICK_PAIRS` only (``tests/tf_memsafe/test_relayout.py`` checks all)."""
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    from tensorflow.experimental import dtensor

    import tf_memsafe
    from tf_memsafe import xla_flags
    from tf_memsafe.report import _collective_text

    mesh = dtensor.create_mesh(list(MESH), device_type="CPU")

    def layout(specs):
        return dtensor.Layout([a or dtensor.UNSHARDED for a in specs], mesh)

    def allocated(key: str) -> int | None:
        try:
            return tf.config.experimental.get_memory_info("CPU:0")[key]
        except ValueError:      # (a build whose CPU allocator keeps no statistics: the CUDA build without a GPU)
            return None

    def timed(fn):
        before = allocated("current")
        if before is not None:
            tf.config.experimental.reset_memory_stats("CPU:0")
        start = time.perf_counter()
        out = fn()
        shards = [s.numpy() for s in dtensor.unpack(out)]
        seconds = time.perf_counter() - start
        return shards, seconds, None if before is None else allocated("peak") - before

    rows = []
    for shape in (matrix, vector):
        full = tf.random.stateless_normal(shape, [0, 1])
        for source, target in itertools.product(_layouts(len(shape)), repeat=2):
            if source == target or (quick and (source, target) not in QUICK_PAIRS):
                continue
            x = dtensor.relayout(dtensor.copy_to_mesh(full, layout([None] * len(shape))), layout(source))
            plan = tf_memsafe.explain_relayout(x, layout(target)).plan
            with xla_flags.dump_all_compiles(in_memory=True) as folder:
                ours = [s.numpy() for s in dtensor.unpack(tf_memsafe.relayout(x, layout(target)))]
                programs = [own for name, own in xla_flags.allocated_reports(folder) if "assemble" in name]
            theirs = [s.numpy() for s in dtensor.unpack(dtensor.relayout(x, layout(target)))]
            equal = all(np.array_equal(a, b) for a, b in zip(ours, theirs))
            del ours, theirs
            runs = {"tf_memsafe": [], "dtensor": []}
            for _ in range(repeats):                      # interleaved
                for name, fn in (("tf_memsafe", tf_memsafe.relayout), ("dtensor", dtensor.relayout)):
                    _, seconds, peak = timed(lambda fn=fn, x=x, target=target: fn(x, layout(target)))
                    runs[name].append((seconds, peak))
            med = {k: (statistics.median(s for s, _ in v), None if any(p is None for _, p in v) else
                       statistics.median(p for _, p in v)) for k, v in runs.items()}
            bound = plan.bound_bytes
            rows.append(Row("x".join(map(str, shape)), _text(source), _text(target),
                            ", ".join(_collective_text(c) for c in plan.collectives), bound,
                            plan.peak_over_bound, max(programs, default=0) / bound,
                            *(None if med[k][1] is None else med[k][1] / 8 / bound for k in ("tf_memsafe", "dtensor")),
                            med["tf_memsafe"][0], med["dtensor"][0], med["tf_memsafe"][0] / med["dtensor"][0], equal))
            del x
    return rows


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    labels = [f"{r.source}->{r.target}" + ("" if "x" in r.shape else " 1-D") for r in rows]
    at = range(len(rows))
    theirs = [float("nan") if r.dtensor_allocator_over_bound is None else r.dtensor_allocator_over_bound for r in rows]
    ax.bar([i - 0.2 for i in at], theirs, 0.4, label="dtensor.relayout")
    ax.bar([i + 0.2 for i in at], [r.peak_over_bound for r in rows], 0.4, label="tf_memsafe.relayout")
    ax.axhline(1.25, color="k", lw=0.8, ls="--", label="1.25x the bound")
    ax.set_yscale("log")
    ax.set_ylabel("per-device peak / max(source, target shard)")
    ax.set_xticks(list(at), labels, rotation=90, fontsize=6)
    ax.legend(fontsize=8)
    ax.set_title("Relayout on a 2x4 mesh of CPU devices: memory per device over Rink's bound")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, nine pairs")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = (QUICK_MATRIX, QUICK_VECTOR, QUICK_REPEATS) if args.quick else (MATRIX, VECTOR, REPEATS)
    if args.child:
        print(json.dumps([dataclasses.asdict(r) for r in measure(*sizes, quick=args.quick)]))
        return 0
    child = [sys.executable, "-m", "experiments.distributed", "--child"] + (["--quick"] if args.quick else [])
    # (the allocator's statistics: TensorFlow keeps them for a BFC allocator, its CPU default only with oneDNN)
    env = {"TF_CPU_ALLOCATOR_USE_BFC": "true", **os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(child, capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return done.returncode
    rows = [Row(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]
    from experiments import multi_worker
    from experiments._results import machine_meta

    length, steps, limit = QUICK_MULTI_WORKER if args.quick else MULTI_WORKER
    cluster = multi_worker.run(length, steps, limit)

    out = results_dir(args.out, args.quick)
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "distributed")
    meta = {**machine_meta(), "quick": args.quick, "mesh": dict(MESH), "matrix": list(sizes[0]),
            "vector": list(sizes[1]), "repeats": sizes[2],
            "how": "logical CPU devices of one process; nothing else running; tf_memsafe and DTensor interleaved"}
    import csv

    with open(stem + ".csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[fld.name for fld in dataclasses.fields(Row)])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in rows)
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump({**meta, "relayout": [dataclasses.asdict(r) for r in rows], "multi_worker": cluster}, f, indent=1)
    plot(rows, stem + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
