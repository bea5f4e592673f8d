"""``tf_memsafe.relayout`` on a 2 x 4 mesh of logical CPU devices, run by ``test_relayout.py`` in a process
of its own (TensorFlow splits the CPU into logical devices only before its runtime starts).

``python -m tests.tf_memsafe.relayout_matrix`` prints one JSON object: for every pair of layouts of a
matrix and of a vector, whether the shards equal ``dtensor.relayout``'s, the plan's peak over Rink's
bound, what each device's compiled program allocates by XLA's buffer assignment (outputs and
temporaries, not the shards it reads), and the allocator's peak during a warm call (the eight devices
share one allocator: its peak above what was held before, over eight devices and over the bound);
then what the bad-input cases raised or warned.
"""

from __future__ import annotations

import itertools
import json
import sys
import warnings

import numpy as np
import tensorflow as tf

MATRIX, VECTOR = (1024, 2048), (1 << 21,)


def gather_check() -> int:
    """Under ``LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2=1`` (set by the caller), a (y, x)-sharded
    array gathered to replicated: tf_memsafe's values and DTensor's, each against the array itself."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    from tensorflow.experimental import dtensor

    import tf_memsafe

    mesh = dtensor.create_mesh([("x", 2), ("y", 4)], device_type="CPU")
    full = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(full), dtensor.Layout.replicated(mesh, 2)),
                         dtensor.Layout(["y", "x"], mesh))
    target = dtensor.Layout.replicated(mesh, 2)

    def right(out):
        return float(np.mean([np.array_equal(s.numpy(), full) for s in dtensor.unpack(out)]))

    print(json.dumps({"ours": right(tf_memsafe.relayout(x, target)), "dtensor": right(dtensor.relayout(x, target))}))
    return 0


def main() -> int:
    if "--gather-check" in sys.argv:
        return gather_check()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    from tensorflow.experimental import dtensor

    import tf_memsafe
    from tf_memsafe import hook, xla_flags

    mesh = dtensor.create_mesh([("x", 2), ("y", 4)], device_type="CPU")
    unsharded = dtensor.UNSHARDED

    def layout(specs):
        return dtensor.Layout([a or unsharded for a in specs], mesh)

    def layouts(rank):
        return [s for s in itertools.product([None, "x", "y"], repeat=rank)
                if len([a for a in s if a]) == len({a for a in s if a})]

    def peak(fn):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        out = fn()
        for shard in dtensor.unpack(out):
            shard.numpy()
        return out, tf.config.experimental.get_memory_info("CPU:0")["peak"] - before

    rows = []
    other_dtypes = [(("x", "y"), ("y", "x")), (("x", None), (None, None)), ((None, "y"), ("x", None))]
    for shape, dtype, pairs in [(MATRIX, tf.float32, list(itertools.product(layouts(2), repeat=2))),
                                (VECTOR, tf.float32, list(itertools.product(layouts(1), repeat=2))),
                                ((64, 96), tf.int32, other_dtypes), ((64, 96), tf.float64, other_dtypes)]:
        full = tf.cast(tf.reshape(tf.range(np.prod(shape)), shape), dtype)
        for source, target in pairs:
            x = dtensor.relayout(dtensor.copy_to_mesh(full, layout([None] * len(shape))), layout(source))
            expected = [s.numpy() for s in dtensor.unpack(dtensor.relayout(x, layout(target)))]
            report = tf_memsafe.explain_relayout(x, layout(target))
            with xla_flags.dump_all_compiles(in_memory=True) as folder:
                tf_memsafe.relayout(x, layout(target))                  # compiles, one program per device
                programs = [own for name, own in xla_flags.allocated_reports(folder) if "assemble" in name]
            got, used = peak(lambda x=x, target=target: tf_memsafe.relayout(x, layout(target)))
            rows.append({"shape": list(shape), "dtype": dtype.name, "source": list(source), "target": list(target),
                         "equal": all(np.array_equal(a, s.numpy()) for a, s in zip(expected, dtensor.unpack(got))),
                         "same_layout": dtensor.fetch_layout(got) == layout(target),
                         "plan_peak_over_bound": report.plan.peak_over_bound,
                         "programs": len(programs),
                         "assembled": sum(not (a.reuse or a.leading_slice) for a in report.plan.assemblies),
                         "target_shard_bytes": report.plan.target_shard_bytes,
                         "xla_allocated_max": max(programs, default=0),
                         "measured_peak_over_bound": used / 8 / report.plan.bound_bytes})
            del got, x

    x = dtensor.copy_to_mesh(tf.reshape(tf.range(64.0), (8, 8)), layout(("x", "y")))
    cases = {}

    def outcome(fn):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn()
            return {"ok": True, "warnings": [str(w.message) for w in caught],
                    "equal": out is not None and np.array_equal(
                        dtensor.relayout(out, layout((None, None))).numpy(), np.arange(64.0).reshape(8, 8))}
        except Exception as e:  # noqa: BLE001 - the case records what was raised
            return {"ok": False, "error": type(e).__name__, "message": str(e)}

    other = dtensor.create_mesh([("b", 8)], device_type="CPU")
    cases["plain_tensor"] = outcome(lambda: tf_memsafe.relayout(tf.ones((8, 8)), layout(("x", None))))
    cases["not_a_layout"] = outcome(lambda: tf_memsafe.relayout(x, ["x", None]))
    cases["other_mesh"] = outcome(lambda: tf_memsafe.relayout(x, dtensor.Layout(["b", unsharded], other)))
    cases["rank"] = outcome(lambda: tf_memsafe.relayout(x, layout(("x",))))
    odd = dtensor.copy_to_mesh(tf.ones((6, 8)), layout((None, None)))
    cases["not_divisible"] = outcome(lambda: tf_memsafe.relayout(odd, layout(("y", None))))
    cases["in_function"] = outcome(lambda: tf.function(lambda v: tf_memsafe.relayout(v, layout(("y", "x"))))(x))
    cases["in_function_again"] = outcome(lambda: tf.function(lambda v: tf_memsafe.relayout(v, layout((None, "x"))))(x))
    tf_memsafe.enable("1GB")
    mark = hook.report_mark()
    cases["enabled"] = outcome(lambda: tf_memsafe.relayout(x, layout(("y", "x"))))
    cases["enabled"]["hook_reports"] = len(hook.reports_since(mark))
    tf_memsafe.disable()
    cases["explain"] = str(tf_memsafe.explain_relayout(x, layout(("y", "x"))))
    print(json.dumps({"pairs": rows, "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
