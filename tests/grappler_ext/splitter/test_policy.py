"""splitter.policy and tuning: chunk sizes, ranking and calibration as values, on small graphs.

Nothing here compiles: XLA's figure for a loop is a fake function of the chunk, as a measurer
would give it.  The region: rows of logsumexp(-|x - y|^2) with x [3000, 3], y [2000, 3] float64,
whose [3000, 2000] distance matrix is 48 MB; limits of 4-16 MB make it split.
"""

import dataclasses
import types

import pytest
import tensorflow as tf

from grappler_ext import memory_model
from grappler_ext.graph_query import topological_order
from grappler_ext.splitter import DEFAULT_TUNING, Code, Sizing, Tuning, analysis, policy, rules
from grappler_ext.splitter.chunk_plan import ChunkPlan
from tf_memsafe.memory import MeasurementError

N, M = 3000, 2000


def kernel_sum(x, y):
    d = tf.reduce_sum(tf.square(x[:, None, :] - y[None, :, :]), -1)           # [N, M]
    return tf.reduce_sum(tf.exp(-d), axis=1)                                   # [N]


@pytest.fixture(scope="module")
def region():
    """The kernel sum's row region, as the driver would find it: (options, grown, beside)."""
    graph = tf.function(kernel_sum, jit_compile=True).get_concrete_function(
        tf.TensorSpec([N, 3], tf.float64), tf.TensorSpec([M, 3], tf.float64)).graph
    order = topological_order(graph)
    order_index = {op: i for i, op in enumerate(order)}
    outputs = {t.ref() for t in graph.outputs}
    est, info = memory_model.analyse(graph)
    root = [op for op in order if op.type == "Sum"][-1]
    options = [o for o in analysis.root_options(root) if o.kind == "concat"]
    grown = analysis.grow(options, outputs, order_index)
    big = max((t for op in order for t in op.outputs if t.name in info and info[t.name].bytes),
              key=lambda t: info[t.name].bytes)
    beside = policy.Beside(est, info, {s.op: i for i, s in enumerate(est.schedule)}, frozenset({big.name}),
                           frozenset())
    return options, grown, beside


class TestPlan:
    @pytest.mark.parametrize("limit", [4 * 10**6, 8 * 10**6, 16 * 10**6])
    def test_the_chunk_is_the_largest_that_fits_the_budget(self, region, limit):
        options, grown, beside = region
        planned = policy.plan(options, grown, beside, limit, DEFAULT_TUNING)
        chunks = planned.chunks
        assert chunks.splits and chunks.length == N and planned.best_effort is None
        assert chunks.predicted_bytes <= limit
        # One more row per slice would not fit the pooled budget (or no larger chunk gives fewer slices).
        budget = beside.est.parameter_bytes + (limit - beside.est.parameter_bytes) * DEFAULT_TUNING.pool_margin
        fixed = chunks.predicted_bytes - chunks.chunk * planned.per_unit
        assert fixed + (chunks.chunk + chunks.tail + 1) * planned.per_unit > budget or chunks.tail == 0
        assert planned.backward_unit == pytest.approx(planned.per_unit * DEFAULT_TUNING.backward_cost_factor)

    def test_a_lower_limit_gives_smaller_chunks(self, region):
        options, grown, beside = region
        chunks = [policy.plan(options, grown, beside, limit, DEFAULT_TUNING).chunks.chunk
                  for limit in (16 * 10**6, 8 * 10**6, 4 * 10**6)]
        assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1]

    def test_a_larger_safety_margin_gives_larger_chunks(self, region):
        options, grown, beside = region
        default = policy.plan(options, grown, beside, 8 * 10**6, DEFAULT_TUNING).chunks.chunk
        trusting = policy.plan(options, grown, beside, 8 * 10**6, Tuning(safety_margin=1.0)).chunks.chunk
        assert trusting > default

    def test_an_impossible_limit_is_a_best_effort_or_says_why(self, region):
        options, grown, beside = region
        tight = policy.plan(options, grown, beside, 10**5, DEFAULT_TUNING)       # the inputs alone are 112 kB
        assert (isinstance(tight, policy.Planned) and tight.best_effort is not None) or tight.code == Code.NO_PLAN

    def test_a_program_the_model_cannot_count_is_weighed_by_its_figure_as_written(self, region):
        """An op without a byte rule leaves the model no count of the program: a best effort is then
        weighed against XLA's figure for the program as written (``Beside.written``), as it is against
        the model's count otherwise, not refused (a GP's loss with ``tf.linalg.solve``, which had no
        rule, was left as written at 348 MB under a 71 MB limit where the same loss with a Cholesky
        was split)."""
        options, grown, beside = region
        counted = policy.plan(options, grown, beside, 10**5, DEFAULT_TUNING)
        blind = dataclasses.replace(beside, est=dataclasses.replace(
            beside.est, peak_bytes=None, unknown_ops=("q (Qr): no rule",), unknown=(("q", "Qr", "no rule"),)))
        assert policy.plan(options, grown, blind, 10**5, DEFAULT_TUNING).code == Code.NO_PLAN   # nothing to weigh
        weighed = policy.plan(options, grown, dataclasses.replace(blind, written=beside.est.peak_bytes), 10**5,
                              DEFAULT_TUNING)
        assert weighed.best_effort is not None and weighed.chunks == counted.chunks


class TestRank:
    def plan(self, chunk, length=1000, best_effort=None, predicted=10**6):
        return policy.Planned(ChunkPlan(length, chunk, predicted), chunk, 100.0, 500.0, best_effort)

    def test_meeting_the_limit_first_then_fewer_steps(self):
        from grappler_ext.splitter.outcome import BestEffort

        few, many = self.plan(500), self.plan(100)
        effort = self.plan(800, best_effort=BestEffort(10**7), predicted=10)
        keys = {name: policy.rank(p, [], 0, 10**7, DEFAULT_TUNING)
                for name, p in (("few", few), ("many", many), ("effort", effort))}
        assert sorted(keys, key=keys.get) == ["few", "many", "effort"]

    def test_among_equal_steps_the_one_freeing_more_for_the_backward(self):
        a, b = self.plan(250), self.plan(250)
        assert policy.rank(a, [], 5 * 10**6, 10**7, DEFAULT_TUNING) < policy.rank(b, [], 10**6, 10**7, DEFAULT_TUNING)

    def test_best_efforts_by_what_they_need_their_backward_counted(self):
        # A Keras attention with 8 heads of the layer's width, batch and length known at run time: a
        # loop over its queries counts 204 MB forward, but its keys' and values' projections and their
        # gradients stay whole while its backward runs (315 MB); one over the batch needs 268 MB.
        from grappler_ext.splitter.outcome import BestEffort

        queries = self.plan(25, best_effort=BestEffort(315 * 10**6, by_backward=True), predicted=204 * 10**6)
        batch = self.plan(1, length=8, best_effort=BestEffort(268 * 10**6), predicted=268 * 10**6)
        assert policy.rank(batch, [], 0, 256 * 10**6, DEFAULT_TUNING) < policy.rank(queries, [], 0, 256 * 10**6,
                                                                                     DEFAULT_TUNING)

    def test_a_plan_that_does_not_split_is_last(self):
        whole, split = self.plan(1000), self.plan(10)
        assert policy.rank(split, [], 0, 10**7, DEFAULT_TUNING) < policy.rank(whole, [], 0, 10**7, DEFAULT_TUNING)


class TestCalibrated:
    """XLA's figure for the loop, faked as a line: ``fixed + per_row * chunk``."""

    def sized(self, region, loop_figure, limit=8 * 10**6, hoped=None, model_per_unit=0.0):
        options, grown, beside = region
        if hoped is not None:
            beside = dataclasses.replace(beside, hoped=hoped)
        chunks = policy.plan(options, grown, beside, limit, DEFAULT_TUNING).chunks
        return chunks, policy.calibrated(options, grown, chunks, beside, limit, DEFAULT_TUNING, loop_figure,
                                         model_per_unit=model_per_unit)

    def test_the_bytes_a_row_come_from_two_chunk_sizes(self, region):
        """Another large tensor hoped for (so the loop is not the whole program): the margins' plan,
        with XLA's bytes a row instead of the model's."""
        chunks, sized = self.sized(region, lambda c: 10**5 + 4000 * c, hoped=frozenset({"elsewhere:0"}))
        assert sized.sizing == Sizing.LOOP_FIGURE and sized.bytes_per_row == pytest.approx(4000)
        assert sized.per_unit == pytest.approx(4000 / DEFAULT_TUNING.calibration_margin)
        assert sized.chunks.chunk > chunks.chunk                  # the model's count is kept on the safe side

    def test_a_loop_that_is_the_program_is_sized_to_the_whole_program_margin(self, region):
        limit = 8 * 10**6
        figures = []

        def figure(c):
            figures.append(c)
            return 10**5 + 4000 * c

        _, sized = self.sized(region, figure, limit)
        assert sized.sizing == Sizing.PROGRAM_FIGURE
        assert sized.loop_figure_bytes <= limit * DEFAULT_TUNING.whole_program_margin
        assert sized.loop_figure_bytes == 10**5 + 4000 * sized.chunks.chunk and len(figures) == 3

    def test_a_failed_measurement_keeps_the_models_chunk_and_names_the_error(self, region):
        def fail(c):
            raise MeasurementError("no report")

        chunks, sized = self.sized(region, fail)
        assert (sized.sizing, sized.detail, sized.chunks) == (Sizing.MODEL_MEASURE_FAILED, "MeasurementError", chunks)

    def test_a_loop_over_run_time_sizes_is_sized_by_its_figure_a_row_at_the_nominal_sizes(self, region):
        """Its chunk is scaled to the run's sizes (.scaling): compiled alone at the nominal sizes, its row's
        bytes there plan it, never the whole program's margin (the loop is the program here, which
        would size it to fill the limit at the nominal sizes alone)."""
        _, grown, _ = region
        measured = []
        grown.region.scaled = types.SimpleNamespace(steady=False)    # (a Scaling whose rows grow with the sizes)
        try:
            chunks, sized = self.sized(region, lambda c: measured.append(c) or 10**5 + 4000 * c)
        finally:
            grown.region.scaled = None
        assert sized.sizing == Sizing.NOMINAL_FIGURE and sized.bytes_per_row == pytest.approx(4000)
        assert sized.per_unit == pytest.approx(4000 / DEFAULT_TUNING.calibration_margin)
        assert len(measured) == 2 and sized.chunks.chunk > chunks.chunk
        _, whole = self.sized(region, lambda c: 10**5 + 4000 * c)       # the same loop of static sizes
        assert whole.sizing == Sizing.PROGRAM_FIGURE

    def test_a_figure_that_does_not_grow_is_not_believed(self, region):
        chunks, sized = self.sized(region, lambda c: 10**6)
        assert sized.sizing == Sizing.MODEL_NOT_GROWING and sized.chunks == chunks

    def test_a_figure_growing_by_a_sliver_of_the_models_count_is_not_believed(self, region):
        """kNN's top-k along the points: the loop alone 2.6 B a row, the model 45.7 kB, the program
        as split 129 MB over a 2.6 MB limit.  Above the floor (rows of the queries: 70 % of the
        model's count) the figure is taken."""
        chunks, sized = self.sized(region, lambda c: 10**6 + 3 * c, model_per_unit=45_000.0)
        assert sized.sizing == Sizing.MODEL_IMPLAUSIBLE and sized.chunks == chunks
        assert "3.0 B a row against the memory model's 45,000 B" in sized.detail
        _, taken = self.sized(region, lambda c: 10**5 + 32_000 * c, model_per_unit=45_000.0,
                              hoped=frozenset({"elsewhere:0"}))
        assert taken.sizing == Sizing.LOOP_FIGURE


class TestBackwardSized:
    """XLA's figure for the loop and its gradient alone, faked as a line in the gradient's chunk; under
    4 MB, the model's gradient loop has over ``Tuning.backward_sizing_steps`` steps."""

    limit = 4 * 10**6

    def sized(self, region, gradient_figure, chunks=None, backward_chunk=None):
        limit = self.limit
        options, grown, beside = region
        planned = policy.plan(options, grown, beside, limit, DEFAULT_TUNING)
        chunks = chunks or planned.chunks
        backward_chunk = backward_chunk or planned.backward_chunk
        return planned, policy.backward_sized(options, grown, chunks, backward_chunk, beside, limit, DEFAULT_TUNING,
                                              gradient_figure)

    def test_the_gradient_chunk_comes_from_the_gradient_loops_row_at_two_chunks(self, region):
        """The model plans a gradient step at ``backward_cost_factor`` times its forward count; XLA's row
        of the loop and its gradient here is the forward's count: a larger chunk, at most the forward's."""
        measured = []
        options, grown, beside = region
        model = policy.plan(options, grown, beside, self.limit, DEFAULT_TUNING)
        row = model.per_unit * DEFAULT_TUNING.safety_margin
        planned, sized = self.sized(region, lambda c: measured.append(c) or 10**5 + int(row * c))
        assert sized is not None, planned
        chunk, got_row, unit = sized
        assert measured == [planned.backward_chunk, 2 * planned.backward_chunk]
        assert got_row == pytest.approx(row, rel=1e-3)
        assert unit == pytest.approx(got_row / DEFAULT_TUNING.calibration_margin)
        assert planned.backward_chunk < chunk <= planned.chunks.chunk
        again = policy.plan(options, grown, beside, self.limit, DEFAULT_TUNING, measured_backward=got_row)
        assert chunk == min(again.backward_chunk, planned.chunks.chunk) and again.backward_unit == unit

    def test_a_row_above_the_models_gives_a_smaller_chunk(self, region):
        options, grown, beside = region
        model = policy.plan(options, grown, beside, self.limit, DEFAULT_TUNING)
        planned, sized = self.sized(region, lambda c: 10**5 + int(3 * model.backward_unit * c))
        assert sized is not None and sized[0] < planned.backward_chunk

    def test_few_gradient_steps_or_a_chunk_near_the_forwards_are_not_measured(self, region):
        measured = []

        def figure(c):
            measured.append(c)
            return 10**5 + 100 * c

        _, few = self.sized(region, figure, chunks=ChunkPlan(N, 1500, 10**6), backward_chunk=600)   # 5 steps
        assert few is None
        _, near = self.sized(region, figure, chunks=ChunkPlan(N, 70, 10**6), backward_chunk=40)   # 75 steps
        assert near is None and measured == []

    def test_a_failed_or_flat_figure_keeps_the_models_chunk(self, region):
        def fail(c):
            raise MeasurementError("no report")

        assert self.sized(region, fail)[1] is None
        assert self.sized(region, lambda c: 10**6)[1] is None


def test_capped_split_anyway_at_least_and_starved():
    plan = ChunkPlan(4096, 2048, 10**9)
    assert policy.capped(plan, 374_000, 2 * 10**9, Tuning(slice_share=0.25)).chunk == 1024
    assert policy.split_anyway(ChunkPlan(1000, 1000, 5000), 2.0) == ChunkPlan(1000, 500, 4000)
    assert policy.at_least(300, 1000, 150) == 283          # 3 x 283 + 151: the remainder holds k = 150
    assert policy.at_least(100, 1000, 150) is None
    forward = ChunkPlan(100_000, 2000, 0)
    assert policy.starved(forward, 100, DEFAULT_TUNING)                        # 1000 steps of a twentieth
    assert not policy.starved(forward, 1000, DEFAULT_TUNING)                   # half the forward's chunk
    assert not policy.starved(forward, 100, Tuning(starved_steps=2000))
    # A loop computing its gradients as it goes: many steps starve it, whatever gave it its chunk
    # (the backward's plan, or the share of the budget a slice may take: its forward's chunk too).
    batch = ChunkPlan(93, 1, 0)
    assert policy.starved(batch, 1, DEFAULT_TUNING, fused=1)
    assert policy.starved(batch, 1, DEFAULT_TUNING, fused=4)
    assert not policy.starved(ChunkPlan(93, 3, 0), 3, DEFAULT_TUNING, fused=3)             # 31 steps


class TestFusedGrown:
    # XLA's figures for a Keras CNN's training step along its batch (planned at 93), alone, by chunk.
    CNN = {1: 66_678_590, 2: 96_104_350, 3: 93_286_238, 4: 120_483_742, 8: 168_456_094}
    # ... and for Keras' MNIST convnet's (batch 128): not straight in the chunk (9 and 10 made up between).
    CONVNET = {4: 4_787_686, 5: 7_747_784, 6: 8_035_272, 8: 8_534_758, 9: 8_800_000,
               10: 14_000_000, 12: 16_772_808, 16: 15_509_734}

    @staticmethod
    def triplet(chunk: int) -> int:
        """... and for a batch-hard triplet loss' step over 4,096 embeddings (measured at 2, 4, 47, 92
        and 182 rows): a step of 70 MB between 4 and 47 rows, put at 40 here."""
        return int(134_349_596 + 103_424 * chunk if chunk < 40 else 204_000_000 + 14_000 * chunk)

    @staticmethod
    def asking(figures, asked):
        def figure(chunk):
            asked.append(chunk)
            return figures[chunk]
        return figure

    def test_a_chunk_of_one_is_grown_by_the_rows_beyond_it(self):
        """A slice of one row is laid out its own way (29 MB "a row" from 1 to 2, 12 MB from 2 to 4):
        the bytes a row are read from 2 and 4, and the room of 41 MB takes two rows more, checked
        against the loop at its own chunk."""
        asked = []
        grown = policy.fused_grown((41_315_235, 1), 93, 1, DEFAULT_TUNING, self.asking(self.CNN, asked))
        assert grown.chunk == 3 and grown.added == self.CNN[3] - self.CNN[1]
        assert asked == [1, 2, 4, 3]

    def test_a_chunk_over_the_room_gives_the_line_to_the_largest_within_it(self):
        """From 4 and 8 rows, 0.94 MB a row: 95 % of 6.4 MB of room make 10 rows, 9.2 MB more than 4
        alone, over it; the line from 8 (3.7 MB more, within the room) to 10 gives no row more: 8."""
        asked = []
        grown = policy.fused_grown((9_086_343, 4), 128, 1, DEFAULT_TUNING, self.asking(self.CONVNET, asked))
        assert grown.chunk == 8 and asked == [4, 8, 10]

    def test_a_step_in_the_figure_is_closed_in_on_along_the_lines_through_it(self):
        """The triplet loss: 2 and 4 rows are 0.2 MB apart, so 26.7 MB of room make 173 rows, past the
        step of 70 MB; the line from 4 to 173 gives 45, past it too; the line from 4 to 45 gives 14,
        within the room: the loop's 2,048 steps of 2 rows become 293 (the largest chunk measured within
        the room, 4, would only have halved them)."""
        asked = []
        grown = policy.fused_grown((26_737_548, 2), 4096, 1, DEFAULT_TUNING,
                                   lambda c: asked.append(c) or self.triplet(c))
        assert grown.chunk == 14 and asked == [2, 4, 173, 45, 14]

    def test_a_straight_figure_is_grown_at_once(self):
        """1 MB a row: 95 % of 0.7 of the 10 MB of room make 6 rows more than 4, at the first try."""
        asked = []
        grown = policy.fused_grown((10**7, 4), 1000, 1, DEFAULT_TUNING,
                                   self.asking({c: 10**7 + 10**6 * c for c in range(1, 20)}, asked))
        assert grown == (4 + 6, 6 * 10**6)      # (what the loop alone grew by: 1 MB a row)
        assert asked == [4, 8, 10]

    def test_the_first_try_aims_below_the_whole_room(self):
        """A figure a little steeper beyond the first two chunks (a Transformer's attention loop alone:
        67.9 kB a row from 32 to 64 rows, 68.5 kB beyond): aimed at the whole room, the first try is over it."""
        def figure(c):
            return 6_267_300 + 67_891 * c if c <= 64 else 6_267_300 + 67_891 * 64 + 68_460 * (c - 64)

        room = (17_971_308, 32)
        for aim, chunks in ((1.0, [32, 64, 217, 216]), (DEFAULT_TUNING.growth_aim, [32, 64, 208])):
            asked = []
            grown = policy.fused_grown(room, 1024, 1, Tuning(growth_aim=aim),
                                       self.asking({c: figure(c) for c in range(1, 513)}, asked))
            assert asked == chunks and grown.chunk == chunks[-1], (aim, asked, grown)

    def test_no_room_to_grow_or_no_figure_keeps_the_plan(self):
        assert policy.fused_grown((10**7, 2), 5, 1, DEFAULT_TUNING, lambda c: 10**6 * c) is None   # 2 of 5 rows

        def fails(chunk):
            raise ValueError("no figure")

        assert policy.fused_grown((10**7, 1), 93, 1, DEFAULT_TUNING, fails) is None
        assert policy.fused_grown((10**7, 1), 93, 1, DEFAULT_TUNING, lambda c: 10**6) is None     # does not grow
        # Nothing larger than the loop's own chunk fits: each try over the room, 8 rows too.
        assert policy.fused_grown((10**6, 4), 128, 1, DEFAULT_TUNING,
                                  lambda c: 10**5 if c == 4 else 10**5 + 2 * 10**5 * c) is None


class TestTuning:
    def test_defaults_are_documented_fields_and_frozen(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            DEFAULT_TUNING.safety_margin = 1.0
        for f in dataclasses.fields(Tuning):
            assert f.name in Tuning.__doc__, f.name

    @pytest.mark.parametrize("field, value", [("safety_margin", 0), ("pool_margin", 1.5), ("replans", -1),
                                              ("root_depth", 0), ("backward_cost_factor", 0.5),
                                              ("slice_share", "0.1"), ("starved_steps", True),
                                              ("best_effort_checks", -1), ("best_effort_checks", 1.5),
                                              ("search_budget", 0.5), ("search_floor_s", -1.0)])
    def test_values_out_of_range_name_the_field(self, field, value):
        with pytest.raises(ValueError, match=f"Tuning.{field} must be"):
            Tuning(**{field: value})

    def test_counts_that_may_be_zero(self):
        assert Tuning(replans=0).replans == 0 and Tuning(best_effort_checks=0).best_effort_checks == 0
        assert Tuning(search_floor_s=0).search_floor_s == 0 and Tuning(search_budget=40).search_budget == 40


def test_a_loop_writing_in_place_takes_a_chunk_that_divides_its_length():
    """policy.without_tail: the largest divisor of the length down to half the chunk (16384 in 780s:
    512, 32 steps and no remainder); none that large keeps the chunk; a chunk that divides is kept."""
    without_tail = policy.without_tail
    got = without_tail(ChunkPlan(16384, 780, 10_000_000), per_unit=1000.0)
    assert (got.chunk, got.length % got.chunk, got.predicted_bytes) == (512, 0, 10_000_000 - 268 * 1000)
    assert without_tail(ChunkPlan(10000, 780, 1), 1.0).chunk == 625
    assert without_tail(ChunkPlan(10007, 780, 1), 1.0).chunk == 780            # a prime: the remainder stays
    assert without_tail(ChunkPlan(4096, 512, 1), 1.0).chunk == 512


def test_a_best_effort_names_what_the_rest_of_the_program_holds_beside_it():
    """A 16 MB product made before the kernel sum (its points are shifted by its trace) and read after it
    is beside the loop whatever its chunk: a best effort says so, naming that product, not where the
    region stops (a kernel ridge's warning named its test points, where the factor beside its loop was
    what stayed over the limit)."""
    def kernel_sum_beside(x, y, z):
        held = tf.matmul(z, z, transpose_b=True)
        return kernel_sum(x + 1e-9 * tf.linalg.trace(held), y) + tf.reduce_sum(tf.cos(held))

    graph = tf.function(kernel_sum_beside, jit_compile=True).get_concrete_function(
        tf.TensorSpec([N, 3], tf.float64), tf.TensorSpec([M, 3], tf.float64),
        tf.TensorSpec([1414, 8], tf.float64)).graph
    order_index = {op: i for i, op in enumerate(topological_order(graph))}
    est, info = memory_model.analyse(graph)
    root = graph.get_operation_by_name("Sum_1")
    grown = analysis.grow([o for o in analysis.root_options(root) if o.kind == "concat"],
                          {t.ref() for t in graph.outputs}, order_index)
    beside = policy.Beside(est, info, {s.op: i for i, s in enumerate(est.schedule)}, frozenset(), frozenset(),
                           written=est.peak_bytes)
    planned = policy.plan([o for o in analysis.root_options(root) if o.kind == "concat"], grown, beside,
                          12 * 10**6, DEFAULT_TUNING)
    assert planned.best_effort is not None, planned
    assert "the rest of the program holds" in planned.best_effort.render(), planned.best_effort.render()
    assert "the largest `MatMul:0` (15,995,168 B)" in planned.best_effort.render()


@pytest.mark.parametrize("kernel,strides,dilations,overlap", [
    (3, 1, 1, True),            # a CNN's 3 x 3 windows, one pixel apart
    (4, 4, 1, False),           # a Vision Transformer's patches, side by side
    (2, 2, 2, True),            # dilated: a 2 x 2 kernel spans 3 pixels
    (1, 1, 1, False),           # a pointwise convolution
])
def test_a_convolution_whose_windows_overlap_is_planned_by_the_backward_loops_factor(kernel, strides, dilations,
                                                                                       overlap):
    """Its gradients computed as a loop goes hold XLA's layouts of it beyond the model's count (a Keras
    CNN's loop alone, 5.6 times the forward slice a row): such a region is planned as a backward loop
    is; a convolution whose windows lie side by side is counted as the model counts any product."""
    graph = tf.function(lambda x, w: tf.nn.conv2d(x, w, strides, "VALID", dilations=dilations)).get_concrete_function(
        tf.TensorSpec([2, 16, 16, 3]), tf.TensorSpec([kernel, kernel, 3, 8])).graph
    (conv,) = [op for op in graph.get_operations() if op.type == "Conv2D"]
    assert rules.windows_overlap(conv) is overlap
