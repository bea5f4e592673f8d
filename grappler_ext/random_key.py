"""random_key: a stateless draw's key made once from its seed, by a 4-word Philox draw, not inside every element.

    key, counter = StatelessRandomGetKeyCounter(seed)
      =>  w = Philox(key = K, counter = uint64(seed))[0:4];  key = [w0 | w1 << 32],  counter = [0, w2 | w3 << 32]

with ``K = 0x02461e293ec8f720``: the derivation of Philox's key and counter from a seed that TensorFlow
itself uses for ``tf.random.stateless_*(alg="philox")``, and that ``StatelessRandomGetKeyCounter`` computes
where its algorithm is Philox.

Why: ``tf.random.stateless_uniform(shape, seed)`` and the others with their default ``alg="auto_select"``
derive the generator's key and counter with ``StatelessRandomGetKeyCounter``, which TensorFlow's XLA bridge
lowers to about 300 scalar HLO instructions (Philox rounds on the seed).  XLA then fuses those scalars into
the loop fusion that generates the draw's bits, so they run again for every element.  Measured on TF 2.21
XLA:CPU, run alone (``experiments/random_key.py``): a [8, 8, 108, 512] uniform draw takes 839 ms that way and
9.4 ms with the key made once; Keras 3's ``Dropout`` layer (``keras.random`` draws with ``auto_select``) on
[8, 512, 512] takes 529 ms under ``jit_compile=True`` (7.6 ms without XLA) and 13.5 ms rewritten; a Keras 3
``fit`` step with two dropouts 1.33 s and 0.058 s.  The splitter's slices drew again in every step of a loop
and again in its gradient (``Options.redraw_random``): a tf_keras Transformer's training step, split, spent
80 of its 105 s there (it now names Philox itself: 12.3 s).  With the key derived by a draw of four words,
XLA computes it once, outside the fusion.

When it applies: every live ``StatelessRandomGetKeyCounter`` of the graph (int32 or int64 seed, constant or
not), whatever the limit (:attr:`~grappler_ext.pass_base.Motive.TIME`): its readers (the draws) are not
touched.

Why it is safe: the key and counter are bit-identical.  TensorFlow's XLA bridge picks Philox for
``auto_select`` on its CPU and GPU devices (``DefaultRngAlgForDeviceType`` in ``rng_converter_utils.cc``),
and so do its CPU and GPU kernels; the draws then read the same key and counter, so every drawn value is
the same, bit for bit (tests compare the two forms under XLA on seeds of both dtypes, negative and
large ones included).  XLA's kernel reads a seed by the low 32 bits of each of its two words
(``GetU64FromS32Seeds``); TensorFlow's kernels read each word whole, so a negative or large seed gives
other draws with XLA and without it.  The pass builds XLA's form, and only for functions XLA compiles
(``PassOptions.xla_compiled``, set by the hook): TensorFlow's kernel derives the key once, so a function
it runs has nothing to gain and is left as it is, with a record.  Neither form has a gradient.

What it does not handle: ``StatelessRandomGetKeyCounterAlg`` (whose algorithm output is also the device's
choice; ``tf.random`` does not emit it for its draws), ops inside the bodies of loops, conditionals and
called functions (the top graph only), and programs where a TPU is visible: there XLA's ``auto_select``
is another generator, so the pass leaves the graph alone and says so.

Pipeline position: first, before the splitter, which then slices the draws' shapes like any other; the
key it reads is already outside every loop it builds.
"""

from __future__ import annotations

import tensorflow as tf

from grappler_ext import graph_edit
from grappler_ext.graph_query import live_ops
from grappler_ext.pass_base import GraphPass, Motive, PassResult
from grappler_ext.pipeline import register_pass

__all__ = ["RandomKey", "philox_key_counter", "SEED_SCRAMBLE_KEY", "PHILOX"]

# Philox's key for scrambling a seed into Philox's own key and counter (TensorFlow's constant).
SEED_SCRAMBLE_KEY = 0x02461E293EC8F720
PHILOX = 1                 # tf.random.Algorithm.PHILOX


def _words_to_u64(words: tf.Tensor) -> tf.Tensor:
    """Two uint32 words [lo, hi] -> the uint64 ``lo | hi << 32``."""
    lo, hi = tf.cast(words[0], tf.uint64), tf.cast(words[1], tf.uint64)
    return tf.bitwise.bitwise_or(lo, tf.bitwise.left_shift(hi, tf.constant(32, tf.uint64)))


def philox_key_counter(seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Philox's key ([1] uint64) and counter ([2] uint64) from a [2] int32 or int64 ``seed``, as XLA's
    ``StatelessRandomGetKeyCounter`` gives them on CPU and GPU: four words drawn with the low 32 bits
    of each seed word as counter, under a fixed key."""
    low = tf.bitwise.bitwise_and(tf.cast(seed, tf.int64), tf.constant(0xFFFFFFFF, tf.int64))
    words = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[4], key=tf.constant([SEED_SCRAMBLE_KEY], tf.uint64), counter=tf.cast(low, tf.uint64), alg=PHILOX,
        dtype=tf.uint32)
    key = tf.reshape(_words_to_u64(words[:2]), [1])
    counter = tf.stack([tf.constant(0, tf.uint64), _words_to_u64(words[2:])])
    return key, counter


def _tpu_visible() -> bool:
    try:
        return bool(tf.config.list_logical_devices("TPU"))
    except (RuntimeError, ValueError):     # no TPU system configured: none
        return False


@register_pass
class RandomKey(GraphPass):
    name = "random_key"
    motive = Motive.TIME

    def run(self, graph, options) -> PassResult:
        result = PassResult(self.name)
        # Every trace comes here: the graph is walked and the devices asked only where the op is.
        targets = [op for op in graph.get_operations() if op.type == "StatelessRandomGetKeyCounter"]
        if not targets:
            return result
        live = live_ops(graph)
        targets = [op for op in targets if op in live]
        refusal = None
        if not options.xla_compiled:
            refusal = "compiled by TensorFlow's kernels, which derive the key once: nothing to gain"
        elif _tpu_visible():
            refusal = ("a TPU is visible: XLA's auto_select generator there is not Philox, so its key cannot be made "
                       "by Philox's derivation")
        if refusal:
            for op in targets:
                result.skip([op], refusal)
            return result
        # Every key built first, then the draws rewired (nothing is rewired if a build fails).
        with graph_edit.building(graph, self.name):
            built = [(op, *philox_key_counter(op.inputs[0])) for op in targets]
        for op, key, counter in built:
            graph_edit.replace_uses(op.outputs[0], key)
            graph_edit.replace_uses(op.outputs[1], counter)
            readers = sorted({c.type for c in key.consumers()})
            result.rewrote([op], f"key and counter of {', '.join(f'`{r}`' for r in readers) or 'a draw'} made once, "
                                 "by a 4-word Philox draw: XLA fused their derivation into every drawn element")
        return result
