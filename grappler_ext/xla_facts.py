"""What XLA:CPU (TensorFlow 2.21) does, measured: the thresholds and op sets the passes and the
memory model decide by.

Each fact is one named constant with the measurement it rests on; passes and analyses import it
from here (an analysis never imports a pass for one).  Measured from XLA's buffer-assignment
report ("Total bytes used"); other XLA versions may differ.
"""

from __future__ import annotations

import tensorflow as tf

from grappler_ext import op_types

__all__ = ["FUSED_REDUCTION_MAX", "MATVEC_FUSION_MAX_BYTES", "YNN_REDUCTIONS", "YNN_DTYPES", "YNN_DOT_REDUCTIONS",
           "CANONICAL_CONVOLUTIONS_TOP_LEVEL_ONLY", "FOLDED_CONSTANT_MAX_BYTES"]

# XLA:CPU keeps a reduction over an innermost axis of at most this many elements fused with its
# elementwise producers (measured on TF 2.21: D = 32 costs |N x M| bytes, D = 33 costs |N x M x D|).
FUSED_REDUCTION_MAX = 32

# XLA:CPU emits a matrix-vector product itself, with the matrix's producers fused in, when the
# vector is smaller than 16 KiB (measured: ``exp(a) @ v`` with v [3000, 1] (12 kB) is one fusion;
# with v [5000, 1] (20 kB), or v [3000, 2], or a batched product, ``exp(a)`` is materialised).
MATVEC_FUSION_MAX_BYTES = 16 * 1024

# Reductions XLA:CPU (TF 2.21) hands to YNNPACK, as a custom fusion that reads its operand from
# memory.  Measured: float32 (and bfloat16) Sum, Mean, Max and Min, over any axes, unless the
# operand is a multiply (then XLA keeps the reduction itself).  Prod, All, Any and float64,
# float16 or integer reductions stay in XLA's own loop emitter.
YNN_REDUCTIONS = op_types.REDUCTIONS & {"Sum", "Mean", "Max", "Min"}
YNN_DTYPES = frozenset({tf.float32, tf.bfloat16})

# XLA:CPU (TF 2.21) runs a float32 ``MatMul`` without ``transpose_a`` whose only reader is one of
# these reductions (over any axes) as one YNNPACK fusion with it: the product is never in memory.
# Measured, [2000, 64] @ [64, 2000] reduced over axis 0, 1, both or none: the inputs only, with or
# without ``transpose_b``; with ``transpose_a``, or in float64, the [2000, 2000] product is
# materialised.  (Min, bfloat16 and batched products were not measured: counted as materialised.)
YNN_DOT_REDUCTIONS = frozenset({"Sum", "Mean", "Max"})

# An array computed from constants only (``tf.eye(n)``, a band or causal mask) of at most this many
# bytes is folded into a literal before XLA compiles (TensorFlow's graph constant folding, 10 MiB):
# the program then holds it whole where its data meets it.  Larger, it stays iotas and compares that
# its readers fuse.  Measured, ``x + tf.eye(n)``: float32 n = 1619 (10,484,644 B) holds the literal,
# n = 1620 (10,497,600 B) does not; float64 n = 1100 does, 1200 does not.
FOLDED_CONSTANT_MAX_BYTES = 10 * 1024 * 1024

# XLA:CPU runs a convolution with Eigen's kernel only where its dimension numbers are canonical
# (``b01f_01io->b01f``) and canonicalizes (transposes around) only the program's top-level
# convolutions, not those in a ``while`` loop's body.  TensorFlow's gradients of ``Conv2D`` are not
# canonical (the filter's: ``f01b_i01o->01bf``; the input's: ``b01f_01oi->b01f``), so in a loop they
# run in XLA's naive emitter.  Measured, [32, 128, 128, 16] in, 3 x 3 x 16 x 32: the filter's gradient
# 0.096 s at the top level, 9.39 s in a one-step loop; the input's 0.043 s and 1.16 s; a forward
# ``Conv2D`` 0.073 s and 0.041 s (:mod:`grappler_ext.loop_convolutions` builds them canonical).
CANONICAL_CONVOLUTIONS_TOP_LEVEL_ONLY = True
