"""A Keras model with MultiHeadAttention trained by ``model.fit(..., jit_compile=True)``, unchanged.

Batches of 2 sequences of L = 1024 with 4 heads: the attention scores are [2, 4, 1024, 1024] f32
= 32 MB, and the training step (forward, backward and the Adam update in one XLA program, tape
inside) holds several of them.  With a 24 MB limit the splitter computes the sequence in slices
and the step's gradients are rebuilt on them: the same losses, the step's program within the limit
(measured: 103 MB naive, 14.7 MB split).
"""

import numpy as np
import tf_keras as keras

import tf_memsafe
from tf_memsafe import xla_flags

L, D, LIMIT = 1024, 32, 24 * 10**6


def fit_losses() -> tuple[list[float], int]:
    """Two epochs of two steps; the losses and XLA's figure for the training step's program."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((L, D))
    attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)(inputs, inputs)
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(attended))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=True)
    x = np.random.default_rng(0).standard_normal((4, L, D)).astype("float32")
    y = np.ones((4, 1), "float32")
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        history = model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False)
        steps = [total for name, total in xla_flags.memory_reports(folder) if "run_step" in name]
    return history.history["loss"], max(steps)


def test_training_step_fits_and_trains_the_same():
    naive_losses, naive_bytes = fit_losses()
    tf_memsafe.enable(LIMIT)
    losses, step_bytes = fit_losses()
    splits = [r for rep in tf_memsafe.reports() for r in rep.records
              if r.pass_name == "splitter" and r.action == "rewritten"]
    assert splits and all(r.plan.rebuilt_gradients == 1 for r in splits), [r.reason for r in splits]
    # Adam's slots are made at the first step: TensorFlow traces the step again without making them and
    # compiles only that trace, the one rewritten (the first was rewritten too, for nothing).
    steps = [(rep.status, rep.retraced) for rep in tf_memsafe.reports() if "run_step" in rep.function_name]
    assert steps == [("skipped", True), ("rewritten", False)], steps
    np.testing.assert_allclose(losses, naive_losses, rtol=1e-5)
    assert naive_bytes > 4 * LIMIT
    assert step_bytes <= LIMIT
