"""Kernels.call_addresses: every op's address form (its arrays as integer addresses, its sizes as one
array: `abi.address_definition`), what convgen.torch calls, runs the same kernels as Kernels.call,
in the specialized and the generic build, and agrees with the reference."""

import numpy as np
import pytest

from convgen import reference
from convgen.codegen import abi
from convgen.planning.spec import Window
from helpers import assert_close, call_problem, kernels_for, seeded_rng

WINDOW = Window(3, 2, 1)


def _arrays(layout):
    rng = seeded_rng("addresses", layout)
    x = rng.standard_normal((2, 5, 9, 8)).astype(np.float32)
    w = rng.standard_normal((6, 5, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    dy = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)
    if layout == "NHWC":
        x, w, dy = x.transpose(0, 2, 3, 1).copy(), w.transpose(2, 3, 1, 0).copy(), dy.transpose(0, 2, 3, 1).copy()
    return x, w, bias, dy


def _address(array):
    return 0 if array is None else array.ctypes.data


@pytest.mark.parametrize("specialize", [True, False])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_address_form_runs_what_call_runs(layout, specialize):
    x, w, bias, dy = _arrays(layout)
    problem = call_problem("conv2d", x, dy, WINDOW, layout=layout)
    kernels = kernels_for(problem, specialize, "direct")
    kw = dict(stride=2, padding=1, layout=layout)
    wanted = {"fwd": reference.conv2d(x, w, bias, **kw)}
    wanted["bwd_data"], wanted["bwd_weight"], _ = reference.conv2d_backward(dy, x, w, **kw)
    inputs = {"fwd": (x, w, None, bias, None), "bwd_data": (dy, w, None), "bwd_weight": (dy, x)}
    for entry in abi.OPS:
        by_call, by_address = (np.full(wanted[entry].shape, np.nan, np.float32) for _ in range(2))
        kernels.call(entry, problem, (*inputs[entry], by_call))
        kernels.call_addresses(entry, problem, tuple(_address(a) for a in (*inputs[entry], by_address)))
        np.testing.assert_array_equal(by_address, by_call, err_msg=entry)
        assert_close(by_address, wanted[entry], np.float32, f"{entry} through its address form")


def test_the_address_form_declares_every_size_argument():
    """The C wrapper passes sizes[0 .. n) on, n the count of `size_arguments` of the build: a size
    dropped or added would shift every argument after it."""
    for specialize in (True, False):
        x, w, bias, dy = _arrays("NCHW")
        problem = call_problem("conv2d", x, dy, WINDOW)
        spec = kernels_for(problem, specialize, "direct").spec
        count = len(abi.size_arguments(problem, spec.specialized))
        for entry in abi.OPS:
            definition = abi.address_definition(entry, spec)
            assert f"sizes[{count - 1}]" in definition and f"sizes[{count}]" not in definition, definition
