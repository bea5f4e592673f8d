"""The Transformer of TensorFlow's tutorial "Neural machine translation with a Transformer and Keras".

Written from the tutorial's description (its code is not copied), with ``tf_keras`` as Keras (the
tutorial's), or Keras 3 (``keras_version=3``: the same code on ``keras``'s classes, :func:`classes`):

* positional encoding: for position ``p`` and ``i < d/2``, angle ``p / 10000^(2i/d)``; the sines of
  the angles fill the first half of the ``d`` features and the cosines the second half (the tutorial
  concatenates the halves rather than interleaving them);
* a positional embedding: token embedding with ``mask_zero=True`` (token 0 is padding, and Keras
  passes the padding mask on to every attention layer), scaled by ``sqrt(d_model)``, plus the
  encoding of each position;
* attention blocks, each ``MultiHeadAttention`` -> residual ``Add`` -> ``LayerNormalization``:
  global self-attention (encoder), causal self-attention (decoder, ``use_causal_mask=True``) and
  cross-attention (decoder queries, encoder keys and values).  As in the tutorial every layer has
  ``key_dim = d_model`` per head (not ``d_model / num_heads``), so the projections are
  ``num_heads * d_model`` wide;
* a feed-forward block: ``Dense(dff, relu)`` -> ``Dense(d_model)`` -> ``Dropout``, residual and
  layer norm;
* an encoder (positional embedding, dropout, ``num_layers`` x [self-attention, feed-forward]) and a
  decoder (positional embedding, dropout, ``num_layers`` x [causal self-attention, cross-attention,
  feed-forward]); a final ``Dense`` to the target vocabulary gives the logits;
* the tutorial's loss (cross-entropy over non-padding labels), masked accuracy and learning-rate
  schedule ``d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` for Adam(0.9, 0.98, 1e-9).

What differs from the tutorial: the cross-attention does not keep its attention scores for plotting
(``return_attention_scores``; nothing reads them), and the positional table's length is a parameter
(``max_length``, the tutorial's 2048 by default) so that long sequences can be swept.

Dimension letters: B batch, T target (decoder) length, S source (encoder) length, D d_model,
F dff, H heads, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types

import numpy as np
import tensorflow as tf

# The tutorial's tokenizers (ted_hrlr_translate/pt_to_en, its saved WordPiece models).
TUTORIAL_PT_VOCAB = 7765
TUTORIAL_EN_VOCAB = 7010


KERAS_VERSIONS = {2: "tf_keras", 3: "keras"}


def keras_module(keras_version: int):
    """``tf_keras`` (2) or Keras 3 (3)."""
    if keras_version not in KERAS_VERSIONS:
        raise ValueError(f"keras_version must be one of {sorted(KERAS_VERSIONS)}, got {keras_version!r}")
    return importlib.import_module(KERAS_VERSIONS[keras_version])


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters; the defaults are the tutorial's."""

    num_layers: int = 4
    d_model: int = 128
    dff: int = 512
    num_heads: int = 8
    dropout_rate: float = 0.1
    input_vocab_size: int = TUTORIAL_PT_VOCAB
    target_vocab_size: int = TUTORIAL_EN_VOCAB
    max_length: int = 2048            # rows of the positional-encoding table


PRESETS = {
    # The tutorial's model.
    "tutorial": TransformerConfig(),
    # The eXLA paper's Transformer experiment: d_model 512 and 8 heads; 6 layers and dff 2048 as in
    # the base model of "Attention is all you need" that the tutorial cites.
    "paper": TransformerConfig(num_layers=6, d_model=512, dff=2048, num_heads=8),
}


def positional_encoding(length: int, depth: int) -> np.ndarray:
    """[length, depth] float32: sines of the angles in the first half of each row, cosines in the second."""
    half = depth // 2
    position = np.arange(length, dtype=np.float64)[:, None]                 # [L, 1]
    rate = 10000.0 ** (-np.arange(half, dtype=np.float64) / half)           # [depth/2]
    angle = position * rate[None, :]                                        # [L, depth/2]
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=-1).astype(np.float32)


@functools.cache
def classes(keras_version: int = 2) -> types.SimpleNamespace:
    """The model's layer classes written against one Keras: 2 (``tf_keras``, the tutorial's) or 3 (``keras``,
    what ``tf.keras`` is on TF 2.21).  The code is the same for both; each class subclasses that Keras's own
    ``Layer``/``Model``, so a model is all one Keras."""
    keras = keras_module(keras_version)

    class PositionalEmbedding(keras.layers.Layer):
        """Token ids [B, L] -> embeddings [B, L, D] plus positions; the padding mask (ids != 0) is passed on."""

        def __init__(self, vocab_size: int, d_model: int, max_length: int = 2048, **kwargs):
            super().__init__(**kwargs)
            self.d_model = d_model
            self.embedding = keras.layers.Embedding(vocab_size, d_model, mask_zero=True)
            self.encoding = tf.constant(positional_encoding(max_length, d_model))  # [max_length, D]

        def compute_mask(self, inputs, mask=None):
            return self.embedding.compute_mask(inputs, mask)

        def call(self, tokens):
            length = tokens.shape[1]
            if length is not None and length > self.encoding.shape[0]:
                raise ValueError(f"sequence length {length} exceeds the positional table ({self.encoding.shape[0]} "
                                 "rows): build the model with a larger max_length")
            x = self.embedding(tokens)                                          # [B, L, D]
            x *= tf.math.sqrt(tf.cast(self.d_model, x.dtype))
            length = length if length is not None else tf.shape(tokens)[1]
            return x + self.encoding[tf.newaxis, :length, :]                   # [B, L, D]


    class BaseAttention(keras.layers.Layer):
        """Multi-head attention followed by a residual connection and layer normalisation."""

        def __init__(self, **mha_kwargs):
            super().__init__()
            self.mha = keras.layers.MultiHeadAttention(**mha_kwargs)
            self.layernorm = keras.layers.LayerNormalization()
            self.add = keras.layers.Add()


    class CrossAttention(BaseAttention):
        """Decoder positions [B, T, D] attend to the encoder's output [B, S, D]."""

        def call(self, x, context):
            attended = self.mha(query=x, key=context, value=context)            # [B, T, D]
            return self.layernorm(self.add([x, attended]))


    class GlobalSelfAttention(BaseAttention):
        """Every position of [B, S, D] attends to every (non-padding) position."""

        def call(self, x):
            attended = self.mha(query=x, key=x, value=x)                        # [B, S, D]
            return self.layernorm(self.add([x, attended]))


    class CausalSelfAttention(BaseAttention):
        """Position t of [B, T, D] attends to positions <= t only."""

        def call(self, x):
            attended = self.mha(query=x, key=x, value=x, use_causal_mask=True)  # [B, T, D]
            return self.layernorm(self.add([x, attended]))


    class FeedForward(keras.layers.Layer):
        """Dense(dff, relu) -> Dense(d_model) -> dropout, residual, layer norm."""

        def __init__(self, d_model: int, dff: int, dropout_rate: float = 0.1):
            super().__init__()
            self.seq = keras.Sequential([
                keras.layers.Dense(dff, activation="relu"),                     # [B, L, F]
                keras.layers.Dense(d_model),                                    # [B, L, D]
                keras.layers.Dropout(dropout_rate),
            ])
            self.add = keras.layers.Add()
            self.layer_norm = keras.layers.LayerNormalization()

        def call(self, x):
            return self.layer_norm(self.add([x, self.seq(x)]))


    class EncoderLayer(keras.layers.Layer):
        def __init__(self, *, d_model: int, num_heads: int, dff: int, dropout_rate: float = 0.1):
            super().__init__()
            self.self_attention = GlobalSelfAttention(num_heads=num_heads, key_dim=d_model, dropout=dropout_rate)
            self.ffn = FeedForward(d_model, dff, dropout_rate)

        def call(self, x):
            return self.ffn(self.self_attention(x))


    class Encoder(keras.layers.Layer):
        def __init__(self, *, num_layers: int, d_model: int, num_heads: int, dff: int, vocab_size: int,
                     dropout_rate: float = 0.1, max_length: int = 2048):
            super().__init__()
            self.pos_embedding = PositionalEmbedding(vocab_size, d_model, max_length)
            self.enc_layers = [EncoderLayer(d_model=d_model, num_heads=num_heads, dff=dff, dropout_rate=dropout_rate)
                               for _ in range(num_layers)]
            self.dropout = keras.layers.Dropout(dropout_rate)

        def call(self, tokens):
            x = self.dropout(self.pos_embedding(tokens))                        # [B, S, D]
            for layer in self.enc_layers:
                x = layer(x)
            return x


    class DecoderLayer(keras.layers.Layer):
        def __init__(self, *, d_model: int, num_heads: int, dff: int, dropout_rate: float = 0.1):
            super().__init__()
            self.causal_self_attention = CausalSelfAttention(num_heads=num_heads, key_dim=d_model, dropout=dropout_rate)
            self.cross_attention = CrossAttention(num_heads=num_heads, key_dim=d_model, dropout=dropout_rate)
            self.ffn = FeedForward(d_model, dff, dropout_rate)

        def call(self, x, context):
            x = self.causal_self_attention(x)
            x = self.cross_attention(x, context)
            return self.ffn(x)


    class Decoder(keras.layers.Layer):
        def __init__(self, *, num_layers: int, d_model: int, num_heads: int, dff: int, vocab_size: int,
                     dropout_rate: float = 0.1, max_length: int = 2048):
            super().__init__()
            self.pos_embedding = PositionalEmbedding(vocab_size, d_model, max_length)
            self.dropout = keras.layers.Dropout(dropout_rate)
            self.dec_layers = [DecoderLayer(d_model=d_model, num_heads=num_heads, dff=dff, dropout_rate=dropout_rate)
                               for _ in range(num_layers)]

        def call(self, tokens, context):
            x = self.dropout(self.pos_embedding(tokens))                        # [B, T, D]
            for layer in self.dec_layers:
                x = layer(x, context)
            return x


    class Transformer(keras.Model):
        """``model((context_tokens [B, S], target_tokens [B, T]))`` -> logits [B, T, V]."""

        def __init__(self, *, num_layers: int, d_model: int, num_heads: int, dff: int, input_vocab_size: int,
                     target_vocab_size: int, dropout_rate: float = 0.1, max_length: int = 2048):
            super().__init__()
            self.encoder = Encoder(num_layers=num_layers, d_model=d_model, num_heads=num_heads, dff=dff,
                                   vocab_size=input_vocab_size, dropout_rate=dropout_rate, max_length=max_length)
            self.decoder = Decoder(num_layers=num_layers, d_model=d_model, num_heads=num_heads, dff=dff,
                                   vocab_size=target_vocab_size, dropout_rate=dropout_rate, max_length=max_length)
            self.final_layer = keras.layers.Dense(target_vocab_size)

        def call(self, inputs):
            context, x = inputs
            context = self.encoder(context)                                     # [B, S, D]
            x = self.decoder(x, context)                                        # [B, T, D]
            logits = self.final_layer(x)                                        # [B, T, V]
            # The padding mask must not reach Keras' losses and metrics (they would rescale by it):
            # the loss below masks the padding itself.
            try:
                del logits._keras_mask
            except AttributeError:
                pass
            return logits


    class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
        """``d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``, the original paper's warm-up."""

        def __init__(self, d_model: int, warmup_steps: int = 4000):
            super().__init__()
            self.d_model = d_model
            self.warmup_steps = warmup_steps

        def __call__(self, step):
            step = tf.cast(step, tf.float32) + 1.0     # the tutorial counts from 1
            d_model = tf.cast(self.d_model, tf.float32)
            return tf.math.rsqrt(d_model) * tf.minimum(tf.math.rsqrt(step), step * self.warmup_steps ** -1.5)

        def get_config(self):
            return {"d_model": self.d_model, "warmup_steps": self.warmup_steps}

    return types.SimpleNamespace(**{name: value for name, value in locals().items() if isinstance(value, type)})


def build_transformer(config: TransformerConfig = TransformerConfig(), keras_version: int = 2, **overrides):
    """A Transformer with ``config``'s hyperparameters (``overrides`` replace fields), weights built, in
    ``tf_keras`` (``keras_version=2``) or Keras 3."""
    config = dataclasses.replace(config, **overrides)
    model = classes(keras_version).Transformer(
        num_layers=config.num_layers, d_model=config.d_model, num_heads=config.num_heads, dff=config.dff,
        input_vocab_size=config.input_vocab_size, target_vocab_size=config.target_vocab_size,
        dropout_rate=config.dropout_rate, max_length=config.max_length)
    model((tf.ones([1, 2], tf.int32), tf.ones([1, 2], tf.int32)))          # create the variables
    return model


def masked_loss(labels, logits):
    """Mean sparse cross-entropy over the labels that are not padding (label 0)."""
    # The tutorial's Keras loss (tf_keras's; its ops are the same whichever Keras built the model).
    loss = keras_module(2).losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    per_token = loss(labels, logits)                                        # [B, T]
    mask = tf.cast(labels != 0, per_token.dtype)                            # [B, T]
    return tf.reduce_sum(per_token * mask) / tf.reduce_sum(mask)


def masked_accuracy(labels, logits):
    """Share of non-padding labels predicted exactly."""
    predicted = tf.cast(tf.argmax(logits, axis=-1), labels.dtype)           # [B, T]
    mask = labels != 0
    hits = tf.cast((predicted == labels) & mask, tf.float32)
    return tf.reduce_sum(hits) / tf.reduce_sum(tf.cast(mask, tf.float32))


def tutorial_optimizer(d_model: int, keras_version: int = 2):
    """Adam with the tutorial's schedule and moments (beta_2 = 0.98, epsilon = 1e-9), of one Keras."""
    schedule = classes(keras_version).TransformerSchedule(d_model)
    return keras_module(keras_version).optimizers.Adam(schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9)


def forward_step(model):
    """A user-written ``tf.function(jit_compile=True)``: the logits of ``model`` in inference mode."""

    @tf.function(jit_compile=True)
    def forward(context, target_in):
        return model((context, target_in), training=False)

    return forward


def train_step(model, optimizer, training: bool = True):
    """A user-written ``tf.function(jit_compile=True)``: loss, gradients (tape inside) and Adam's update.

    ``training`` is passed to the model (dropout active when its rate is not 0).  The optimizer's
    variables are created here, before the step is traced.
    """
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def step(context, target_in, labels):
        with tf.GradientTape() as tape:
            logits = model((context, target_in), training=training)
            loss = masked_loss(labels, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step
