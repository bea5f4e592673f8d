"""DTensor (issue 31): a jit function on batch-sharded DTensor inputs is rewritten when it is traced, and
each device's share stays within the limit while the unsplit function's is several times over; values,
gradients and the updated variable equal the run without tf_memsafe. A loop that would slice a large
sharded input (DTensor would gather it on every device) is not built, and one warning says why. The
functions run in a process of their own (``dtensor_step.py`` says why and how the peak is measured).
Before the gradient loop's TensorArrays declared their element shape, DTensor's SPMD expansion failed on
the rewritten training step inside TensorFlow ("'tf.TensorListSetItem' op ComputeLayoutForward error:
value type is not a RankedTensorType").
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.child import json_from_module


@pytest.fixture(scope="module")
def runs():
    return json_from_module("tests.integration.dtensor_step")


@pytest.mark.parametrize("case", ["kernel_sum", "train_step", "self_kernel"])
def test_each_devices_share_is_split_within_the_limit_with_the_same_values(runs, case):
    limit, naive, ours = runs["limit"], runs[case]["naive"], runs[case]["tf_memsafe"]
    assert naive["splitter"] == [] and naive["peak_per_device"] > 4 * limit, naive["peak_per_device"]
    assert "rewritten" in ours["splitter"], ours["splitter"]
    # DTensor runs each device's program with TensorFlow's executor on CPU, not XLA: the plan holds XLA's
    # figure of the global program to the limit, and the allocator's mean per device lands near it.
    assert ours["peak_per_device"] <= 1.25 * limit, (ours["peak_per_device"], limit)
    for got, expected in zip(ours["values"], naive["values"]):
        np.testing.assert_allclose(got, expected, rtol=1e-10)


def test_a_loop_that_would_gather_a_large_sharded_input_is_not_built_and_the_warning_says_why(runs):
    naive, ours = runs["mlp"]["naive"], runs["mlp"]["tf_memsafe"]
    assert "rewritten" not in ours["splitter"], ours["splitter"]
    # As traced (the allocator's figure moves by about a MiB between runs); the loop took it to 11x.
    assert ours["peak_per_device"] <= 2 * naive["peak_per_device"], (ours["peak_per_device"], naive)
    warned = [w for w in ours["warnings"] if "tf_memsafe" in w]
    assert len(warned) == 1 and "is sharded along axis 0 over mesh axis 'b' (DTensor): a loop over its slices " \
                                "would gather its" in warned[0], warned
    for got, expected in zip(ours["values"], naive["values"]):
        np.testing.assert_allclose(got, expected, rtol=1e-10)
