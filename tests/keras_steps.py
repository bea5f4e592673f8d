"""A Dense layer's training step as a Keras user writes it, for the tests of variable updates and wide
layers: mean squared error against a target, ``tape.gradient`` and ``apply_gradients`` in one step."""

import tensorflow as tf

OPTIMIZERS = ("sgd", "momentum", "adam")


def optimizer(keras, name: str):
    """Keras' SGD (0.1), SGD with momentum 0.9, or Adam (0.01)."""
    if name == "sgd":
        return keras.optimizers.SGD(0.1)
    if name == "momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.Adam(1e-2)


def dense_step(keras, name: str, d_in: int, d_out: int, dtype: str = "float32"):
    """``(step, values)``: a fresh ``Dense(d_out)`` on ``d_in`` inputs and its optimizer, built before
    any trace from a fixed seed; ``step(x, y)`` (a plain Python function) returns the loss, and
    ``values()`` the layer's variables and the optimizer's, as arrays."""
    keras.utils.set_random_seed(1)
    layer = keras.layers.Dense(d_out, dtype=dtype)
    layer.build((None, d_in))
    opt = optimizer(keras, name)
    opt.build(layer.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x) - y))
        grads = tape.gradient(loss, layer.trainable_variables)
        opt.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    return step, lambda: [v.numpy() for v in layer.trainable_variables + list(opt.variables)]
