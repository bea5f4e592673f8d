"""Programs compiled to be measured take nothing from XLA's generator of random draws.

XLA seeds each stateful draw it compiles from one generator of the process: a program compiled
only to be measured changed what every program compiled after it drew, the user's own left as
written included.  These tests check the copies measured draw statelessly with the same buffers,
and that measuring leaves a later program's draws (and a tf_keras model's training) as they were.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

from tf_memsafe import keyed_draws, memory

SHAPE = [300, 200]

# Each stateful draw XLA seeds from its generator, scaled into a float output.
DRAWS = {
    "RandomUniform": lambda x: x * tf.random.uniform(SHAPE),
    "RandomStandardNormal": lambda x: x * tf.random.normal(SHAPE),
    "TruncatedNormal": lambda x: x * tf.random.truncated_normal(SHAPE),
    "RandomUniformInt": lambda x: x * tf.cast(tf.random.uniform(SHAPE, 0, 7, dtype=tf.int32), tf.float32),
    "Multinomial": lambda x: x * tf.cast(tf.random.categorical(tf.zeros([SHAPE[0], 10]), SHAPE[1]), tf.float32),
    "ParameterizedTruncatedNormal": lambda x: x * tf.raw_ops.ParameterizedTruncatedNormal(
        shape=SHAPE, means=0.0, stdevs=1.0, minvals=-1.0, maxvals=1.0),
}


def _in_loop(draw):
    """``draw`` inside a while loop's body: the draw is in a function of the library."""
    def program(x):
        return tf.while_loop(lambda i, acc: i < 3, lambda i, acc: (i + 1, acc + draw(x)),
                             (0, tf.zeros(SHAPE)))[1]
    return program


def _traced(program):
    return tf.function(program, jit_compile=True, autograph=False).get_concrete_function(
        tf.TensorSpec([], tf.float32)).graph


def _as_written_figure(program) -> int:
    """XLA's figure for ``program`` compiled as it is, stateful draws and all."""
    fn = tf.function(program, jit_compile=True, autograph=False)
    with memory._measuring() as folder:
        fn.experimental_get_compiler_ir(tf.TensorSpec([], tf.float32))(stage="optimized_hlo")
        return memory._read_total_bytes(folder)


@pytest.mark.parametrize("where", ["top level", "loop body"])
@pytest.mark.parametrize("op_type", sorted(DRAWS))
def test_every_stateful_draw_is_keyed_and_measured_with_its_own_buffers(op_type, where):
    program = DRAWS[op_type] if where == "top level" else _in_loop(DRAWS[op_type])
    graph = _traced(program)
    definition = memory.live_definition(graph)
    assert keyed_draws.draws_from_xla_generator(definition)
    keyed = keyed_draws.keyed(definition)
    ops = {n.op for n in keyed.node} | {n.op for f in keyed.library.function for n in f.node_def}
    assert not ops & set(keyed_draws.STATEFUL_DRAWS), ops
    assert keyed_draws.STATEFUL_DRAWS[op_type].op in ops
    assert keyed_draws.draws_from_xla_generator(definition)          # the definition given is not changed

    keyed_figure, written = memory.graph_bytes(graph), _as_written_figure(program)
    if op_type == "ParameterizedTruncatedNormal":
        # Its only stateless form holds the draw's bits beside it: measured larger, never smaller.
        assert written <= keyed_figure <= 2 * written + 4096
    else:
        assert abs(keyed_figure - written) <= 1024, (keyed_figure, written)


def test_a_keyed_draw_takes_keys_tensorflows_own_kernels_take():
    """A copy's draw of a shape known from its input (a VAE's reparameterisation) is folded into a
    constant by TensorFlow's kernels before XLA compiles it: its keys must be ones those kernels take
    too (a Threefry counter of two words), or TensorFlow logs an error for each (results unchanged).
    Run in a process of its own: the suite hides TensorFlow's warnings."""
    code = textwrap.dedent("""
        import tensorflow as tf
        from tf_memsafe import memory
        w = tf.ones([16, 2048])
        fn = tf.function(lambda x: tf.reduce_sum((x + tf.random.normal(tf.shape(x))) @ w), jit_compile=True)
        print("FIGURE", memory.graph_bytes(fn.get_concrete_function(tf.TensorSpec([2048, 16])).graph))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "1"})
    assert done.returncode == 0 and "FIGURE" in done.stdout, done.stderr[-2000:]
    assert "OP_REQUIRES failed" not in done.stderr, done.stderr[-2000:]


def test_a_program_without_stateful_draws_is_given_back_as_it_is():
    definition = memory.live_definition(_traced(lambda x: x * tf.random.stateless_uniform(SHAPE, seed=[1, 2])))
    assert not keyed_draws.draws_from_xla_generator(definition)
    assert keyed_draws.keyed(definition) is definition


def test_a_loop_alone_with_draws_is_measured_as_any_loop_alone(monkeypatch):
    """A program with stateful draws measured to size a loop (``sizing_only``) is compiled as its keyed
    copy the way any loop alone is (without XLA:CPU's fusion emitters, about half the time), not as a
    whole program: the loops of a step with dropout are sized like those without."""
    asked = []
    measuring = memory._measuring
    monkeypatch.setattr(memory, "_measuring", lambda sizing_only=False: asked.append(sizing_only) or measuring(
        sizing_only))
    fn = tf.function(lambda x: x * tf.random.uniform(SHAPE), jit_compile=True)
    memory._FIGURES.clear()
    assert memory.compiled_bytes(fn, tf.TensorSpec(SHAPE), sizing_only=True) > 0
    assert asked == [True]


# Run in a process of its own (XLA's generator is the process's): "plain" draws and trains as written;
# "measured" measures a program with draws four ways first, then trains with tf_memsafe enabled;
# "compiled", the control, compiles that program as it is first.
_DRAWN_AFTER = """
    import os, sys
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import tensorflow as tf
    import tf_memsafe
    from tf_memsafe import memory

    def drawing(x):
        return tf.reduce_sum(tf.nn.dropout(tf.ones([1000]) * x, 0.5) * tf.range(1000.0))

    spec = tf.TensorSpec([], tf.float32)
    if sys.argv[1] == "measured":
        memory.memory_footprint(drawing, spec)
        memory.compiled_bytes(tf.function(drawing, jit_compile=True), spec)
        memory.graph_bytes(tf.function(drawing, jit_compile=True).get_concrete_function(spec).graph)
        memory.tape_footprint(drawing, spec)         # its forward draws (the backward reads the mask)
    if sys.argv[1] == "compiled":
        tf.function(drawing, jit_compile=True).experimental_get_compiler_ir(spec)(stage="optimized_hlo")
    user = tf.function(drawing, jit_compile=True)
    print("DRAWN", [float(user(tf.constant(1.0))) for _ in range(2)])
    if sys.argv[1] == "compiled":
        sys.exit()

    if sys.argv[1] == "measured":
        tf_memsafe.enable(memory_limit="200kB")      # below the step's arguments: measured, left as written
    tf.keras.utils.set_random_seed(0)
    k = tf.keras
    model = k.Sequential([k.layers.Dense(64, activation="relu", input_shape=(32,)), k.layers.Dropout(0.5),
                          k.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    x, y = np.random.rand(256, 32).astype("float32"), np.random.rand(256, 1).astype("float32")
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False)
    print("LOSSES", history.history["loss"])
    print("STATUS", [(r.status, "XLA's figure" in str(r)) for r in tf_memsafe.reports()
                     if r.function_name == "run_step" and not r.retraced])
"""


def _printed(code: str, mode: str) -> dict[str, str]:
    """What the program ``code`` printed, run in a process of its own with ``mode``: line by first word."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), mode], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}


def test_measuring_leaves_what_later_programs_draw_and_a_dropout_model_trains_as_without():
    """Programs compiled after a measurement draw what they drew without it; so a tf_keras model
    with ``Dropout`` whose step is measured and left as written (it cannot fit) trains to the naive
    run's losses (before: the first epoch's loss 0.488 -> 0.450)."""
    plain, measured = _printed(_DRAWN_AFTER, "plain"), _printed(_DRAWN_AFTER, "measured")
    assert measured["DRAWN"] == plain["DRAWN"]
    assert measured["STATUS"] == "STATUS [('unchanged', True)]"
    assert measured["LOSSES"] == plain["LOSSES"]
    # The control: compiled as it is, the same program would have changed them.
    assert _printed(_DRAWN_AFTER, "compiled")["DRAWN"] != plain["DRAWN"]
