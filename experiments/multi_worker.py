"""The Transformer of ``experiments/transformer`` trained under ``MultiWorkerMirroredStrategy`` by two worker
processes on this machine, each under tf_memsafe's limit, against one process training the same global
batch without a strategy and without tf_memsafe.

    python -m experiments.multi_worker [--length L] [--steps S] [--limit BYTES]

Each worker gets ``TF_CONFIG`` naming both on localhost ports, builds the model and an SGD optimizer
in ``strategy.scope()`` from the same seed, and runs a custom training loop: ``strategy.run`` of a step
whose loss and gradients come from a ``tf.function(jit_compile=True)`` (tape inside) on its half of the
global batch, the loss scaled by the number of replicas; the optimizer sums the gradients across the
workers. ``tf_memsafe.enable(limit)`` is called before the step is traced, so each worker's program is
rewritten for the limit; XLA's "Total bytes used" of each worker's step program is read from its dump.

The single process trains the same model on the whole global batch with the same optimizer: with no
padding in the batch, the mean loss over the global batch is the mean of the workers' means, so the
losses of every step must agree to float32 rounding. It also reports XLA's figure for one worker's step
as written (the per-replica batch, compiled, not run), which must be over the limit.

:func:`run` starts the workers, bounded in time, and kills whatever is left of them on the way out.
``experiments/distributed.py`` records its result; ``tests/experiments/test_multi_worker.py`` runs it small.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS, GLOBAL_BATCH, SEED = 2, 2, 0
SMALL = {"num_layers": 1, "d_model": 32, "dff": 64, "num_heads": 2, "input_vocab_size": 64,
         "target_vocab_size": 64, "dropout_rate": 0.0}


def _free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in socks]


def _model_and_data(length: int):
    import tensorflow as tf

    from experiments.transformer.model import TransformerConfig, build_transformer

    tf.keras.utils.set_random_seed(SEED)
    model = build_transformer(TransformerConfig(max_length=length, **SMALL), keras_version=2)
    gen = tf.random.Generator.from_seed(SEED + 1)

    def tokens():
        return gen.uniform([GLOBAL_BATCH, length], 1, SMALL["target_vocab_size"], tf.int32)  # no padding (0)

    return model, (tokens(), tokens(), tokens())


def _loss_and_grads(model, scale: float):
    import tensorflow as tf

    from experiments.transformer.model import masked_loss

    @tf.function(jit_compile=True)
    def loss_and_grads(context, target_in, labels):
        with tf.GradientTape() as tape:
            loss = masked_loss(labels, model((context, target_in), training=False)) * scale
        return loss, tape.gradient(loss, model.trainable_variables)

    return loss_and_grads


def worker(index: int, ports: list[int], length: int, steps: int, limit: int) -> dict:
    """One worker's run (in its own process): its losses, its step programs' XLA figures, the splitter."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": index}})
    import tensorflow as tf

    import tf_memsafe
    from tf_memsafe import hook, xla_flags

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model, (context, target_in, labels) = _model_and_data(length)
        import tf_keras
        optimizer = tf_keras.optimizers.SGD(0.5)
    share = GLOBAL_BATCH // strategy.num_replicas_in_sync
    mine = slice(index * share, (index + 1) * share)
    grads_fn = _loss_and_grads(model, 1.0 / strategy.num_replicas_in_sync)

    @tf.function
    def step():
        def replica():
            loss, grads = grads_fn(context[mine], target_in[mine], labels[mine])
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(replica), axis=None)

    tf_memsafe.enable(limit)
    mark = hook.report_mark()
    losses = []
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        for _ in range(steps):
            losses.append(float(step()))
        programs = [total for name, total in xla_flags.memory_reports(folder) if "loss_and_grads" in name]
    actions = [r.action for rep in hook.reports_since(mark) for r in rep.records if r.pass_name == "splitter"]
    tf_memsafe.disable()
    return {"index": index, "losses": losses, "programs": programs, "splitter": actions,
            "replicas": strategy.num_replicas_in_sync}


def single(length: int, steps: int) -> dict:
    """The same global batch trained in one process, no strategy, no tf_memsafe; and XLA's figure for one
    worker's step as written."""
    import tensorflow as tf
    import tf_keras

    import tf_memsafe

    model, (context, target_in, labels) = _model_and_data(length)
    optimizer = tf_keras.optimizers.SGD(0.5)
    grads_fn = _loss_and_grads(model, 1.0)
    share = GLOBAL_BATCH // WORKERS
    per_worker = tf_memsafe.memory_footprint(_loss_and_grads(model, 1.0 / WORKERS), context[:share],
                                             target_in[:share], labels[:share], rewrite=False)
    losses = []
    for _ in range(steps):
        loss, grads = grads_fn(context, target_in, labels)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    del tf
    return {"losses": losses, "per_worker_naive_bytes": per_worker}


def _child(args: list[str], timeout: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "experiments.multi_worker", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def run(length: int = 512, steps: int = 3, limit: int = 4 * 2**20, timeout: float = 600) -> dict:
    """Two workers and the single process, each bounded by ``timeout`` seconds; every child is killed on
    the way out, whatever happens.  Raises ``RuntimeError`` with a child's error output if one fails."""
    ports = _free_ports(WORKERS)
    common = ["--length", str(length), "--steps", str(steps), "--limit", str(limit)]
    start = time.perf_counter()
    children = []
    try:
        children = [_child(["--worker", str(i), "--ports", ",".join(map(str, ports)), *common], timeout)
                    for i in range(WORKERS)]
        outs = []
        for child in children:
            left = max(1.0, timeout - (time.perf_counter() - start))
            out, err = child.communicate(timeout=left)
            if child.returncode:
                raise RuntimeError(f"worker failed ({child.returncode}): {err[-3000:]}")
            outs.append(_last_json(out))
        workers_s = time.perf_counter() - start
        alone = _child(["--single", *common], timeout)
        children.append(alone)
        out, err = alone.communicate(timeout=max(1.0, timeout - (time.perf_counter() - start)))
        if alone.returncode:
            raise RuntimeError(f"single process failed ({alone.returncode}): {err[-3000:]}")
        return {"length": length, "steps": steps, "limit_bytes": limit, "workers": outs,
                "single": _last_json(out), "workers_seconds": workers_s}
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--limit", type=int, default=4 * 2**20)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ports", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        result = worker(args.worker, [int(p) for p in args.ports.split(",")], args.length, args.steps, args.limit)
    elif args.single:
        result = single(args.length, args.steps)
    else:
        result = run(args.length, args.steps, args.limit)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
