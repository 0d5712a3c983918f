"""Shared test helpers: random arrays in either layout and tolerance checks against the reference."""

import numpy as np

TOLERANCE = {np.float64: 1e-10, np.float32: 1e-4}


def to_layout(x_nchw, w_oihw, layout, transposed=False):
    """Arrays made in NCHW / PyTorch weight order, moved to `layout`'s conventions."""
    if layout == "NCHW":
        return np.ascontiguousarray(x_nchw), np.ascontiguousarray(w_oihw)
    # NHWC: images (N, H, W, C); conv2d weights (KH, KW, C/g, F); transposed weights (KH, KW, C_out/g, C_in).
    return (np.ascontiguousarray(x_nchw.transpose(0, 2, 3, 1)), np.ascontiguousarray(w_oihw.transpose(2, 3, 1, 0)))


def assert_close(actual, expected, dtype, what=""):
    """Relative agreement, scaled by the largest expected magnitude (so near-zero entries are not over-weighted)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == np.dtype(dtype), f"{what}: dtype {actual.dtype} != {np.dtype(dtype)}"
    scale = max(float(np.abs(expected).max()), 1e-30) if expected.size else 1.0
    err = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()) / scale if expected.size else 0.0
    assert err <= TOLERANCE[np.dtype(dtype).type], f"{what}: relative error {err:.3g}"


def random_case(rng, n, c, h, w, f, cg, kh, kw, dtype):
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    weight = rng.standard_normal((f, cg, kh, kw)).astype(dtype)
    bias = rng.standard_normal(f).astype(dtype)
    return x, weight, bias


def numerical_gradient(loss, array, h):
    """Central differences of the scalar loss() with respect to each element of `array` (perturbed in place)."""
    grad = np.zeros_like(array)
    flat, flat_grad = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + h
        up = loss()
        flat[i] = saved - h
        down = loss()
        flat[i] = saved
        flat_grad[i] = (up - down) / (2 * h)
    return grad


def relative_error(a, b):
    """Largest absolute difference, relative to the larger of the two arrays' magnitudes."""
    scale = max(float(np.abs(a).max()), float(np.abs(b).max()), 1e-30)
    return float(np.abs(a - b).max()) / scale
