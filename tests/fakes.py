"""Test-only passes and pipelines: they exercise the pipeline and the hook, and never ship in the package."""

from __future__ import annotations

import tensorflow as tf

from grappler_ext import graph_edit
from grappler_ext.pass_base import GraphPass, Motive, PassResult


def _output_sources(graph):
    """The tensors the graph's output Identity ops read (TF wraps every output in an Identity)."""
    return [out.op.inputs[0] if out.op.type == "Identity" else out for out in graph.outputs]


class _FakePass(GraphPass):
    """The fakes stand for passes in general, not for memory rewrites: the pipeline's memory guard
    (which lets memory rewrites touch only programs over their limit) does not judge them."""

    motive = Motive.FLOPS


class CountingPass(_FakePass):
    """Changes nothing; records each graph it sees."""

    name = "counting"

    def __init__(self):
        self.seen: list[str] = []

    def run(self, graph, options):
        self.seen.append(graph.name)
        result = PassResult(self.name)
        result.skip([], "counting pass never rewrites")
        return result


class ScaleOutputsPass(_FakePass):
    """Multiplies every floating output by ``factor``: a visible, checkable rewrite."""

    name = "scale_outputs"

    def __init__(self, factor: float = 2.0, once: bool = True):
        self.factor = factor
        self.once = once
        self.calls = 0

    def run(self, graph, options):
        self.calls += 1
        result = PassResult(self.name)
        if self.once and self.calls > 1:
            return result
        for src in _output_sources(graph):
            if not src.dtype.is_floating:
                result.skip([src.op], f"output dtype {src.dtype.name} is not floating")
                continue
            with graph_edit.building(graph, self.name):
                scaled = src * tf.constant(self.factor, src.dtype)
            graph_edit.replace_uses(src, scaled)
            result.rewrote([src.op], f"scaled by {self.factor}")
        return result


class FailingPass(_FakePass):
    """Rewrites like ScaleOutputsPass, then raises: the pipeline must undo the rewrite."""

    name = "failing"

    def run(self, graph, options):
        ScaleOutputsPass(3.0).run(graph, options)
        raise RuntimeError("deliberate failure")


class LoopBuildingPass(_FakePass):
    """Replaces each floating output ``y`` by ``y + 0`` computed in a tf.while_loop of 2 steps.

    Its loop bodies re-enter the hook while it runs: the hook must not rewrite them.
    """

    name = "loop_building"

    def run(self, graph, options):
        result = PassResult(self.name)
        if any(op.name.startswith(f"{graph_edit.GENERATED_SCOPE}/{self.name}/") for op in graph.get_operations()):
            result.skip([], "already looped")
            return result
        for src in _output_sources(graph):
            if not src.dtype.is_floating:
                continue
            with graph_edit.building(graph, self.name):
                _, looped = tf.while_loop(lambda i, acc: i < 2, lambda i, acc: (i + 1, acc + 0.0),
                                          (tf.constant(0), src), maximum_iterations=2)
            graph_edit.replace_uses(src, looped)
            result.rewrote([src.op], "wrapped in a 2-step loop")
        return result


class SilentEditPass(_FakePass):
    """Edits the graph but reports no rewrite: the verifier must catch the lie."""

    name = "silent_edit"

    def run(self, graph, options):
        for src in _output_sources(graph):
            if src.dtype.is_floating:
                with graph_edit.building(graph, self.name):
                    graph_edit.replace_uses(src, src + 1.0)
                break
        return PassResult(self.name)


class FakeMeasurer:
    """A splitter measurer (``grappler_ext.measure.Measurer``) giving chosen figures: ``program``
    (``graph -> bytes``) for whole programs and ``function`` (``(fn, specs) -> bytes``) for loops;
    XLA's own figure (``tf_memsafe.memory.XlaMeasurer``) for whichever is not given.  ``calls``
    lists the graphs whose figure was asked for."""

    def __init__(self, program=None, function=None):
        from tf_memsafe.memory import XlaMeasurer

        self.xla = XlaMeasurer()
        self.program, self.function = program, function
        self.calls: list = []

    def program_bytes(self, graph) -> int:
        self.calls.append(graph)
        return (self.program or self.xla.program_bytes)(graph)

    def function_bytes(self, fn, specs) -> int:
        return (self.function or self.xla.function_bytes)(fn, specs)


def raises(error: Exception):
    """A figure function that raises ``error`` (a measurement that fails)."""

    def fail(*args):
        raise error

    return fail


def always_split():
    """The product's pipeline with loops split at every run-time size (``Tuning.whole_at_run`` 0), for
    tests of a loop's slices at sizes where the program as written fits too (where the product runs
    the loops in one step: tests/grappler_ext/splitter/test_whole_at_run.py)."""
    from grappler_ext.splitter import Tuning
    from tf_memsafe import hook

    return hook.use_pipeline(hook.product_pipeline(Tuning(whole_at_run=0)))
