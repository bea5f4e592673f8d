"""The tutorial's Transformer (experiments/transformer/model.py), unchanged, under tf_memsafe at small sizes.

One encoder and one decoder layer, d_model 32, dff 64, 2 heads (key_dim 32 each, as the tutorial
sets key_dim = d_model), vocabularies of 100, dropout off; a batch of B = 2 pairs of L = 1024
tokens, the second example padded from a random length on (Keras passes the padding masks to every
attention), the decoder's self-attention causal.  Each attention's scores are
[2, 2, 1024, 1024] f32 = 16.8 MB and the forward program as written needs 71 MB; the 12 MB limit is
below a single score tensor, so nothing fits without splitting the attentions along the queries.

The training step (Adam, tape inside) is split too, under a limit that leaves room for the
activations every layer keeps for its backward; its comparison with the step as written (the naive
step's own compile, about 25 s) is ``heavy``, with the tape outside and Keras' ``fit`` (see their
docstrings).
"""

import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tf_memsafe
from experiments.transformer import data, model
from tests.xla_run import run_and_measure
from tf_memsafe import hook, xla_flags

B, L, VOCAB, LIMIT = 2, 1024, 100, 12 * 10**6
CONFIG = model.TransformerConfig(num_layers=1, d_model=32, dff=64, num_heads=2, dropout_rate=0.0,
                                 input_vocab_size=VOCAB, target_vocab_size=VOCAB, max_length=L)


# A training step keeps every layer's activations for the backward (O(L): 18 MB here, measured),
# which no split of the attentions removes; its limit leaves room for them, and the naive step's
# [B, H, L, L] scores and their gradients (97 MB measured) do not fit it.
TRAIN_LIMIT = 32 * 10**6


@pytest.fixture(scope="module")
def batch():
    return data.random_batch(B, L, VOCAB, VOCAB, seed=0)


def build():
    keras.utils.set_random_seed(0)
    return model.build_transformer(CONFIG)


@pytest.fixture(scope="module")
def net():
    return build()


def splitter_rewrites():
    return [r for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "splitter" and r.action == "rewritten"]


def attentions_in_loops(records) -> set:
    """The attentions whose scores (``einsum`` of queries and keys) some loop computes: a loop reaching
    on along the target sequence may hold two of them (the decoder's causal and cross attention)."""
    scores = re.compile(r"(.*)/multi_head_attention(_\d+)?/einsum/Einsum")
    return {m.group(1) for r in records for name in r.ops if (m := scores.fullmatch(name))}


def splitter_skips():
    return [r.reason for rep in tf_memsafe.reports() for r in rep.records
            if r.pass_name == "splitter" and r.action == "skipped"]


def assert_close(got, expected, rtol=1e-5):
    """Relative to each tensor's norm, or to a thousandth of the largest one for tensors that are
    rounding noise around zero (float32: split softmax rows round as whole ones, matmuls may not)."""
    pairs = [(np.asarray(tf.convert_to_tensor(g)), np.asarray(tf.convert_to_tensor(e)))
             for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected))]
    scale = max(np.linalg.norm(e) for _, e in pairs)
    for g, e in pairs:
        assert g.shape == e.shape
        assert np.linalg.norm(g - e) <= rtol * max(np.linalg.norm(e), 1e-3 * scale), float(np.max(np.abs(g - e)))


def test_batch_is_padded_and_the_padding_mask_reaches_the_model(net, batch):
    (context, target_in), labels = batch
    for tokens in (context, target_in, labels):
        assert tokens.shape == (B, L) and (tokens.numpy()[0] != 0).all() and (tokens.numpy()[1] == 0).any()
    embedded = net.encoder.pos_embedding(context)                   # Keras attaches the mask here
    np.testing.assert_array_equal(embedded._keras_mask.numpy(), context.numpy() != 0)


@pytest.fixture(scope="module")
def naive_forward(net, batch):
    """The forward as written, jit-compiled, and XLA's figure for it (tests/xla_run.py): the reference
    of both forward tests below."""
    (context, target_in), _ = batch
    tf_memsafe.disable()
    return run_and_measure(tf.function(lambda c, t: net((c, t), training=False), jit_compile=True),
                           context, target_in)


def test_forward_equals_naive_and_fits_the_limit(net, batch, naive_forward):
    """Every attention (encoder self, decoder causal self, cross) split along its queries, in two or
    three loops: 71 MB -> <= 12 MB."""
    (context, target_in), _ = batch

    def forward(c, t):
        return net((c, t), training=False)

    # (XLA's figures of the very programs run: tests/xla_run.py)
    expected, naive_bytes = naive_forward
    tf_memsafe.enable(LIMIT, strict=True)
    got, after = run_and_measure(tf.function(forward, jit_compile=True), context, target_in)
    splits = splitter_rewrites()
    assert len(attentions_in_loops(splits)) == 3 and len(splits) <= 3, splitter_skips()[:3]
    assert_close(got, expected)
    assert naive_bytes > 4 * LIMIT
    assert after <= LIMIT, (after, [r.reason for r in splits])


def test_a_program_the_model_puts_within_the_limit_is_checked_with_xla_and_split(net, batch, naive_forward):
    """The memory model counts the forward at 35 MB (its schedule: one attention after another);
    XLA interleaves the encoder's and the decoder's self-attention and needs 71 MB.  Under 48 MB,
    the model alone would leave the program as it is (35 MB is within 80 % of the limit); compiled
    whole, it is found over the limit and split against the limit scaled by the model's share."""
    (context, target_in), _ = batch

    def forward(c, t):
        return net((c, t), training=False)

    limit = 48 * 10**6
    expected, naive_bytes = naive_forward
    tf_memsafe.enable(limit, strict=True, check_programs=False)
    tf.function(forward, jit_compile=True).get_concrete_function(context, target_in)
    assert not splitter_rewrites() and any(r.startswith("already within the limit") for r in splitter_skips())
    hook.clear_reports()
    tf_memsafe.enable(limit, strict=True)
    got, after = run_and_measure(tf.function(forward, jit_compile=True), context, target_in)
    checked = [r for r in splitter_skips() if "XLA's figure for the program as written" in r]
    assert len(checked) == 1 and f"is {naive_bytes:,} B" in checked[0], splitter_skips()[:3]
    assert splitter_rewrites()
    assert_close(got, expected)
    assert naive_bytes > limit >= after, (naive_bytes, after)


@pytest.mark.heavy
def test_gradients_with_the_tape_outside_equal_naive(net, batch):
    """A tape outside the jit forward: the split loops' recomputing gradients give the naive gradients.

    ``heavy`` (about 30 s; ``python -m tests -m heavy``): a tape outside a split attention is
    tests/grappler_ext/splitter/test_fused.py's (test_a_tape_outside_differentiates_the_gradients_the_loop_computed),
    outside a split GP loss test_sgpr.py's (test_loss_with_the_tape_outside)."""
    (context, target_in), labels = batch

    def forward(c, t):
        return net((c, t), training=False)

    def loss_and_grads(fn):
        with tf.GradientTape() as tape:
            loss = model.masked_loss(labels, fn(context, target_in))
        return loss, tape.gradient(loss, net.trainable_variables)

    expected = loss_and_grads(tf.function(forward, jit_compile=True))
    tf_memsafe.enable(LIMIT)
    split = tf.function(forward, jit_compile=True)
    split(context, target_in)
    assert len(attentions_in_loops(splitter_rewrites())) == 3, splitter_skips()[:3]
    assert_close(loss_and_grads(split), expected)


def _two_adam_steps(batch, limit):
    """Two Adam steps (tape inside, user-written jit step) from the seeded weights, as written (``limit``
    None) or with tf_memsafe at ``limit``: losses, weights, XLA's figure for the step, splitter records."""
    (context, target_in), labels = batch
    net = build()
    step = model.train_step(net, keras.optimizers.Adam(1e-3))
    tf_memsafe.disable()
    hook.clear_reports()
    if limit is not None:
        tf_memsafe.enable(limit)
    try:
        with xla_flags.dump_all_compiles(in_memory=True) as folder:    # XLA's figure for the step it compiles and runs
            losses = [float(step(context, target_in, labels)) for _ in range(2)]
            compiled = [total for name, total in xla_flags.memory_reports(folder) if "step" in name]
        return {"losses": losses, "weights": [v.numpy() for v in net.trainable_variables],
                "bytes": max(compiled), "splits": len(splitter_rewrites()),
                "attentions": attentions_in_loops(splitter_rewrites()), "skips": splitter_skips()}
    finally:
        tf_memsafe.disable()


@pytest.fixture(scope="module")
def split_training(batch):
    """The training step with tf_memsafe at TRAIN_LIMIT (``_two_adam_steps``)."""
    return _two_adam_steps(batch, TRAIN_LIMIT)


@pytest.fixture(scope="module")
def naive_training(batch):
    """The training step as written, from the same weights (``_two_adam_steps``)."""
    return _two_adam_steps(batch, None)


@pytest.mark.heavy
def test_training_step_trains_the_same(naive_training, split_training):
    """Whatever tf_memsafe does to the step, the losses and the updated weights are the naive ones.

    ``heavy`` (about 25 s beside test_training_step_fits_the_limit, whose split step it shares; 100 s
    alone; ``python -m tests -m heavy`` runs it): a user-written jit Adam step (tape inside) of an
    attention with a causal or a padding mask, split, with the naive losses, variables and Adam's slots
    is tests/integration/test_training_steps.py's test_variables_equal_after_three_adam_steps
    (causal_attention, padding_attention); Keras' ``MultiHeadAttention`` trained split with the naive
    losses test_keras_attention.py's test_training_step_fits_and_trains_the_same; an embedding's sparse
    Adam update in a split step, the table bit for bit the naive one's, test_dynamic_batches.py's
    test_an_embedding_on_batches_of_unknown_size_keeps_its_sparse_update; this step split within its
    limit test_training_step_fits_the_limit below."""
    naive, tfms = naive_training, split_training
    np.testing.assert_allclose(tfms["losses"], naive["losses"], rtol=1e-5)
    assert_close(tfms["weights"], naive["weights"])
    assert naive["bytes"] > 3 * TRAIN_LIMIT


def test_training_step_fits_the_limit(split_training):
    """Embedding gradients are IndexedSlices and Adam's sparse update has dynamic shapes: the three
    attentions are split all the same, their gradients rebuilt, and the whole step fits."""
    tfms = split_training
    assert len(tfms["attentions"]) == 3 and tfms["bytes"] <= TRAIN_LIMIT, (tfms["bytes"], tfms["skips"][:2])


def fit_transformer(batch) -> tuple[list[float], int]:
    """The tutorial's way to train: ``compile(loss=masked_loss, optimizer, metrics=[masked_accuracy],
    jit_compile=True)`` and ``fit`` for two epochs of one batch; the losses and XLA's figure for the
    training step Keras compiles."""
    (context, target_in), labels = batch
    net = build()
    net.compile(loss=model.masked_loss, optimizer=keras.optimizers.Adam(1e-3), metrics=[model.masked_accuracy],
                jit_compile=True)
    data = tf.data.Dataset.from_tensors(((context, target_in), labels))
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        history = net.fit(data, epochs=2, verbose=0)
        steps = [total for name, total in xla_flags.memory_reports(folder) if "train_function" in name
                 or "run_step" in name]
    return history.history["loss"], max(steps)


@pytest.mark.heavy
def test_keras_fit_with_jit_compile_trains_the_same_within_the_limit(batch):
    """Keras compiles the training step itself (``jit_compile=True`` in ``compile``): tf_memsafe,
    only enabled, splits its attentions the same way, with the same losses, within the limit.

    ``heavy`` (74 s, left out of the default run: ``python -m tests -m heavy`` runs it): ``fit`` with
    ``jit_compile=True`` split within its limit with the unsplit fit's losses is checked by
    tests/integration/test_encoder_layer.py's test_fit_trains_an_attention_model_within_a_sixteenth_of_its_footprint
    and tests/integration/test_padded_batches.py's fit (both Kerases); this model's training step split
    with the naive losses and weights by test_training_step_trains_the_same above; the whole Transformer
    fit is measured by ``python -m experiments.transformer.sweep --pipeline tfdata``."""
    naive_losses, naive_bytes = fit_transformer(batch)
    tf_memsafe.enable(TRAIN_LIMIT)
    losses, step_bytes = fit_transformer(batch)
    # (the step's first trace makes the metrics' variables: TensorFlow traces it again, and only that
    # trace is rewritten; a loop along the target sequence may hold the decoder's two attentions)
    assert len(attentions_in_loops(splitter_rewrites())) == 3, splitter_skips()[:3]
    assert [r.retraced for r in tf_memsafe.reports() if "run_step" in r.function_name][:1] == [True]
    np.testing.assert_allclose(losses, naive_losses, rtol=1e-5)
    assert naive_bytes > 3 * TRAIN_LIMIT
    assert step_bytes <= TRAIN_LIMIT
