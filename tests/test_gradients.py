"""Gradients and transposed convolution: conv2d_backward, conv_transpose2d and its backward.

Oracles: convgen.reference over cases with dilation 1-3, groups 1/2/depthwise and every padding
form; central-difference gradients of convgen's own ops; the seed talk's hand-checked transposed
example; and the adjoint identity <conv2d(x, w), y> = <x, conv_transpose2d(y, w)>.
"""

import numpy as np
import pytest

import convgen
from convgen.planning import planner
from convgen import reference
from convgen.runtime.kernels import settings
from convgen.frontend.resolve import conv_problem
from convgen.planning.spec import winograd_computes
from grid import CONV_CASES, DTYPES, FORWARD_WINDOWS, GRADIENT_WINDOWS, LAYOUTS, TRANSPOSE_CASES, Case
from helpers import assert_close, numerical_gradient, relative_error, seeded_rng, to_layout

VARIANTS = pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])


# The gradient grid (CONV_CASES, TRANSPOSE_CASES) is in tests/grid.py: test_isa.py runs it on every ISA.

# Small cases for the numerical gradients (each costs two op calls per input element).
NUMERIC_CONV_CASES = [
    Case("d3-s2-pad2-g2", 2, 4, 6, 7, 4, (3, 3), 2, 2, 3, 2),
    Case("sides-rect-d2x1", 1, 2, 5, 6, 3, (2, 3), (1, 2), ((0, 1), (1, 0)), (2, 1)),
    Case("same-s2-odd-total", 1, 2, 9, 8, 3, (3, 3), 2, "same"),
    Case("pair-pad-depthwise-x2", 1, 3, 5, 7, 6, (3, 5), (2, 1), (1, 2), (1, 2), 3),
]
NUMERIC_TRANSPOSE_CASES = [
    Case("k4-s2-pad1", 1, 2, 3, 4, 3, (4, 4), 2, 1),
    Case("s2-d3-op2-g2", 1, 4, 3, 3, 2, (3, 3), 2, 2, 3, 2, output_padding=2),
    Case("sides-s3x1-d1x3-op2", 1, 2, 3, 3, 2, (5, 3), (3, 1), ((2, 1), (0, 2)), (1, 3), output_padding=2),
    Case("same-s2-odd-total", 2, 2, 3, 4, 2, (4, 3), 2, "same"),
]

# "same" on both sides of the adjoint identity: input sizes divisible by the stride.
SAME_ADJOINT_CASES = [
    Case("k4x3-s2", 2, 3, 6, 8, 4, (4, 3), 2, "same"),
    Case("k4x2-s1", 1, 2, 5, 7, 3, (4, 2), 1, "same"),
    Case("k3-s3-d2-g3", 2, 3, 9, 6, 6, (3, 3), 3, "same", 2, 3),
]


def _output_shape(case, layout, transposed):
    """The op's output shape, by the reference's own shape arithmetic."""
    x, w, _ = case.arrays(np.random.default_rng(0), layout, np.float64, transposed)
    op = reference.conv_transpose2d if transposed else reference.conv2d
    return op(x, w, layout=layout, **case.kwargs(transposed)).shape


# ----------------------------------------------------------------------------- against the reference
@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv2d_forward_matches_reference(case, layout, dtype, specialize):
    x, w, b = case.arrays(seeded_rng(case, layout, dtype), layout, dtype)
    y = convgen.conv2d(x, w, b, layout=layout, specialize=specialize, **case.kwargs())
    assert_close(y, reference.conv2d(x, w, b, layout=layout, **case.kwargs()), dtype, "y")


@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv2d_backward_matches_reference(case, layout, dtype, specialize):
    rng = seeded_rng(case, layout, dtype)
    x, w, _ = case.arrays(rng, layout, dtype)
    dy = rng.standard_normal(_output_shape(case, layout, transposed=False)).astype(dtype)
    dx, dw, db = convgen.conv2d_backward(dy, x, w, layout=layout, specialize=specialize, **case.kwargs())
    ex, ew, eb = reference.conv2d_backward(dy, x, w, layout=layout, **case.kwargs())
    assert_close(dx, ex, dtype, "dx")
    assert_close(dw, ew, dtype, "dw")
    assert_close(db, eb, dtype, "db")


@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=str)
def test_conv_transpose2d_matches_reference(case, layout, dtype, specialize):
    x, w, b = case.arrays(seeded_rng(case, layout, dtype), layout, dtype, transposed=True)
    kw = case.kwargs(transposed=True)
    y = convgen.conv_transpose2d(x, w, b, layout=layout, specialize=specialize, **kw)
    assert_close(y, reference.conv_transpose2d(x, w, b, layout=layout, **kw), dtype, "y")
    # without a bias too: the kernel's own output, no bias added afterwards
    y = convgen.conv_transpose2d(x, w, layout=layout, specialize=specialize, **kw)
    assert_close(y, reference.conv_transpose2d(x, w, layout=layout, **kw), dtype, "y without bias")


@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=str)
def test_conv_transpose2d_backward_matches_reference(case, layout, dtype, specialize):
    rng = seeded_rng(case, layout, dtype)
    x, w, _ = case.arrays(rng, layout, dtype, transposed=True)
    kw = case.kwargs(transposed=True)
    dy = rng.standard_normal(_output_shape(case, layout, transposed=True)).astype(dtype)
    dx, dw, db = convgen.conv_transpose2d_backward(dy, x, w, layout=layout, specialize=specialize, **kw)
    ex, ew, eb = reference.conv_transpose2d_backward(dy, x, w, layout=layout, **kw)
    assert_close(dx, ex, dtype, "dx")
    assert_close(dw, ew, dtype, "dw")
    assert_close(db, eb, dtype, "db")


# ---------------------------------------------------------------------------- numerical gradients
@pytest.fixture
def one_thread(threads):
    """Thousands of calls on tiny arrays: one thread each, so a busy machine does not stall them.

    The thread count does not change the arithmetic; the reference tests above run the default count.
    """
    threads(1)


def _check_numerical_gradients(op, op_backward, case, layout, specialize, transposed):
    rng = seeded_rng("numeric", case, layout)
    x, w, b = case.arrays(rng, layout, np.float64, transposed)
    kw = dict(case.kwargs(transposed), layout=layout, specialize=specialize)
    r = rng.standard_normal(_output_shape(case, layout, transposed))

    def loss():  # L = <r, y> + |y|²/2, so dL/dy = r + y
        y = op(x, w, b, **kw)
        return float(np.sum(r * y) + 0.5 * np.sum(y * y))

    dy = r + op(x, w, b, **kw)
    dx, dw, db = op_backward(dy, x, w, **kw)
    for name, array, analytic in (("dx", x, dx), ("dw", w, dw), ("db", b, db)):
        err = relative_error(numerical_gradient(loss, array, h=1e-3), analytic)
        assert err < 1e-6, f"{name}: relative error {err:.3g} against central differences"


@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", NUMERIC_CONV_CASES, ids=str)
def test_conv2d_numerical_gradients(case, layout, specialize, one_thread):
    _check_numerical_gradients(convgen.conv2d, convgen.conv2d_backward, case, layout, specialize, False)


@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", NUMERIC_TRANSPOSE_CASES, ids=str)
def test_conv_transpose2d_numerical_gradients(case, layout, specialize, one_thread):
    _check_numerical_gradients(convgen.conv_transpose2d, convgen.conv_transpose2d_backward, case, layout,
                               specialize, True)


# ------------------------------------------------------------------------ the seed talk's example
SEED_X = np.arange(1, 10, dtype=np.float64).reshape(1, 1, 3, 3)
SEED_W = -np.arange(1, 17, dtype=np.float64).reshape(1, 1, 4, 4)
SEED_Y = np.array([
    [-6, -17, -20, -29, -34, -21],
    [-18, -46, -58, -70, -86, -51],
    [-38, -94, -106, -134, -150, -87],
    [-54, -118, -142, -142, -170, -93],
    [-98, -214, -238, -254, -282, -153],
    [-70, -149, -164, -169, -186, -99],
], dtype=np.float64)


@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("padding", [1, "same"])
def test_seed_transposed_example(padding, layout, dtype, specialize):
    """x = 1..9 (3×3), w = −1..−16 (4×4), stride 2: the 6×6 given in the seed talk, exactly.

    padding="same" (TensorFlow's conv2d_transpose) resolves to 1 on every side here.
    """
    x, w = to_layout(SEED_X.astype(dtype), SEED_W.astype(dtype), layout)
    y = convgen.conv_transpose2d(x, w, stride=2, padding=padding, layout=layout, specialize=specialize)
    expected = SEED_Y[None, None] if layout == "NCHW" else SEED_Y[None, :, :, None]
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, expected)


@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
def test_seed_example_as_conv2d_input_gradient(layout, specialize):
    """The same 6×6 is conv2d's dx for a 6×6 input, k4 s2 p1 and dy = 1..9: the transpose is the backprop."""
    dy, w = to_layout(SEED_X, SEED_W, layout)
    x = np.zeros((1, 1, 6, 6)) if layout == "NCHW" else np.zeros((1, 6, 6, 1))
    dx, _, db = convgen.conv2d_backward(dy, x, w, stride=2, padding=1, layout=layout, specialize=specialize)
    np.testing.assert_array_equal(dx, SEED_Y[None, None] if layout == "NCHW" else SEED_Y[None, :, :, None])
    assert db.tolist() == [45.0]


# ------------------------------------------------------------------------------- adjoint identity
ALL_WINDOWS = FORWARD_WINDOWS + GRADIENT_WINDOWS


def _random_case(rng, window):
    """Random batch, channels, groups and an input size the window fits, for explicit padding."""
    groups = int(rng.choice([1, 2, 3]))
    depthwise = rng.random() < 0.3
    c = groups if depthwise else groups * int(rng.integers(1, 4))
    f = groups * int(rng.integers(1, 4))
    sizes = []
    for (before, after), extent in zip(window.padding, window.effective_kernel):
        smallest = max(1, extent - before - after)
        sizes.append(int(rng.integers(smallest, smallest + 9)))
    return Case("random", int(rng.integers(1, 4)), c, sizes[0], sizes[1], f, window.kernel, window.stride,
                window.padding, window.dilation, groups)


def _check_adjoint(case, layout, specialize, output_padding):
    rng = seeded_rng("adjoint", case, layout)
    x, w, _ = case.arrays(rng, layout, np.float64)
    kw = dict(case.kwargs(), layout=layout, specialize=specialize)
    y = rng.standard_normal(_output_shape(case, layout, transposed=False))
    conv = convgen.conv2d(x, w, **kw)
    transposed = convgen.conv_transpose2d(y, w, output_padding=output_padding, **kw)
    assert transposed.shape == x.shape
    lhs, rhs = float(np.sum(conv * y)), float(np.sum(x * transposed))
    bound = float(np.linalg.norm(conv) * np.linalg.norm(y))  # Cauchy–Schwarz: |lhs| <= bound
    assert abs(lhs - rhs) <= 1e-12 * bound, f"<conv2d(x, w), y> = {lhs!r} but <x, conv_transpose2d(y, w)> = {rhs!r}"


@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(len(ALL_WINDOWS)), ids=lambda i: ALL_WINDOWS[i].short())
def test_adjoint_identity(index, layout, specialize):
    """<conv2d(x, w), y> = <x, conv_transpose2d(y, w)>, with the same weight array in both."""
    window = ALL_WINDOWS[index]
    case = _random_case(np.random.default_rng(1000 + index), window)
    # The output_padding that brings the transposed output back to the input size.
    output_padding = tuple((n + before + after - extent) % s for n, (before, after), extent, s in zip(
        (case.h, case.w), window.padding, window.effective_kernel, window.stride))
    _check_adjoint(case, layout, specialize, output_padding)


@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", SAME_ADJOINT_CASES, ids=str)
def test_adjoint_identity_same_padding(case, layout, specialize):
    _check_adjoint(case, layout, specialize, output_padding=0)


# --------------------------------------------------------------------------------- arguments
def test_output_padding_bounds():
    """0 <= output_padding < max(stride, dilation): up to the dilation when it exceeds the stride."""
    x, w = np.ones((1, 2, 4, 4)), np.ones((2, 3, 3, 3))
    assert convgen.conv_transpose2d(x, w, padding=1, dilation=2, output_padding=1).shape == (1, 3, 7, 7)
    with pytest.raises(ValueError, match="output_padding"):
        convgen.conv_transpose2d(x, w, padding=1, dilation=2, output_padding=2)
    with pytest.raises(ValueError, match="output_padding"):
        convgen.conv_transpose2d(x, w, stride=2, output_padding=(0, 2))
    with pytest.raises(ValueError, match="output_padding"):
        convgen.conv_transpose2d(x, w, stride=2, padding="same", output_padding=1)


def test_every_window_is_prebuilt():
    """Each window these tests resolve to is compiled up front with the grid, not serially on first use."""
    prebuilt = set(ALL_WINDOWS)
    needed = {(case.name, case.window(False)) for case in CONV_CASES + NUMERIC_CONV_CASES + SAME_ADJOINT_CASES}
    needed |= {(case.name, case.window(True)) for case in TRANSPOSE_CASES + NUMERIC_TRANSPOSE_CASES}
    needed |= {(case.name + " (transposed)", case.window(True)) for case in SAME_ADJOINT_CASES}
    missing = sorted(f"{name}: {window.short()}" for name, window in needed if window not in prebuilt)
    assert not missing, f"add these windows to tests/grid.py GRADIENT_WINDOWS: {missing}"


# ------------------------------------------------------------- the same grid with Winograd forced
def _winograd_cases(cases, transposed=False):
    return [case for case in cases if winograd_computes(case.window(transposed))]


@pytest.fixture
def winograd_everywhere():
    """`auto` takes Winograd wherever it applies, whatever the channel count (the cost model's
    threshold lowered to one channel), so the grid's own tests run the Winograd kernels."""
    with convgen.configure(winograd_min_channels=1):
        yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", _winograd_cases(CONV_CASES), ids=str)
def test_conv2d_grid_with_winograd(case, layout, dtype, winograd_everywhere):
    x, w, _ = case.arrays(seeded_rng(case, layout, dtype), layout, dtype)
    problem = conv_problem(x.shape, w.shape, x.dtype, groups=case.kwargs()["groups"], layout=layout,
                           **{k: case.kwargs()[k] for k in ("stride", "padding", "dilation")})
    assert planner.plan(problem, True, settings().schedule()).spec.family == "winograd"
    test_conv2d_forward_matches_reference(case, layout, dtype, True)
    test_conv2d_backward_matches_reference(case, layout, dtype, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", _winograd_cases(TRANSPOSE_CASES, transposed=True), ids=str)
def test_conv_transpose2d_grid_with_winograd(case, layout, dtype, winograd_everywhere):
    test_conv_transpose2d_matches_reference(case, layout, dtype, True)
    test_conv_transpose2d_backward_matches_reference(case, layout, dtype, True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_input_gradient_of_a_1x1_window_is_the_forward_pass_over_dy(dtype, layout):
    """1x1, stride 1, no padding: the specialized input gradient runs the forward kernels over dy with
    c and f swapped and the weights turned round (templates/direct/backward_data.c.j2). Its workspace
    is theirs plus a turned copy of the weights, or theirs alone where NHWC's pixel rows read the
    weights where they lie (a forward pass over 16 channels or more: here f/g ≥ 16); conv2d_backward, conv_transpose2d and its prepared form (the
    weights laid out once, by `prepare`) give the oracle's dx, with groups and partial tiles, on small
    images (NCHW: the pixel rows) and large ones (NCHW: the phase planes; NHWC: runs of whole pixel
    tiles and the last few pixels), sums over more filters than one block, and weights holding inf."""
    from convgen.frontend import ops

    itemsize = np.dtype(dtype).itemsize
    # (136 and 128 filters: sums over the filters in blocks of 64, the last one partial or whole; 128
    # channels of a 3x3 image: weights larger than dy, each work item packing one column tile's panel)
    for n, c, h, w, f, groups in [(2, 6, 5, 7, 10, 2), (3, 18, 37, 31, 40, 1), (2, 16, 6, 5, 136, 1), (1, 8, 7, 7, 128, 1),
                                  (1, 128, 3, 3, 32, 1)]:
        rng = seeded_rng("dx as forward", dtype, c)
        x, weight = to_layout(rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c // groups, 1, 1)), layout)
        dy, turned_weight = to_layout(rng.standard_normal((n, f, h, w)), np.zeros((c, f // groups, 1, 1)), layout)
        x, weight, dy = x.astype(dtype), weight.astype(dtype), dy.astype(dtype)
        kw = dict(groups=groups, layout=layout)
        _, call = ops._prepare("conv2d_backward", (dy, x, weight), True, "direct", 1, 0, 1, groups, layout)
        turned = conv_problem(dy.shape, turned_weight.shape, np.dtype(dtype), 1, 0, 1, groups, layout)
        kernels = call.kernels()
        copy = 0 if layout == "NHWC" and f // groups >= 16 else c * (f // groups) * itemsize
        assert kernels.workspace_bytes("bwd_data", call.problem, 2) == kernels.workspace_bytes("fwd", turned, 2) + copy
        assert kernels.threads("bwd_data", call.problem, 2) == kernels.threads("fwd", turned, 2)
        want = reference.conv2d_backward(dy, x, weight, **kw)[0]
        got = convgen.conv2d_backward(dy, x, weight, **kw)[0]
        assert_close(got, want, dtype, "dx")
        assert_close(convgen.conv_transpose2d(dy, weight, **kw), want, dtype, "conv_transpose2d")
        prepared = convgen.prepare_conv_transpose2d(weight, input_shape=dy.shape, **kw)
        assert_close(prepared(dy), want, dtype, "prepared conv_transpose2d")
        # every product is one of the gradient's: inf (or nan) exactly where it lies
        weight[(1, 0, 0, 0) if layout == "NCHW" else (0, 0, 0, 1)] = np.inf
        want = reference.conv2d_backward(dy, x, weight, **kw)[0]
        got = convgen.conv2d_backward(dy, x, weight, **kw)[0]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        finite = np.isfinite(want)
        assert_close(got[finite], want[finite], dtype, "dx beside inf")


@pytest.mark.parametrize("dtype", DTYPES)
def test_input_gradient_of_a_centred_nchw_window_on_small_planes_is_the_forward_pass_over_dy(dtype):
    """NCHW, stride 1, zero padding centred on the window (d·(k − 1)/2 each side): where the forward
    pass over dy takes its pixel rows (planes of at most 800 pixels), the specialized input gradient
    is that forward pass with c and f swapped and the window flipped, the weights read where they lie
    (templates/direct/backward_data.c.j2): its workspace and threads are its, with no turned copy.
    dx, conv_transpose2d and its prepared form give the oracle's, with groups, dilation, rectangular
    windows, partial tiles and sums over more filters than one block. Weights holding inf take the
    input gradient's own kernels (the forward pass would multiply them by dy's zero padding), so inf
    and NaN land where the oracle's do, called and prepared. A larger plane keeps the input gradient's
    own kernels: its workspace is the generic module's."""
    from convgen.frontend import ops
    from convgen.planning.spec import ConvSpec
    from convgen.runtime.kernels import get_kernels

    # (groups of more than 16 channels and filters: fewer take planner.adjoint_forward, in Python)
    cases = [(2, 12, 6, 7, 20, (3, 3), 1, 1, 1), (1, 40, 5, 9, 36, (5, 3), (2, 1), 1, 2),
             (2, 34, 7, 6, 40, (3, 3), 2, 2, 2), (2, 16, 9, 9, 136, (3, 3), 1, 1, 1),
             (1, 4, 40, 40, 8, (3, 3), 1, 1, 1),
             # weights larger than the image: each work item packs one column tile's panel, and says
             # whether its weights are finite
             (1, 136, 3, 3, 40, (3, 3), 1, 1, 1),
             # a window of fewer taps than half a vector, turned round in whole vectors
             (1, 32, 6, 7, 40, (1, 3), (0, 1), 1, 1)]
    for n, c, h, w, f, kernel, padding, dilation, groups in cases:
        rng = seeded_rng("centred dx as forward", dtype, c, h)
        x = rng.standard_normal((n, c, h, w)).astype(dtype)
        weight = rng.standard_normal((f, c // groups, *kernel)).astype(dtype)
        dy = rng.standard_normal((n, f, h, w)).astype(dtype)
        kw = dict(padding=padding, dilation=dilation, groups=groups)
        direct = dict(kw, algorithm="direct")  # (not Winograd: its transforms mix the taps)
        _, call = ops._prepare("conv2d_backward", (dy, x, weight), True, "direct", 1, padding, dilation, groups, "NCHW")
        kernels = call.kernels()
        if h * w <= 800:
            turned = conv_problem(dy.shape, (c, f // groups, *kernel), np.dtype(dtype), 1, padding, dilation, groups,
                                  "NCHW")
            assert kernels.workspace_bytes("bwd_data", call.problem, 2) == kernels.workspace_bytes("fwd", turned, 2)
            assert kernels.threads("bwd_data", call.problem, 2) == kernels.threads("fwd", turned, 2)
        else:
            generic = get_kernels(ConvSpec(None, dtype, "NCHW"))
            assert (kernels.workspace_bytes("bwd_data", call.problem, 2)
                    == generic.workspace_bytes("bwd_data", call.problem, 2))
        want = reference.conv2d_backward(dy, x, weight, **kw)[0]
        assert_close(convgen.conv2d_backward(dy, x, weight, **direct)[0], want, dtype, "dx")
        assert_close(convgen.conv_transpose2d(dy, weight, **direct), want, dtype, "conv_transpose2d")
        prepared = convgen.prepare_conv_transpose2d(weight, input_shape=dy.shape, **direct)
        assert_close(prepared(dy), want, dtype, "prepared conv_transpose2d")
        weight[1, 0, 0, 0] = np.inf
        want = reference.conv2d_backward(dy, x, weight, **kw)[0]
        prepared = convgen.prepare_conv_transpose2d(weight, input_shape=dy.shape, **direct)
        for got in (convgen.conv2d_backward(dy, x, weight, **direct)[0], prepared(dy)):
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
            finite = np.isfinite(want)
            assert finite.any() and not finite.all()
            assert_close(got[finite], want[finite], dtype, "dx beside inf")
