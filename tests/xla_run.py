"""XLA's figure for the program a call of a jit-compiled ``tf.function`` compiled and ran.

A test that runs a function naive and split, then asks ``tf_memsafe.memory_footprint`` for the figure
of each, traces and compiles both once more (the split one planned again: its measuring compiles and
rewrites, 10 to 20 s for an SGPR step).  :func:`run_and_measure` reads the figure from XLA's dump of
the very compile the call made instead: the same trace, rewritten with the same options, and the same
"Total bytes used" as ``memory_footprint`` gives (equal figures, measured on TF 2.21 for SGPR's step:
175,583,270 B naive and 6,900,102 B split either way).
"""

from __future__ import annotations

from tf_memsafe import memory, xla_flags


def run_and_measure(f, *args, **kwargs):
    """``f(*args, **kwargs)`` and XLA's "Total bytes used" of the program that call compiled (summed
    over its modules, as ``memory_footprint`` sums them).  ``f`` is a ``tf.function`` with
    ``jit_compile=True`` that this call traces or compiles for the first time: a call that compiles
    nothing has no figure, and fails here."""
    with xla_flags.dump_all_compiles(in_memory=True) as folder:
        result = f(*args, **kwargs)
        token = memory._module_token(f.get_concrete_function(*args, **kwargs).name)
        figures = [total for module, total in xla_flags.memory_reports(folder) if token in module]
    assert figures, f"XLA compiled nothing named {token} in this call"
    return result, sum(figures)
