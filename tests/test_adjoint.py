"""conv2d's input gradient as the adjoint forward convolution (`planner.adjoint_forward`).

At stride 1 with zero padding centred in the window, dx = conv2d(dy) with each group's filters and
channels exchanged and the window flipped (`ops.adjoint_weights`); the planner takes that route for
groups of few channels. Checked: which problems take it (the rule, case by case); the flipped
weights against the adjoint identity <conv2d(x, w), dy> = <x, conv2d(dy, w')> computed by
convgen.reference; and every op that runs an input gradient on a routed problem — conv2d_backward,
conv_transpose2d, a prepared conv_transpose2d, and convgen.torch's conv2d gradient and transposed
forward in both memory formats — against convgen.reference and PyTorch, with the route asserted
taken, so that none of it can pass through the input-gradient kernels unnoticed.
"""

import numpy as np
import pytest
import torch

import convgen
import convgen.torch as cgt
from convgen import reference
from convgen.frontend import ops
from convgen.frontend.resolve import conv_problem
from convgen.planning import planner
from convgen.planning.spec import Window
from convgen.runtime.kernels import settings
from convgen.torch import library
from helpers import assert_close, seeded_rng, to_layout


def _problem(c, f, groups, window, layout="NCHW"):
    w_shape = to_layout(np.empty((1, c, 1, 1)), np.empty((f, c // groups, *window.kernel)), layout)[1].shape
    return conv_problem((2, c, 9, 10) if layout == "NCHW" else (2, 9, 10, c), w_shape, np.dtype("float32"), window.stride,
                        window.padding, window.dilation, groups, layout, window.padding_mode)


@pytest.mark.parametrize("c, f, groups, window, routed", [
    (64, 64, 32, Window(3, 1, 1), True),               # 2 channels a group
    (64, 64, 4, Window(3, 1, 1), True),                # 16 a group: the most
    (64, 64, 2, Window(3, 1, 1), False),               # 32 a group
    (4, 64, 4, Window(3, 1, 1), True),                 # 16 filters a group
    (4, 68, 4, Window(3, 1, 1), False),                # 17 filters a group
    (64, 64, 1, Window(3, 1, 1), False),               # one group
    (32, 32, 16, Window(5, 1, 2), True),
    (16, 16, 8, Window(3, 1, 2, 2), True),             # dilation 2, padding 2: centred
    (16, 16, 8, Window(3, 1, 1, 2), False),            # dilation 2, padding 1: not centred
    (16, 16, 8, Window((1, 3), 1, (0, 1)), True),
    (16, 16, 8, Window(3, 2, 1), False),               # stride 2
    (16, 16, 8, Window(3, 1, ((1, 1), (0, 2))), False),  # as much padding, not centred
    (16, 16, 8, Window(2, 1, ((0, 1), (0, 1))), False),  # an even window: never centred
    (16, 16, 8, Window(3, 1, 1, padding_mode="reflect"), False),
])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_which_input_gradients_run_as_the_adjoint_forward(c, f, groups, window, routed, layout):
    problem = _problem(c, f, groups, window, layout)
    adjoint = planner.adjoint_forward(problem, planner.plan(problem, True, settings().schedule(), "direct"))
    assert (adjoint is not None) == routed
    if routed:  # dy's shape to x's, through the same window and groups
        assert (adjoint.c, adjoint.h, adjoint.w, adjoint.f, adjoint.ho, adjoint.wo) == (f, 9, 10, c, 9, 10)
        assert (adjoint.window, adjoint.groups, adjoint.transpose) == (window, groups, False)
        # a transposed call whose conv() is routed takes the same convolution for its output
        transposed = problem.transposed()
        assert planner.adjoint_forward(transposed, planner.plan(transposed, True, settings().schedule(), "direct")) \
            == adjoint


def test_only_the_direct_family_is_routed():
    problem = _problem(16, 16, 16, Window(3, 1, 1))  # depthwise: its own input-gradient kernels
    assert planner.plan(problem, True, settings().schedule(), "auto").family == "depthwise"
    assert planner.adjoint_forward(problem, planner.plan(problem, True, settings().schedule(), "auto")) is None


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("groups, kernel", [(1, (3, 3)), (3, (3, 3)), (2, (2, 5))])
def test_adjoint_weights_satisfy_the_adjoint_identity(layout, groups, kernel):
    """<conv2d(x, w), dy> = <x, conv2d(dy, w')> for centred windows, in float64 through the reference."""
    rng = seeded_rng("adjoint weights", layout, groups, kernel)
    window = Window(kernel, 1, tuple(((k - 1) // 2, (k - 1) // 2) for k in kernel))
    if any(k % 2 == 0 for k in kernel):  # an even window: the adjoint's padding is the other side's
        window = Window(kernel, 1, tuple(((k - 1) // 2, k // 2) for k in kernel))
    x, w = to_layout(rng.standard_normal((2, 6, 7, 8)), rng.standard_normal((12, 6 // groups, *kernel)), layout)
    kw = dict(groups=groups, layout=layout)
    y = reference.conv2d(x, w, padding=window.padding, **kw)
    dy = rng.standard_normal(y.shape)
    flipped_padding = tuple((after, before) for before, after in window.padding)
    dx = reference.conv2d(dy, ops.adjoint_weights(w, groups, layout), padding=flipped_padding, **kw)
    assert dx.shape == x.shape
    np.testing.assert_allclose(np.vdot(y, dy), np.vdot(x, dx), rtol=1e-12)
    np.testing.assert_allclose(dx, reference.conv2d_backward(dy, x, w, padding=window.padding, **kw)[0], atol=1e-12)


# (n, c, h, w, f, window, groups)
CASES = [
    (2, 64, 9, 10, 64, Window(3, 1, 1), 32),     # 2 channels and filters a group
    (2, 12, 8, 9, 18, Window(3, 1, 2, 2), 6),    # 2 channels, 3 filters; dilated
    (1, 8, 7, 11, 8, Window(5, 1, 2), 4),
    (2, 6, 5, 6, 12, Window(1, 1, 0), 3),
    (2, 8, 6, 7, 4, Window((1, 3), 1, (0, 1)), 4),  # one filter a group
]


def _ids(case):
    n, c, h, w, f, window, groups = case
    return f"{n}x{c}x{h}x{w}-{f}-{window.short()}-g{groups}"


@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_numpy_ops_on_routed_problems(case, layout, dtype, specialize):
    n, c, h, w, f, window, groups = case
    rng = seeded_rng("adjoint numpy", case, layout, dtype)
    x, weight = to_layout(rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c // groups, *window.kernel)),
                          layout)
    x, weight, bias = x.astype(dtype), weight.astype(dtype), rng.standard_normal(c).astype(dtype)
    kw = dict(padding=window.padding, dilation=window.dilation, groups=groups, layout=layout)
    dy = rng.standard_normal(reference.conv2d(x, weight, **kw).shape).astype(dtype)
    options = dict(kw, specialize=specialize, algorithm="direct")
    assert ops.prepare("conv2d_backward", (dy, x, weight), **options).adjoint is not None
    assert ops.prepare("conv_transpose2d", (dy, weight, bias), **options).adjoint is not None
    before = (dy.copy(), weight.copy())

    dx, dw, db = convgen.conv2d_backward(dy, x, weight, **options)
    expected = reference.conv2d_backward(dy, x, weight, **kw)
    for name, got, want in zip(("dx", "dw", "db"), (dx, dw, db), expected):
        assert_close(got, want, dtype, name)
    # the transposed convolution of dy with the same weights is that dx, plus a bias
    expected_t = reference.conv_transpose2d(dy, weight, bias, **kw)
    assert_close(convgen.conv_transpose2d(dy, weight, bias, **options), expected_t, dtype, "conv_transpose2d")
    prepared = convgen.prepare_conv_transpose2d(weight, bias, input_shape=dy.shape, **options)
    assert_close(prepared(dy), expected_t, dtype, "prepared conv_transpose2d")
    # new weights reach the prepared form flipped too
    prepared.update(2 * weight)
    assert_close(prepared(dy), reference.conv_transpose2d(dy, 2 * weight, bias, **kw), dtype, "after update")
    np.testing.assert_array_equal(dy, before[0])
    np.testing.assert_array_equal(weight, before[1])


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
@pytest.mark.parametrize("case", CASES[:3], ids=_ids)
def test_torch_gradients_and_transposed_output_on_routed_problems(case, memory_format):
    n, c, h, w, f, window, groups = case
    fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
    torch.manual_seed(len(memory_format) + c)
    padding, dilation = [p[0] for p in window.padding], list(window.dilation)
    x = torch.randn(n, c, h, w, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
    weight = torch.randn(f, c // groups, *window.kernel, dtype=torch.float64).contiguous(memory_format=fmt)
    weight.requires_grad_()
    x_t, weight_t = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()

    y = cgt.conv2d(x, weight, padding=padding, dilation=dilation, groups=groups, algorithm="direct")
    y_t = torch.nn.functional.conv2d(x_t, weight_t, padding=padding, dilation=dilation, groups=groups)
    dy = torch.randn_like(y_t)
    y.backward(dy)
    y_t.backward(dy)
    torch.testing.assert_close(y, y_t, rtol=0, atol=1e-11)
    torch.testing.assert_close(x.grad, x_t.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(weight.grad, weight_t.grad, rtol=0, atol=1e-10)

    with torch.no_grad():
        out = cgt.conv_transpose2d(dy, weight, padding=padding, dilation=dilation, groups=groups, algorithm="direct")
        expected = torch.nn.functional.conv_transpose2d(dy, weight, padding=padding, dilation=dilation, groups=groups)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-11)
    routed = [bound for bound in library._BOUND.values() if bound.forward_call.problem.c in (c, f)
              and ((bound.forward_call.problem.transpose and bound.forward_call.adjoint is not None)
                   or (bound.backward_call is not None and bound.backward_call.adjoint is not None))]
    assert len(routed) >= 2  # the conv2d's gradient and the transposed forward both took the route
