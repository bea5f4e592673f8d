"""A Dense layer's training step as a Keras user writes it (the wide-layer experiment's), with the
optimizers the tests of variable updates and wide layers run."""

from experiments import wide_layer

OPTIMIZERS = ("sgd", "momentum", "adam")


def optimizer(keras, name: str):
    """Keras' SGD (0.1), SGD with momentum 0.9, or Adam (0.01)."""
    if name == "sgd":
        return keras.optimizers.SGD(0.1)
    if name == "momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.Adam(1e-2)


def dense_step(keras, name: str, d_in: int, d_out: int, dtype: str = "float32"):
    """``(step, values)``: :func:`experiments.wide_layer.dense_step` with the optimizer ``name``."""
    return wide_layer.dense_step(keras, optimizer(keras, name), d_in, d_out, dtype)
