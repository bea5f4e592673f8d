"""First calls of attention layers whose causal masks XLA folds slowly, as written and under tf_memsafe.

    python -m experiments.compile_time [--quick] [--out experiments/results] [--timeout 300]
        [--layers keras3_mha tf_keras_attention] [--lengths 1024 2048]

Keras 3's ``MultiHeadAttention(use_causal_mask=True)`` with dropout (the path that computes explicit
scores; without dropout Keras 3 calls the backend's fused attention, masked with ``band_part``) and
tf_keras' ``Attention(use_causal_mask=True)`` build their causal masks as two running sums of a
``[1, L, L]`` fill of ones.  XLA folds those scans at compile time, element by element; the
``constant_cumsum`` pass turns them into broadcast indices first.

Per layer and length L (batch 2, 64 features, 8 heads of 16, float32, ``training=False``): the first
call of a ``tf.function(jit_compile=True)`` holding the layer (trace, rewrite, XLA compile and one
run), each in a fresh process so that nothing is cached, for

* ``naive``: tf_memsafe not enabled;
* ``tf_memsafe``: enabled with a 4 GB limit, which every program here is within: only the
  algebraic passes change it (``constant_cumsum``);
* ``no_constant_cumsum``: the same with ``constant_cumsum`` disabled (what the other passes cost).

The calls are interleaved by length (naive, tf_memsafe, no_constant_cumsum at each L), and a call
that takes longer than ``--timeout`` seconds is stopped and recorded as such.  Outputs are compared
with the naive one (largest difference over the largest magnitude) where both ran.  Run alone on the
machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from experiments._results import OUT_HELP, machine_meta, max_rel_diff, results_dir, rewrite_counts, write_outputs

LAYERS = ("keras3_mha", "tf_keras_attention")
METHODS = ("naive", "tf_memsafe", "no_constant_cumsum")
LENGTHS = (1024, 2048)
QUICK_LENGTHS = (128, 256)
BATCH, FEATURES, HEADS, KEY_DIM = 2, 64, 8, 16


@dataclasses.dataclass
class Row:
    layer: str
    length: int
    method: str
    first_call_s: float | None   # trace + rewrite + compile + one run; None: stopped after --timeout
    second_call_s: float | None
    rewrites: str                # the passes that rewrote the function, with their counts
    max_rel_diff: float | None   # against the naive output, where both ran
    note: str


def _layer(name: str):
    """``(fn, normal)``: the layer as a function of a [BATCH, L, FEATURES] input (weights built eagerly),
    and the seeded normal sampler its inputs are drawn from."""
    import numpy as np
    import tensorflow as tf

    if name == "keras3_mha":
        import keras

        keras.utils.set_random_seed(0)
        layer = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=KEY_DIM, dropout=0.1)
        fn = lambda x: layer(x, x, use_causal_mask=True, training=False)
    elif name == "tf_keras_attention":
        import tf_keras

        tf_keras.utils.set_random_seed(0)
        layer = tf_keras.layers.Attention()
        fn = lambda x: layer([x, x], use_causal_mask=True)
    else:
        raise ValueError(f"unknown layer {name!r}; known: {LAYERS}")
    fn(tf.zeros([1, 4, FEATURES]))
    return fn, np.random.default_rng(0).standard_normal


def one(layer: str, length: int, method: str) -> dict:
    """Measure one first call in this process (which must not have compiled anything before)."""
    import numpy as np
    import tensorflow as tf

    import tf_memsafe  # before anything compiles: it manages XLA_FLAGS

    fn, normal = _layer(layer)
    x = tf.constant(normal((BATCH, length, FEATURES)).astype(np.float32))
    if method == "tf_memsafe":
        tf_memsafe.enable("4GB")
    elif method == "no_constant_cumsum":
        tf_memsafe.enable("4GB", disabled_passes=["constant_cumsum"])
    elif method != "naive":
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    compiled = tf.function(fn, jit_compile=True)
    start = time.perf_counter()
    out = compiled(x).numpy()
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiled(x).numpy()
    second = time.perf_counter() - start
    return {"first_call_s": first, "second_call_s": second, "output": out.tolist(),
            "rewrites": rewrite_counts(tf_memsafe.reports())}


def _in_fresh_process(layer: str, length: int, method: str, timeout: float) -> dict | None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        done = subprocess.run([sys.executable, "-m", "experiments.compile_time", "--one", layer, str(length), method],
                              capture_output=True, text=True, timeout=timeout, env=env, check=True, cwd=root)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _diff(got, ref) -> float:
    """:func:`~experiments._results.max_rel_diff` of two outputs read back from JSON, in float64."""
    import numpy as np

    return max_rel_diff(np.asarray(got, np.float64), np.asarray(ref, np.float64))


def run(lengths, timeout: float, layers=LAYERS) -> list[Row]:
    rows: list[Row] = []
    for layer in layers:
        for length in lengths:
            results = {m: _in_fresh_process(layer, length, m, timeout) for m in METHODS}
            naive = results["naive"]
            for method, res in results.items():
                if res is None:
                    rows.append(Row(layer, length, method, None, None, "", None,
                                    f"stopped after {timeout:g} s (compiling)"))
                else:
                    diff = _diff(res["output"], naive["output"]) if naive is not None else None
                    rows.append(Row(layer, length, method, round(res["first_call_s"], 3),
                                    round(res["second_call_s"], 4), res["rewrites"], diff, ""))
                print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short sequences, a smoke run")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one first call may take")
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS))
    parser.add_argument("--lengths", type=int, nargs="+", help=f"sequence lengths (default {LENGTHS}; quick "
                        f"{QUICK_LENGTHS})")
    parser.add_argument("--one", nargs=3, metavar=("LAYER", "LENGTH", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        layer, length, method = args.one
        print(json.dumps(one(layer, int(length), method)))
        return 0
    lengths = tuple(args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS))
    rows = run(lengths, args.timeout, tuple(args.layers))
    meta = {"quick": args.quick, "layers": args.layers, "lengths": list(lengths), "timeout_s": args.timeout,
            "batch": BATCH, "features": FEATURES, "heads": HEADS, "key_dim": KEY_DIM,
            **machine_meta(),
            "how": "run alone on the machine; each first call in a fresh process; methods interleaved by length"}
    write_outputs(rows, Row, os.path.join(results_dir(args.out, args.quick), "compile_time"), meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
