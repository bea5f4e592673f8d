"""splitter.outcome: decisions as values, rendered for people, kept as data in reports.

(Two threads tracing at once under two limits, each with its own plan and run state:
tests/tf_memsafe/test_hostile_inputs.py.)
"""

import json

from grappler_ext.pass_base import PassResult, Record
from grappler_ext.splitter import CANNOT_SPLIT, Code, LoopPlan, RootSplit, Sizing
from grappler_ext.splitter.outcome import BestEffort, CannotFit, Whole, cause
from tf_memsafe.report import Report


def loop_plan(**overrides):
    fields = dict(roots=(RootSplit("TopKV2", "TopKV2", "top_k", (1, None)), RootSplit("Sum", "Sum", "sum", (0, None))),
                  length=20000, chunk=520, backward_chunk=520, predicted_bytes=10**6)
    return LoopPlan(**{**fields, **overrides})


class TestLoopPlan:
    def test_a_loop_drawing_again_says_so(self):
        """``redraw_random=True`` gives other numbers than the program as written: the record names
        the draws (a Keras 3 dropout's seeded draw, exact without the option, differed silently)."""
        assert loop_plan(redrawn=("dropout/StatelessRandomUniformV2",)).render().endswith(
            "; the random draw `dropout/StatelessRandomUniformV2` drawn again slice by slice (redraw_random=True): "
            "other numbers of the same distribution than the program as written")
        assert "draws `a`, `b` drawn again" in loop_plan(redrawn=("a", "b")).render()
        assert "drawn again" not in loop_plan().render()

    def test_rendered_from_its_values(self):
        plan = loop_plan(backward_chunk=100, has_gradient_loop=True, sizing=Sizing.LOOP_FIGURE, bytes_per_row=4096.4,
                         rebuilt_gradients=2, prologue_ops=("k", "v"))
        assert (plan.steps, plan.tail, plan.backward_steps, plan.backward_tail) == (38, 240, 200, 0)
        assert plan.split_input == (0, 1)
        assert plan.render() == ("`TopKV2` top_k over input 0 axis 1 and `Sum` sum: 38 x 520 + 240 of 20000; chunk "
                                 "from XLA's figure for the loop (4,096 B a row); its gradient 200 x 100; 2 gradients "
                                 "inside the function rebuilt; 2 ops before it computed in its prologue and again in "
                                 "the gradient")
        forward = loop_plan(prologue_ops=("k", "v"))
        assert forward.render().endswith("of 20000; 2 ops before it computed in its prologue")

    def test_where_the_chunk_came_from_and_a_best_effort(self):
        failed = loop_plan(sizing=Sizing.MODEL_MEASURE_FAILED, sizing_detail="MeasurementError",
                           best_effort=BestEffort(3 * 10**6, stop="`x` is an input"))
        assert failed.render().endswith("; chunk from the memory model (measuring the loop failed: MeasurementError); "
                                        "best effort, the limit cannot be met (3,000,000 B needed by the memory "
                                        "model's count; the region stops where `x` is an input)")
        run_time = loop_plan(sizing=Sizing.NOMINAL_FIGURE, bytes_per_row=165_120.0)
        assert ("; chunk from XLA's figure for the loop at the nominal sizes (165,120 B a row there), scaled to "
                "the sizes it runs at") in run_time.render()
        whole = loop_plan(sizing=Sizing.PROGRAM_FIGURE, bytes_per_row=10.0, loop_figure_bytes=123_456)
        assert "which is the program (123,456 B at this chunk, 10 B a row)" in whole.render()

    def test_a_record_round_trips_through_json_with_its_code_and_plan(self):
        result = PassResult("splitter")
        result.rewrote(["a"], loop_plan().render(), 10, 5, code=Code.SPLIT, plan=loop_plan())
        data = json.loads(json.dumps(result.records[0].to_dict()))
        assert data["code"] == "split" and data["plan"]["chunk"] == 520
        again = Record(**{**data, "ops": tuple(data["ops"])})
        assert again.code == Code.SPLIT                       # a str enum equals its value


def test_the_cannot_split_codes_are_those_of_a_large_tensor_left_whole():
    assert Code.SPLIT not in CANNOT_SPLIT and Code.FITS_WHOLE not in CANNOT_SPLIT
    assert {Code.NO_ROOT, Code.REFUSED_OP, Code.NO_PLAN} <= CANNOT_SPLIT


def test_a_report_keeps_the_plan_as_data():
    rec = Record("splitter", "rewritten", ("a",), loop_plan().render(), 10, 5, Code.SPLIT, loop_plan())
    report = Report("f", 100, 10, 5, "rewritten", "", (rec,))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["records"][0]["plan"]["length"] == 20000
    assert Report.from_dict(data).records[0].code == Code.SPLIT


class TestCannotFit:
    """The one warning of a run that cannot meet its limit: what the program holds whatever is rewritten."""

    @staticmethod
    def warning(arguments=0, results=0) -> str:
        return CannotFit("step", 300 * 10**6, "about", 150 * 10**6, 160 * 10**6, 100 * 10**6, 100 * 10**6,
                         "the splitter cannot split `MatMul`", arguments, results).render()

    def test_arguments_and_results_over_the_limit_are_named_as_the_floor(self):
        said = self.warning(arguments=30 * 10**6, results=90 * 10**6)
        assert "arguments and results alone are 120.0 MB (arguments and variables 30.0 MB, results 90.0 MB)" in said
        assert "no rewrite inside it can bring it under" in said and "raise memory_limit above 120.0 MB" in said

    def test_arguments_and_results_taking_most_of_the_limit_say_what_is_left(self):
        said = self.warning(arguments=10 * 10**6, results=60 * 10**6)
        assert "alone are 70.0 MB" in said and "leaving 30.0 MB for everything else" in said
        assert "no rewrite" not in said

    def test_small_arguments_and_results_are_not_mentioned(self):
        said = self.warning(arguments=10 * 10**6, results=10 * 10**6)
        assert "alone" not in said and said.endswith("rewrite that op's input in smaller pieces.")

    def test_an_op_holding_more_than_the_limit_whole_is_named_instead_of_the_splitters_reasons(self):
        """A spectral clustering's ``eigh`` of [600, 600] under 2.06 MB: the warning blamed a slice of
        the eigenvalues, which no raise of the limit short of the eigh's own bytes would help."""
        whole = Whole("SelfAdjointEigV2", "tf.linalg.eigh", (600, 600), 2_881_200)
        said = CannotFit("spectral", 7_700_000, "about", None, 5_100_000, 2_060_000, 2_060_000,
                         "the splitter cannot split `Exp`: `StridedSlice` takes [596:600:1]", whole=whole).render()
        assert ("over its limit of 2.1 MB: `SelfAdjointEigV2` (tf.linalg.eigh) holds 2.9 MB whole at once "
                "([600, 600] matrices), which no rewrite splits. No rewrite") in said, said
        assert "raise memory_limit well above 2.9 MB" in said and "StridedSlice" not in said
        with_io = CannotFit("spectral", 7_700_000, "about", None, 5_100_000, 2_060_000, 2_060_000, "it cannot",
                            arguments=1_000_000, whole=whole).render()
        assert "with the arguments and results (arguments and variables 1.0 MB, results 0.0 MB), 3.9 MB" in with_io
        assert "raise memory_limit well above 3.9 MB" in with_io

    def test_an_op_held_whole_within_the_limit_leaves_the_splitters_reason(self):
        whole = Whole("MatrixInverse", "tf.linalg.inv", (300, 300), 720_000)
        said = CannotFit("f", 7_700_000, "about", None, 5_100_000, 2_060_000, 2_060_000,
                         "the splitter cannot split `Exp`", whole=whole).render()
        assert "and the splitter cannot split `Exp`." in said and "tf.linalg.inv" not in said

    def test_the_users_limit_is_said_and_the_scaled_one_planned_against_after_it(self):
        """A SimCLR step planned against 17.7 MB of a 30 MB limit (the model counting it 0.59x XLA's figure)
        said "over its limit of 17.7 MB": a limit the user never set."""
        said = CannotFit("step", 40 * 10**6, "about", 30 * 10**6, 48 * 10**6, 17_700_000, 30 * 10**6,
                         "it cannot").render()
        assert "over its limit of 30.0 MB (planned against 17.7 MB: the memory model counts this program 0.59x " \
               "XLA's figure)" in said, said

    def test_the_models_count_as_split_is_named_beside_xlas_figure_as_written(self):
        """A TFP GP prediction's warning read "needs 292.7 MB by XLA's figure as written (260.6 MB as
        split, 120.9 MB by XLA's figure)": the middle figure is the memory model's."""
        said = CannotFit("f", 292_700_000, "XLA", 260_600_000, 120_900_000, 96_500_000, 96_500_000, "no").render()
        assert ("needs 292.7 MB by XLA's figure as written (260.6 MB by the memory model as split, 120.9 MB by "
                "XLA's figure)") in said, said

    def test_a_figure_of_a_program_nothing_was_split_in_is_as_written(self):
        fig = dict(needed=300 * 10**6, by="about", figure=160 * 10**6, limit=10**8, wanted=10**8, what="it cannot")
        assert "(160.0 MB by XLA's figure as written)" in CannotFit("f", after=None, split=False, **fig).render()
        assert "(160.0 MB by XLA's figure as split)" in CannotFit("f", after=None, **fig).render()


class TestCause:
    """What a warning says could not be split: the largest such tensor, and how many others and how
    much they hold with it (a GPflow SVGP step under 4 MB, 4.5 MB by XLA's figure: five tensors of
    320 kB around its `Cholesky` stay whole, and the warning named one)."""

    @staticmethod
    def refused(op, size, code=Code.REFUSED_OP):
        return Record("splitter", "skipped", (op,), f"cannot split `{op}` ({size:,} B): `Cholesky` couples every "
                      "entry of its matrix (axis 0)", bytes_before=size, code=code)

    def test_the_others_are_counted_and_named_largest_first(self):
        worst = self.refused("MatMul", 320_000)
        records = [worst, self.refused("Exp", 320_000), self.refused("Square", 300_000, Code.FITS_WHOLE),
                   self.refused("add_4", 200_000), self.refused("MatMul", 320_000),     # (the same op again)
                   Record("splitter", "rewritten", ("Sum",), "a loop", 10**6, 10**5, code=Code.SPLIT)]
        assert cause(worst, records) == (
            "the splitter cannot split `MatMul` (320,000 B): `Cholesky` couples every entry of its matrix (axis 0); "
            "nor can it split 2 other large tensors (`Exp`, `add_4`): 0.8 MB with that one")

    def test_alone_it_is_said_as_before_and_many_are_counted_past_the_named(self):
        worst = self.refused("MatMul", 320_000)
        assert cause(worst, [worst]) == cause(worst) == ("the splitter cannot split `MatMul` (320,000 B): `Cholesky` "
                                                         "couples every entry of its matrix (axis 0)")
        many = [worst] + [self.refused(f"op_{i}", 100_000) for i in range(6)]
        assert cause(worst, many).endswith("nor can it split 6 other large tensors (`op_0`, `op_1`, `op_2`, "
                                           "`op_3` and 2 more): 0.9 MB with that one")
