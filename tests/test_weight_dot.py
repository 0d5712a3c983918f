"""The NCHW weight gradient of layers with few filters per group (dot products along the pixels):
dy read in place or copied, a last block of fewer columns, the vector sums taken in parts of the
columns and split between threads, and NaN/inf in x reaching exactly the gradients they reach in
the reference. Generic builds: the module every other NCHW test builds too."""

import numpy as np
import pytest

import convgen
from convgen import reference
from helpers import assert_close, seeded_rng

# (n, c, h, w, f, groups, keywords); every case has few filters for its pixels, the dot products' case.
CASES = {
    # 8 x 8 pixels, whole vectors in both dtypes: dy read in place; 45 columns, a last block of fewer.
    "in place": (3, 5, 8, 8, 4, 1, dict(padding=1)),
    # 9 x 7 pixels: dy copied into rows padded with zeros; two groups, stride 2.
    "copied": (2, 6, 17, 13, 6, 2, dict(stride=2, padding=1)),
    # 2160 columns: their vector sums do not fit one buffer, so they come in parts, which the threads
    # split with the pixels (one thread's items end inside a part).
    "parts": (3, 240, 12, 12, 8, 1, dict(padding=1)),
}


def _case(name, dtype):
    n, c, h, w, f, groups, kwargs = CASES[name]
    rng = seeded_rng("weight dot", name, dtype)
    x = rng.standard_normal((n, c, h, w))
    weight = rng.standard_normal((f, c // groups, 3, 3))
    kwargs = dict(kwargs, groups=groups)
    dy = rng.standard_normal(reference.conv2d(x, weight, **kwargs).shape)
    return x.astype(dtype), weight.astype(dtype), dy.astype(dtype), kwargs


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_weight_gradient_matches_the_reference_on_any_thread_count(name, dtype, threads):
    x, weight, dy, kwargs = _case(name, dtype)
    _, expected, _ = reference.conv2d_backward(dy, x, weight, **kwargs)
    for count in (1, 2, 3):
        threads(count)
        _, dw, _ = convgen.conv2d_backward(dy, x, weight, specialize=False, algorithm="direct", **kwargs)
        assert_close(dw, expected, dtype, f"{name} on {count} threads")


@pytest.mark.parametrize("name", ["in place", "copied"])
def test_nan_and_inf_in_x_reach_the_gradients_the_reference_reaches(name):
    """The columns copied a vector at a time carry nothing past their pixels: an inf next to a run
    of x is never multiplied by a zero of dy (0 * inf would be NaN where the reference is finite)."""
    x, weight, dy, kwargs = _case(name, np.float64)
    h, w = x.shape[2:]
    # At the edges of channel 0, where a run of a column ends next to them: the other channels stay finite.
    x[0, 0, 3, w - 1], x[1, 0, h - 1, 0], x[-1, 0, 0, w - 1] = np.inf, np.nan, -np.inf
    with np.errstate(invalid="ignore"):
        _, expected, _ = reference.conv2d_backward(dy, x, weight, **kwargs)
        _, dw, _ = convgen.conv2d_backward(dy, x, weight, specialize=False, algorithm="direct", **kwargs)
    assert np.isnan(expected).any() and np.isfinite(expected).any(), "the poison must reach some gradients, not all"
    np.testing.assert_array_equal(np.isnan(dw), np.isnan(expected))
    np.testing.assert_array_equal(np.isposinf(dw), np.isposinf(expected))
    np.testing.assert_array_equal(np.isneginf(dw), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(dw[finite], expected[finite], rtol=1e-10, atol=1e-10)
