"""The NumPy baselines the benchmark times must compute the same thing as convgen.reference.

A benchmark that times a wrong baseline compares nothing; these cases cover the shapes of the
suite in miniature (kernel 1, 3, 4, 5, 7; stride 1 and 2; padding 0 to 3; non-square images), the
depthwise baseline on the same windows.
"""

import numpy as np
import pytest

from convgen.tools import baselines
from convgen import reference
from helpers import assert_close

# (N, C, H, W, F, K, S, P)
CASES = [
    (2, 3, 9, 7, 4, 3, 1, 1),
    (2, 4, 10, 11, 5, 3, 2, 1),
    (1, 3, 15, 14, 2, 7, 2, 3),
    (2, 5, 6, 6, 3, 1, 1, 0),
    (3, 1, 8, 9, 2, 5, 1, 2),
    (2, 4, 7, 8, 3, 4, 2, 1),
    (1, 2, 9, 9, 3, 3, 2, 0),
]


def _ids(case):
    n, c, h, w, f, k, s, p = case
    return f"x{n}x{c}x{h}x{w}-f{f}-k{k}s{s}p{p}"


@pytest.fixture(params=CASES, ids=_ids)
def case(request):
    n, c, h, w, f, k, s, p = request.param
    rng = np.random.default_rng(sum(request.param))
    x = rng.standard_normal((n, c, h, w))
    weight = rng.standard_normal((f, c, k, k))
    return x, weight, (s, s), (p, p)


def test_forward_matches_reference(case):
    x, w, stride, padding = case
    assert_close(baselines.numpy_conv2d(x, w, stride, padding),
                 reference.conv2d(x, w, stride=stride, padding=padding), np.float64, "y")


def test_backward_matches_reference(case):
    x, w, stride, padding = case
    dy = np.random.default_rng(1).standard_normal(reference.conv2d(x, w, stride=stride, padding=padding).shape)
    got = baselines.numpy_conv2d_backward(dy, x, w, stride, padding)
    expected = reference.conv2d_backward(dy, x, w, stride=stride, padding=padding)
    for name, a, b in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, b, np.float64, name)


def test_transposed_matches_reference(case):
    # The case's conv2d weight (F, C, K, K) read as a transposed weight (C_in=F, C_out=C, K, K),
    # applied to an input shaped like that conv2d's output: the shapes of the adjoint.
    x, w, stride, padding = case
    y_shape = reference.conv2d(x, w, stride=stride, padding=padding).shape
    rng = np.random.default_rng(2)
    t = rng.standard_normal(y_shape)
    expected = reference.conv_transpose2d(t, w, stride=stride, padding=padding)
    assert_close(baselines.numpy_conv_transpose2d(t, w, stride, padding), expected, np.float64, "y")

    dy = rng.standard_normal(expected.shape)
    got = baselines.numpy_conv_transpose2d_backward(dy, t, w, stride, padding)
    want = reference.conv_transpose2d_backward(dy, t, w, stride=stride, padding=padding)
    for name, a, b in zip(("dx", "dw", "db"), got, want):
        assert_close(a, b, np.float64, name)


def test_depthwise_matches_reference(case):
    """The depthwise baseline of the bench's depthwise rows: the case's C channels, one filter each."""
    x, w, stride, padding = case
    c = x.shape[1]
    w = np.random.default_rng(3).standard_normal((c, 1, *w.shape[2:]))
    kw = dict(stride=stride, padding=padding, groups=c)
    expected = reference.conv2d(x, w, **kw)
    assert_close(baselines.numpy_depthwise_conv2d(x, w, stride, padding), expected, np.float64, "y")
    dy = np.random.default_rng(4).standard_normal(expected.shape)
    got = baselines.numpy_depthwise_conv2d_backward(dy, x, w, stride, padding)
    for name, a, b in zip(("dx", "dw", "db"), got, reference.conv2d_backward(dy, x, w, **kw)):
        assert_close(a, b, np.float64, name)
