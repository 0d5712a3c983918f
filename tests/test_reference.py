"""Tests for convgen.reference, the NumPy oracle.

Nothing here takes expected values from the module under test: they are written
by hand, taken from the transposed-convolution seed (TensorFlow output), produced
by dumb pure-Python loops written below, or follow from identities (adjointness,
finite differences).
"""

import itertools
import tracemalloc
import zlib

import numpy as np
import pytest

from convgen import reference as ref
from helpers import numerical_gradient, relative_error


# --------------------------------------------------------------------------
# Independent pure-Python implementations (NCHW, PyTorch weight layout)
# --------------------------------------------------------------------------

def _pads(padding):
    """((top, bottom), (left, right)) for the explicit forms used in this file."""
    if isinstance(padding, int):
        return ((padding, padding), (padding, padding))
    if isinstance(padding[0], int):
        return ((padding[0], padding[0]), (padding[1], padding[1]))
    return padding


def brute_conv2d(x, w, b, stride, padding, dilation, groups):
    """Seven nested loops straight from the definition, no padded copy."""
    N, C, H, W = x.shape
    F, Cg, KH, KW = w.shape
    sh, sw = stride
    dh, dw = dilation
    (top, bottom), (left, right) = _pads(padding)
    Ho = (H + top + bottom - dh * (KH - 1) - 1) // sh + 1
    Wo = (W + left + right - dw * (KW - 1) - 1) // sw + 1
    Fg = F // groups
    y = np.zeros((N, F, Ho, Wo))
    for n in range(N):
        for f in range(F):
            grp = f // Fg
            for oh in range(Ho):
                for ow in range(Wo):
                    acc = 0.0 if b is None else float(b[f])
                    for c in range(Cg):
                        for i in range(KH):
                            for j in range(KW):
                                hh = oh * sh + i * dh - top
                                ww = ow * sw + j * dw - left
                                if 0 <= hh < H and 0 <= ww < W:
                                    acc += w[f, c, i, j] * x[n, grp * Cg + c, hh, ww]
                    y[n, f, oh, ow] = acc
    return y


def brute_conv_transpose2d(x, w, b, stride, padding, output_padding, dilation, groups):
    """Gather form of the transposed conv: each output pixel collects the input
    pixels h with h*s + i*d - top == oh (the reference itself scatters)."""
    N, Cin, H, W = x.shape
    _, Cog, KH, KW = w.shape
    sh, sw = stride
    dh, dw = dilation
    oph, opw = output_padding
    (top, bottom), (left, right) = _pads(padding)
    Ho = (H - 1) * sh - top - bottom + dh * (KH - 1) + oph + 1
    Wo = (W - 1) * sw - left - right + dw * (KW - 1) + opw + 1
    Cig = Cin // groups
    y = np.zeros((N, Cog * groups, Ho, Wo))
    for n in range(N):
        for co in range(Cog * groups):
            grp, f = divmod(co, Cog)
            for oh in range(Ho):
                for ow in range(Wo):
                    acc = 0.0 if b is None else float(b[co])
                    for ci in range(grp * Cig, (grp + 1) * Cig):
                        for i in range(KH):
                            for j in range(KW):
                                th, tw = oh + top - i * dh, ow + left - j * dw
                                if th % sh or tw % sw:
                                    continue
                                hh, ww = th // sh, tw // sw
                                if 0 <= hh < H and 0 <= ww < W:
                                    acc += x[n, ci, hh, ww] * w[ci, f, i, j]
                    y[n, co, oh, ow] = acc
    return y


def nchw_to_nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def nhwc_to_nchw(a):
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2))


def torch_w_to_tf(w):
    """(F, C/g, KH, KW) -> (KH, KW, C/g, F); also (Cin, Cout/g, ..) -> (.., Cout/g, Cin)."""
    return np.ascontiguousarray(w.transpose(2, 3, 1, 0))


def tf_w_to_torch(w):
    return np.ascontiguousarray(w.transpose(3, 2, 0, 1))


# --------------------------------------------------------------------------
# Hand-checked values
# --------------------------------------------------------------------------

SEED_003_EXPECTED = np.array([
    [-6, -17, -20, -29, -34, -21],
    [-18, -46, -58, -70, -86, -51],
    [-38, -94, -106, -134, -150, -87],
    [-54, -118, -142, -142, -170, -93],
    [-98, -214, -238, -254, -282, -153],
    [-70, -149, -164, -169, -186, -99],
], dtype=np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_seed_transpose_example_nchw(dtype):
    x = np.arange(1, 10, dtype=dtype).reshape(1, 1, 3, 3)
    w = np.arange(-1, -17, -1, dtype=dtype).reshape(1, 1, 4, 4)
    y = ref.conv_transpose2d(x, w, stride=2, padding=1)
    assert y.dtype == dtype
    assert y.shape == (1, 1, 6, 6)
    np.testing.assert_array_equal(y[0, 0], SEED_003_EXPECTED)


def test_seed_transpose_example_nhwc():
    x = np.arange(1, 10, dtype=np.float64).reshape(1, 3, 3, 1)
    w = np.arange(-1, -17, -1, dtype=np.float64).reshape(4, 4, 1, 1)
    y = ref.conv_transpose2d(x, w, stride=2, padding=1, layout="NHWC")
    assert y.shape == (1, 6, 6, 1)
    np.testing.assert_array_equal(y[0, :, :, 0], SEED_003_EXPECTED)
    # The seed used TensorFlow's padding="SAME" with output 6x6 = 3*2.
    y_same = ref.conv_transpose2d(x, w, stride=2, padding="same", layout="NHWC")
    np.testing.assert_array_equal(y_same[0, :, :, 0], SEED_003_EXPECTED)


def test_seed_transpose_example_equals_zero_stuffed_conv():
    """The seed's 9x9 zero-stuffed input convolved (VALID) with the flipped kernel."""
    stuffed = np.zeros((9, 9))
    stuffed[2:7:2, 2:7:2] = np.arange(1, 10).reshape(3, 3)
    flipped = np.arange(-16, 0, 1, dtype=np.float64).reshape(4, 4)
    y = ref.conv2d(stuffed.reshape(1, 1, 9, 9), flipped.reshape(1, 1, 4, 4))
    np.testing.assert_array_equal(y[0, 0], SEED_003_EXPECTED)


X3 = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.float64)
W2 = np.array([[1, 2], [3, 4]], dtype=np.float64)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("stride,padding,expected", [
    (1, 0, [[37, 47], [67, 77]]),
    (1, 1, [[4, 11, 18, 9],
            [18, 37, 47, 21],
            [36, 67, 77, 33],
            [14, 23, 26, 9]]),
    (2, 1, [[4, 18], [36, 77]]),
    (2, 0, [[37]]),
    (1, ((1, 0), (0, 0)), [[11, 18], [37, 47], [67, 77]]),  # pad the top row only
])
def test_conv2d_hand_computed(layout, stride, padding, expected):
    x = X3.reshape(1, 1, 3, 3)
    w = W2.reshape(1, 1, 2, 2)
    if layout == "NHWC":
        x = x.reshape(1, 3, 3, 1)
        w = W2.reshape(2, 2, 1, 1)
    y = ref.conv2d(x, w, stride=stride, padding=padding, layout=layout)
    y2 = y[0, 0] if layout == "NCHW" else y[0, :, :, 0]
    np.testing.assert_array_equal(y2, np.array(expected, dtype=np.float64))


def test_conv2d_hand_computed_bias_two_filters_and_dilation():
    x = X3.reshape(1, 1, 3, 3)
    w = np.stack([W2, -W2]).reshape(2, 1, 2, 2)
    y = ref.conv2d(x, w, np.array([10.0, 0.5]))
    np.testing.assert_array_equal(y[0, 0], [[47, 57], [77, 87]])
    np.testing.assert_array_equal(y[0, 1], [[-36.5, -46.5], [-66.5, -76.5]])
    # dilation 2: the 2x2 kernel touches the four corners 1, 3, 7, 9
    y = ref.conv2d(x, W2.reshape(1, 1, 2, 2), dilation=2)
    np.testing.assert_array_equal(y, [[[[1 * 1 + 2 * 3 + 3 * 7 + 4 * 9]]]])


def test_conv2d_hand_computed_groups():
    # two channels, groups=2: each output channel sees only its own channel
    x = np.stack([X3, 10 * X3]).reshape(1, 2, 3, 3)
    w = np.stack([W2, W2]).reshape(2, 1, 2, 2)
    y = ref.conv2d(x, w, groups=2)
    np.testing.assert_array_equal(y[0, 0], [[37, 47], [67, 77]])
    np.testing.assert_array_equal(y[0, 1], [[370, 470], [670, 770]])


def test_conv2d_backward_hand_computed():
    # 1x1 output: dy = 1 -> dx is the kernel placed on the 2x2 window, dw the window
    x = X3.reshape(1, 1, 3, 3)
    w = W2.reshape(1, 1, 2, 2)
    dy = np.ones((1, 1, 1, 1))
    dx, dw, db = ref.conv2d_backward(dy, x, w, stride=2)
    np.testing.assert_array_equal(dx[0, 0], [[1, 2, 0], [3, 4, 0], [0, 0, 0]])
    np.testing.assert_array_equal(dw[0, 0], [[1, 2], [4, 5]])
    np.testing.assert_array_equal(db, [1.0])


# --------------------------------------------------------------------------
# Brute-force comparisons on random tiny shapes
# --------------------------------------------------------------------------

def _random_conv_cases(seed, count):
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        groups = int(rng.choice([1, 1, 2, 3]))
        C = groups * int(rng.integers(1, 3))
        F = groups * int(rng.integers(1, 3))
        KH, KW = (int(v) for v in rng.integers(1, 4, size=2))
        H, W = (int(v) for v in rng.integers(3, 8, size=2))
        stride = tuple(int(v) for v in rng.integers(1, 4, size=2))
        dilation = tuple(int(v) for v in rng.integers(1, 3, size=2))
        kind = rng.integers(0, 3)
        if kind == 0:
            padding = int(rng.integers(0, 3))
        elif kind == 1:
            padding = tuple(int(v) for v in rng.integers(0, 3, size=2))
        else:
            padding = tuple(tuple(int(v) for v in rng.integers(0, 3, size=2)) for _ in range(2))
        (top, bottom), (left, right) = _pads(padding)
        if (H + top + bottom - dilation[0] * (KH - 1) - 1 < 0
                or W + left + right - dilation[1] * (KW - 1) - 1 < 0):
            continue
        N = int(rng.integers(1, 3))
        cases.append((N, C, H, W, F, KH, KW, stride, padding, dilation, groups))
    return cases


CONV_CASES = _random_conv_cases(seed=1234, count=24)


def _seed(case, offset=0):
    """A seed from the case's values: the same in every run (hash() of a tuple with strings is not)."""
    return zlib.crc32(repr(case).encode()) + offset


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[str(i) for i in range(len(CONV_CASES))])
def test_conv2d_matches_brute_force(case, layout):
    N, C, H, W, F, KH, KW, stride, padding, dilation, groups = case
    rng = np.random.default_rng(_seed(case))
    x = rng.standard_normal((N, C, H, W))
    w = rng.standard_normal((F, C // groups, KH, KW))
    b = rng.standard_normal(F)
    expected = brute_conv2d(x, w, b, stride, padding, dilation, groups)
    if layout == "NCHW":
        got = ref.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    else:
        got = nhwc_to_nchw(ref.conv2d(nchw_to_nhwc(x), torch_w_to_tf(w), b, stride=stride,
                                      padding=padding, dilation=dilation, groups=groups,
                                      layout="NHWC"))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def _transpose_case(case, rng):
    """A conv_transpose2d case derived from a conv2d case: input channels F,
    output channels C, plus a random legal output_padding."""
    N, C, H, W, F, KH, KW, stride, padding, dilation, groups = case
    op = tuple(int(rng.integers(0, max(s, d))) for s, d in zip(stride, dilation))
    (top, bottom), (left, right) = _pads(padding)
    Hi, Wi = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    # grow the input until the cropped output is non-empty
    while (Hi - 1) * stride[0] - top - bottom + dilation[0] * (KH - 1) + op[0] + 1 < 1:
        Hi += 1
    while (Wi - 1) * stride[1] - left - right + dilation[1] * (KW - 1) + op[1] + 1 < 1:
        Wi += 1
    return N, F, Hi, Wi, C, KH, KW, stride, padding, op, dilation, groups


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[str(i) for i in range(len(CONV_CASES))])
def test_conv_transpose2d_matches_brute_force(case, layout):
    rng = np.random.default_rng(_seed(case))
    N, Cin, H, W, Cout, KH, KW, stride, padding, op, dilation, groups = _transpose_case(case, rng)
    (top, bottom), (left, right) = _pads(padding)
    Ho = (H - 1) * stride[0] - top - bottom + dilation[0] * (KH - 1) + op[0] + 1
    Wo = (W - 1) * stride[1] - left - right + dilation[1] * (KW - 1) + op[1] + 1
    x = rng.standard_normal((N, Cin, H, W))
    w = rng.standard_normal((Cin, Cout // groups, KH, KW))
    b = rng.standard_normal(Cout)
    expected = brute_conv_transpose2d(x, w, b, stride, padding, op, dilation, groups)
    kw = dict(stride=stride, padding=padding, output_padding=op, dilation=dilation, groups=groups)
    if layout == "NCHW":
        got = ref.conv_transpose2d(x, w, b, **kw)
    else:
        got = nhwc_to_nchw(ref.conv_transpose2d(nchw_to_nhwc(x), torch_w_to_tf(w), b,
                                                layout="NHWC", **kw))
    assert got.shape == expected.shape == (N, Cout, Ho, Wo)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# Adjoint identity: <conv2d(x, w), y> == <x, conv_transpose2d(y, w)>
# --------------------------------------------------------------------------

def _inner(a, b):
    return float(np.sum(a * b))


@pytest.mark.parametrize("case", CONV_CASES, ids=[str(i) for i in range(len(CONV_CASES))])
def test_adjoint_identity(case):
    N, C, H, W, F, KH, KW, stride, padding, dilation, groups = case
    rng = np.random.default_rng(_seed(case, 1))
    x = rng.standard_normal((N, C, H, W))
    w = rng.standard_normal((F, C // groups, KH, KW))
    (top, bottom), (left, right) = _pads(padding)
    Ho = (H + top + bottom - dilation[0] * (KH - 1) - 1) // stride[0] + 1
    Wo = (W + left + right - dilation[1] * (KW - 1) - 1) // stride[1] + 1
    y = rng.standard_normal((N, F, Ho, Wo))
    # output_padding that makes the transposed output exactly H x W again
    op = (H + top + bottom - dilation[0] * (KH - 1) - 1 - (Ho - 1) * stride[0],
          W + left + right - dilation[1] * (KW - 1) - 1 - (Wo - 1) * stride[1])
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    cx = ref.conv2d(x, w, **kw)
    ty = ref.conv_transpose2d(y, w, output_padding=op, **kw)
    assert cx.shape == y.shape and ty.shape == x.shape
    lhs, rhs = _inner(cx, y), _inner(x, ty)
    assert lhs == pytest.approx(rhs, rel=1e-10, abs=1e-12)

    # and the same in NHWC
    cx = ref.conv2d(nchw_to_nhwc(x), torch_w_to_tf(w), layout="NHWC", **kw)
    ty = ref.conv_transpose2d(nchw_to_nhwc(y), torch_w_to_tf(w), output_padding=op,
                              layout="NHWC", **kw)
    assert _inner(cx, nchw_to_nhwc(y)) == pytest.approx(_inner(nchw_to_nhwc(x), ty),
                                                        rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("H,W,k,s,d", [(6, 8, 3, 2, 1), (6, 6, 4, 3, 1), (8, 4, 3, 2, 2),
                                       (5, 7, 2, 1, 3), (4, 4, 1, 2, 1)])
def test_adjoint_identity_same_padding(H, W, k, s, d):
    """With in % stride == 0 the 'same' conv and the 'same' transposed conv are adjoint."""
    rng = np.random.default_rng(H * 100 + W * 10 + k)
    x = rng.standard_normal((2, 4, H, W))
    w = rng.standard_normal((6, 2, k, k))
    Ho, Wo = -(-H // s), -(-W // s)
    y = rng.standard_normal((2, 6, Ho, Wo))
    kw = dict(stride=s, dilation=d, groups=2, padding="same")
    cx = ref.conv2d(x, w, **kw)
    assert cx.shape == y.shape
    if H % s == 0 and W % s == 0:
        ty = ref.conv_transpose2d(y, w, **kw)
        assert ty.shape == x.shape
        assert _inner(cx, y) == pytest.approx(_inner(x, ty), rel=1e-10)


# --------------------------------------------------------------------------
# Gradients by central differences
# --------------------------------------------------------------------------

GRAD_CASES = [
    # (N, C, H, W, F, KH, KW, stride, padding, dilation, groups, layout)
    (2, 2, 5, 4, 3, 3, 2, (1, 1), 1, (1, 1), 1, "NCHW"),
    (1, 4, 6, 5, 2, 2, 3, (2, 1), ((1, 0), (2, 1)), (1, 2), 2, "NCHW"),
    (2, 3, 5, 5, 3, 3, 3, (2, 2), (0, 1), (1, 1), 3, "NHWC"),
    (1, 2, 4, 6, 4, 2, 2, (1, 3), "same", (2, 1), 1, "NHWC"),
    (1, 2, 7, 5, 2, 3, 1, (3, 2), "valid", (1, 1), 2, "NCHW"),
]


def _layout_arrays(layout, x, w, dy):
    if layout == "NHWC":
        return nchw_to_nhwc(x), torch_w_to_tf(w), nchw_to_nhwc(dy)
    return x, w, dy


@pytest.mark.parametrize("case", GRAD_CASES)
def test_conv2d_backward_numerical(case):
    N, C, H, W, F, KH, KW, stride, padding, dilation, groups, layout = case
    rng = np.random.default_rng(7)
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, layout=layout)
    x = rng.standard_normal((N, C, H, W))
    w = rng.standard_normal((F, C // groups, KH, KW))
    b = rng.standard_normal(F)
    x, w, _ = _layout_arrays(layout, x, w, x)
    dy = rng.standard_normal(ref.conv2d(x, w, b, **kw).shape)
    dx, dw, db = ref.conv2d_backward(dy, x, w, **kw)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (F,)

    def loss():
        return float(np.sum(ref.conv2d(x, w, b, **kw) * dy))

    assert relative_error(dx, numerical_gradient(loss, x, h=1e-6)) < 1e-6
    assert relative_error(dw, numerical_gradient(loss, w, h=1e-6)) < 1e-6
    assert relative_error(db, numerical_gradient(loss, b, h=1e-6)) < 1e-6


@pytest.mark.parametrize("case", GRAD_CASES)
def test_conv_transpose2d_backward_numerical(case):
    N, Cout, _, _, Cin, KH, KW, stride, padding, dilation, groups, layout = case
    H, W = 3, 2
    rng = np.random.default_rng(8)
    op = (max(stride[0], dilation[0]) - 1, 0) if padding != "same" else 0
    kw = dict(stride=stride, padding=padding, output_padding=op, dilation=dilation,
              groups=groups, layout=layout)
    x = rng.standard_normal((N, Cin, H, W))
    w = rng.standard_normal((Cin, Cout // groups, KH, KW))
    b = rng.standard_normal(Cout)
    x, w, _ = _layout_arrays(layout, x, w, x)
    dy = rng.standard_normal(ref.conv_transpose2d(x, w, b, **kw).shape)
    dx, dw, db = ref.conv_transpose2d_backward(dy, x, w, **kw)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (Cout,)

    def loss():
        return float(np.sum(ref.conv_transpose2d(x, w, b, **kw) * dy))

    assert relative_error(dx, numerical_gradient(loss, x, h=1e-6)) < 1e-6
    assert relative_error(dw, numerical_gradient(loss, w, h=1e-6)) < 1e-6
    assert relative_error(db, numerical_gradient(loss, b, h=1e-6)) < 1e-6


def test_backward_against_brute_force_formulas():
    """dx of conv2d is a transposed conv of dy; dx of conv_transpose2d is a conv of dy
    (checked against the pure-Python implementations above)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 7, 6))
    w = rng.standard_normal((6, 2, 3, 2))
    stride, padding, dilation, groups = (2, 1), ((1, 2), (0, 1)), (1, 2), 2
    y = brute_conv2d(x, w, None, stride, padding, dilation, groups)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = ref.conv2d_backward(dy, x, w, stride=stride, padding=padding,
                                     dilation=dilation, groups=groups)
    op = (7 + 3 - 2 - 1 - (y.shape[2] - 1) * 2, 6 + 1 - 2 - 1 - (y.shape[3] - 1) * 1)
    expected_dx = brute_conv_transpose2d(dy, w, None, stride, padding, op, dilation, groups)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, dy.sum(axis=(0, 2, 3)), rtol=1e-12)

    dxt, _, dbt = ref.conv_transpose2d_backward(x, dy, w, stride=stride, padding=padding,
                                                output_padding=op, dilation=dilation,
                                                groups=groups)
    np.testing.assert_allclose(dxt, brute_conv2d(x, w, None, stride, padding, dilation, groups),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dbt, x.sum(axis=(0, 2, 3)), rtol=1e-12)


# --------------------------------------------------------------------------
# Shapes, padding modes, helpers
# --------------------------------------------------------------------------

@pytest.mark.parametrize("H,W,k,s,d", list(itertools.product([1, 5, 8, 9], [4, 7], [1, 2, 3, 5],
                                                               [1, 2, 3], [1, 2]))[::3])
def test_same_and_valid_output_sizes(H, W, k, s, d):
    x = np.ones((1, 2, H, W))
    w = np.ones((3, 2, k, k))
    y = ref.conv2d(x, w, stride=s, dilation=d, padding="same")
    assert y.shape == (1, 3, -(-H // s), -(-W // s))
    # transposed weights (C_in=3, C_out=2, k, k)
    yt = ref.conv_transpose2d(np.ones((1, 3, H, W)), w, stride=s, dilation=d, padding="same")
    assert yt.shape == (1, 2, H * s, W * s)
    span = d * (k - 1) + 1
    if H >= span and W >= span:
        y = ref.conv2d(x, w, stride=s, dilation=d, padding="valid")
        assert y.shape == (1, 3, (H - span) // s + 1, (W - span) // s + 1)
    yt = ref.conv_transpose2d(np.ones((1, 3, H, W)), w, stride=s, dilation=d, padding="valid")
    assert yt.shape == (1, 2, (H - 1) * s + span, (W - 1) * s + span)


def test_same_padding_values_tensorflow_rule():
    # in=5, k=3, s=2: out=3, total=(3-1)*2+3-5=2 -> (1, 1)
    # in=6, k=4, s=2: out=3, total=(3-1)*2+4-6=2 -> (1, 1)
    assert ref.resolve_padding("same", (5, 6), (3, 4), (2, 2), (1, 1)) == ((1, 1), (1, 1))
    # in=6, k=3, s=2: out=3, total=max(4+3-6, 0)=1 -> (0, 1);  in=4, k=2, s=1: total 1 -> (0, 1)
    assert ref.resolve_padding("same", (6, 4), (3, 2), (2, 1), (1, 1)) == ((0, 1), (0, 1))
    # dilation 2, k=3 -> span 5; in=7, s=1: total 4 -> (2, 2)
    assert ref.resolve_padding("SAME", (7, 7), (3, 3), (1, 1), (2, 2)) == ((2, 2), (2, 2))
    # stride larger than the kernel: total 0
    assert ref.resolve_padding("same", (9, 9), (2, 2), (3, 3), (1, 1)) == ((0, 0), (0, 0))
    # transposed: in=3, k=4, s=2 -> total = 2*2+4-6 = 2 -> (1, 1) (the seed example)
    assert ref.resolve_padding("same", (3, 3), (4, 4), (2, 2), (1, 1),
                               transposed=True) == ((1, 1), (1, 1))
    # transposed: in=3, k=3, s=2 -> total = 4+3-6 = 1 -> (0, 1)
    assert ref.resolve_padding("same", (3, 3), (3, 3), (2, 2), (1, 1),
                               transposed=True) == ((0, 1), (0, 1))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_same_padding_values_against_brute_force(layout):
    """'same' with an odd total pad puts the extra pixel at the bottom/right.
    conv2d: H=6, k=3, s=2 -> total 1 -> (0, 1); W=5, k=2, s=1 -> total 1 -> (0, 1).
    transpose: H=3, k=3, s=2 -> total 1 -> (0, 1), implicit output_padding
    6 - (4 - 1 + 2 + 1) = 0; W=4, k=2, s=1 -> total 1 -> (0, 1), output_padding
    4 - (3 - 1 + 1 + 1) = 0."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((2, 2, 6, 5))
    w = rng.standard_normal((3, 2, 3, 2))
    expected = brute_conv2d(x, w, None, (2, 1), ((0, 1), (0, 1)), (1, 1), 1)
    xt = rng.standard_normal((2, 3, 3, 4))
    expected_t = brute_conv_transpose2d(xt, w, None, (2, 1), ((0, 1), (0, 1)), (0, 0), (1, 1), 1)
    assert expected.shape == (2, 3, 3, 5) and expected_t.shape == (2, 2, 6, 4)
    if layout == "NCHW":
        got = ref.conv2d(x, w, stride=(2, 1), padding="same")
        got_t = ref.conv_transpose2d(xt, w, stride=(2, 1), padding="same")
    else:
        got = nhwc_to_nchw(ref.conv2d(nchw_to_nhwc(x), torch_w_to_tf(w), stride=(2, 1),
                                      padding="same", layout="NHWC"))
        got_t = nhwc_to_nchw(ref.conv_transpose2d(nchw_to_nhwc(xt), torch_w_to_tf(w),
                                                  stride=(2, 1), padding="same", layout="NHWC"))
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_t, expected_t, rtol=1e-12, atol=1e-12)


def test_resolve_padding_explicit_forms():
    args = ((5, 5), (3, 3), (1, 1), (1, 1))
    assert ref.resolve_padding(2, *args) == ((2, 2), (2, 2))
    assert ref.resolve_padding((1, 3), *args) == ((1, 1), (3, 3))
    assert ref.resolve_padding(((0, 1), (2, 3)), *args) == ((0, 1), (2, 3))
    assert ref.resolve_padding("valid", *args) == ((0, 0), (0, 0))
    for bad in ("full", -1, (1, -1), ((0, 1), (2, -3)), (1, 2, 3)):
        with pytest.raises(ValueError):
            ref.resolve_padding(bad, *args)


def test_output_size_helpers():
    assert ref.conv2d_output_size(7, 3, 2, 1, 1, 1) == 4
    assert ref.conv2d_output_size(7, 3, 1, 0, 0, 2) == 3
    assert ref.conv2d_output_size(12, 7, 1, 3, 3, 1) == 12
    assert ref.conv2d_output_size(5, 2, 2, 0, 1, 1) == 3
    assert ref.conv_transpose2d_output_size(3, 4, 2, 1, 1, 1, 0) == 6
    assert ref.conv_transpose2d_output_size(4, 3, 2, 1, 1, 1, 1) == 8
    assert ref.conv_transpose2d_output_size(2, 3, 1, 0, 0, 2, 0) == 6


# --------------------------------------------------------------------------
# Errors, dtypes, purity
# --------------------------------------------------------------------------

def test_errors():
    x = np.ones((1, 4, 5, 5))
    with pytest.raises(ValueError):
        ref.conv2d(x, np.ones((2, 3, 3, 3)))  # channel mismatch
    with pytest.raises(ValueError):
        ref.conv2d(x, np.ones((3, 2, 3, 3)), groups=2)  # F not divisible by groups
    with pytest.raises(ValueError):
        ref.conv2d(x, np.ones((2, 4, 7, 7)))  # output size 0
    with pytest.raises(ValueError):
        ref.conv2d(x, np.ones((2, 4, 3, 3)), np.ones(3))  # bias length
    with pytest.raises(ValueError):
        ref.conv2d(x, np.ones((2, 4, 3, 3)), layout="CHWN")
    with pytest.raises(ValueError):
        ref.conv2d(x, np.ones((2, 4, 3, 3)), stride=0)
    with pytest.raises(ValueError):
        ref.conv2d_backward(np.ones((1, 2, 2, 2)), x, np.ones((2, 4, 3, 3)))  # dy shape
    w_t = np.ones((4, 2, 3, 3))
    with pytest.raises(ValueError):
        ref.conv_transpose2d(x, w_t, stride=2, output_padding=2)  # op >= max(s, d)
    with pytest.raises(ValueError):
        ref.conv_transpose2d(x, w_t, stride=1, output_padding=1)
    with pytest.raises(ValueError):
        ref.conv_transpose2d(x, w_t, stride=2, padding="same", output_padding=1)
    with pytest.raises(ValueError):
        ref.conv_transpose2d(x, np.ones((3, 2, 3, 3)))  # C_in mismatch
    with pytest.raises(ValueError):
        ref.conv_transpose2d(x, w_t, groups=3)
    with pytest.raises(ValueError):
        ref.conv_transpose2d(np.ones((1, 4, 1, 1)), w_t, padding=2)  # output size <= 0
    # legal: output_padding < dilation when stride is 1
    assert ref.conv_transpose2d(x, w_t, dilation=2, output_padding=1).shape == (1, 2, 10, 10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_dtypes_and_inputs_untouched(dtype, layout):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 6, 6)).astype(dtype)
    w = rng.standard_normal((4, 2, 3, 3)).astype(dtype)
    b = rng.standard_normal(4).astype(dtype)
    if layout == "NHWC":
        x, w = nchw_to_nhwc(x), torch_w_to_tf(w)
    copies = [a.copy() for a in (x, w, b)]
    kw = dict(stride=2, padding=1, groups=2, layout=layout)
    y = ref.conv2d(x, w, b, **kw)
    assert y.dtype == dtype
    grads = ref.conv2d_backward(y, x, w, **kw)
    assert all(g.dtype == dtype for g in grads)
    yt = ref.conv_transpose2d(x, w, b, output_padding=1, **kw)
    assert yt.dtype == dtype
    grads = ref.conv_transpose2d_backward(yt, x, w, output_padding=1, **kw)
    assert all(g.dtype == dtype for g in grads)
    for a, c in zip((x, w, b), copies):
        np.testing.assert_array_equal(a, c)
    # float32 results agree with a float64 computation to float32 precision
    y64 = ref.conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), **kw)
    np.testing.assert_allclose(y, y64, rtol=1e-5, atol=1e-5)


def test_working_memory_stays_near_the_arrays():
    """The reference loops over output (or input) positions and contracts batch and channels there:
    its working memory is a few copies of the padded arrays, never an im2col matrix of every
    position's receptive field, which at this size would be 2 × 8·7·7 × 32·32 float64s (6.4 MB)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 8, 32, 32))
    w = rng.standard_normal((8, 8, 7, 7))
    im2col_bytes = 2 * 8 * 7 * 7 * 32 * 32 * 8
    for name, run in (("conv2d", lambda: ref.conv2d(x, w, padding=3)),
                      ("conv2d_backward", lambda: ref.conv2d_backward(x, x, w, padding=3)),
                      ("conv_transpose2d", lambda: ref.conv_transpose2d(x, w, padding=3)),
                      ("conv_transpose2d_backward", lambda: ref.conv_transpose2d_backward(x, x, w, padding=3))):
        tracemalloc.start()
        try:
            result = run()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert (result[0] if isinstance(result, tuple) else result).shape == x.shape
        assert peak < im2col_bytes / 4, f"{name}: {peak} bytes at the peak, an im2col matrix is {im2col_bytes}"


# --------------------------------------------------------------------------
# Cross-check against PyTorch (torch is part of the test extra)
# --------------------------------------------------------------------------

def test_against_torch():
    try:
        import torch
    except ImportError:  # never a silent skip: this is the one outside check of the oracle
        pytest.fail("torch is not installed: it is part of the test extra (make setup, or "
                    "pip install 'torch==2.13.0+cpu' then pip install -e '.[test]')")
    F = torch.nn.functional
    rng = np.random.default_rng(11)
    cases = [
        # (N, C, H, W, Fo, K, stride, padding, dilation, groups, output_padding)
        (2, 4, 7, 6, 6, 3, (2, 1), (1, 0), (1, 2), 2, (1, 0)),
        (1, 3, 5, 5, 3, 2, 1, 0, 1, 3, 0),
        (2, 2, 6, 8, 4, 4, 2, 1, 1, 1, 1),
        (1, 6, 9, 7, 3, 3, 3, 2, 2, 3, (2, 1)),
    ]
    for N, C, H, W, Fo, K, stride, padding, dilation, groups, op in cases:
        x = rng.standard_normal((N, C, H, W))
        w = rng.standard_normal((Fo, C // groups, K, K))
        b = rng.standard_normal(Fo)
        kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        tx = torch.tensor(x, requires_grad=True)
        tw = torch.tensor(w, requires_grad=True)
        tb = torch.tensor(b, requires_grad=True)
        ty = F.conv2d(tx, tw, tb, **kw)
        y = ref.conv2d(x, w, b, **kw)
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
        dy = rng.standard_normal(y.shape)
        ty.backward(torch.tensor(dy))
        for got, want in zip(ref.conv2d_backward(dy, x, w, **kw), (tx.grad, tw.grad, tb.grad)):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-10)

        # transposed: input channels Fo... use w as (C_in=Fo, C_out/g=C/g)
        xt = rng.standard_normal((N, Fo, 4, 3))
        bt = rng.standard_normal(C)
        txt = torch.tensor(xt, requires_grad=True)
        tw = torch.tensor(w, requires_grad=True)
        tbt = torch.tensor(bt, requires_grad=True)
        tyt = F.conv_transpose2d(txt, tw, tbt, output_padding=op, **kw)
        yt = ref.conv_transpose2d(xt, w, bt, output_padding=op, **kw)
        np.testing.assert_allclose(yt, tyt.detach().numpy(), rtol=1e-10, atol=1e-10)
        dyt = rng.standard_normal(yt.shape)
        tyt.backward(torch.tensor(dyt))
        got = ref.conv_transpose2d_backward(dyt, xt, w, output_padding=op, **kw)
        for g, want in zip(got, (txt.grad, tw.grad, tbt.grad)):
            np.testing.assert_allclose(g, want.numpy(), rtol=1e-10, atol=1e-10)
