"""convgen.compat.cs231n against CS231n's naive convolution layers.

The oracle is the naive layer pair as the assignment's notes write it (shared/seeds: "Implementing a
Convolution Layer"): a loop over output positions, each a dot product of a padded crop with the
stretched filters; the backward loop scatters each position's gradient back into a padded dx.
"""

import numpy as np
import pytest

from convgen.compat.cs231n import conv_backward_fast, conv_forward_fast
from helpers import seeded_rng


def conv_forward_naive(x, w, b, conv_param):
    N, C, H, W = x.shape
    F, C, HH, WW = w.shape
    stride = conv_param['stride']
    pad = conv_param['pad']
    npad = ((0, 0), (0, 0), (pad, pad), (pad, pad))
    filter_size = C * HH * WW
    H_out = int(1 + (H + 2 * pad - HH) / stride)
    W_out = int(1 + (W + 2 * pad - WW) / stride)
    out = np.zeros((N, F, H_out, W_out))
    x_pad = np.pad(x, npad, 'constant', constant_values=(0))
    for height in range(H_out):
        for width in range(W_out):
            x_crop = x_pad[np.arange(N), :, height * stride:height * stride + HH, width * stride:width * stride + WW]
            x_crop_stretch = x_crop.reshape(N, filter_size)
            w_stretch = w.reshape(F, filter_size)
            spatial_out = np.dot(x_crop_stretch, w_stretch.T) + b.reshape((1, F))
            out[np.arange(N), :, height, width] = spatial_out
    cache = (x, w, b, conv_param)
    return out, cache


def conv_backward_naive(dout, cache):
    x, w, b, conv_param = cache
    N, C, H, W = x.shape
    F, C, HH, WW = w.shape
    N, F, H_out, W_out = dout.shape
    stride = conv_param['stride']
    pad = conv_param['pad']
    npad = ((0, 0), (0, 0), (pad, pad), (pad, pad))
    filter_size = C * HH * WW
    x_pad = np.pad(x, npad, 'constant', constant_values=(0))
    dx_pad = np.zeros((N, C, H + 2 * pad, W + 2 * pad))
    dw = np.zeros((F, C, HH, WW))
    db = np.zeros(F)
    for height in range(H_out):
        for width in range(W_out):
            dspatial_out = dout[np.arange(N), :, height, width]
            db += np.sum(dspatial_out, axis=0)
            x_tmp = x_pad[np.arange(N), :, height * stride:height * stride + HH, width * stride:width * stride + WW]
            dw_stretch = np.dot(dspatial_out.T, x_tmp.reshape(N, filter_size))
            dw += dw_stretch.reshape(F, C, HH, WW)
            w_stretch = w.reshape(F, filter_size)
            dx_tmp_stretch = np.dot(dspatial_out, w_stretch)
            dx_tmp = dx_tmp_stretch.reshape(N, C, HH, WW)
            dx_pad[np.arange(N), :, height * stride:height * stride + HH, width * stride:width * stride + WW] += dx_tmp
    dx = dx_pad[np.arange(N), :, pad:H + pad, pad:W + pad]
    return dx, dw, db


# (N, C, H, W, F, kernel, stride, pad): the windows are in the test grid's prebuilt set.
SHAPES = [
    (2, 3, 4, 4, 3, 4, 2, 1),     # the assignment's own check: x (2, 3, 4, 4), w (3, 3, 4, 4), stride 2, pad 1
    (4, 3, 8, 8, 5, 3, 1, 1),
    (2, 4, 9, 7, 6, 3, 2, 1),     # odd sizes
    (1, 2, 11, 10, 4, 4, 3, 0),   # (H − HH) not a multiple of the stride: the last rows are never reached
    (3, 5, 8, 9, 2, 5, 2, 3),     # padding wider than half the window
    (2, 6, 5, 6, 7, 1, 2, 1),     # 1x1 at stride 2 in padding: border outputs are the bias alone
    (1, 1, 7, 7, 1, 7, 1, 0),     # one output pixel
]


def _arrays(shape, dtype=np.float64):
    n, c, h, w, f, k, stride, pad = shape
    rng = seeded_rng("cs231n", shape)
    x, w_, b = rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c, k, k)), rng.standard_normal(f)
    return x.astype(dtype), w_.astype(dtype), b.astype(dtype), {"stride": stride, "pad": pad}


def _relative(a, b):
    return float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-30)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fast_layers_match_the_naive_ones(shape):
    x, w, b, conv_param = _arrays(shape)
    out, cache = conv_forward_fast(x, w, b, conv_param)
    out_naive, _ = conv_forward_naive(x, w, b, conv_param)
    assert out.shape == out_naive.shape and out.dtype == np.float64 and _relative(out, out_naive) < 1e-12
    assert cache[0] is x and cache[1] is w and cache[2] is b and cache[3] is conv_param

    dout = seeded_rng("dout", shape).standard_normal(out.shape)
    grads = conv_backward_fast(dout, cache)
    for name, got, want in zip(("dx", "dw", "db"), grads, conv_backward_naive(dout, cache)):
        assert got.shape == want.shape and got.dtype == np.float64, name
        assert _relative(got, want) < 1e-12, name


def test_dtypes_follow_the_inputs():
    x, w, b, conv_param = _arrays(SHAPES[1], np.float32)
    out, cache = conv_forward_fast(x, w, b, conv_param)
    want, _ = conv_forward_naive(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), conv_param)
    assert out.dtype == np.float32 and _relative(out, want) < 1e-5
    dx, dw, db = conv_backward_fast(np.ones_like(out), cache)
    assert dx.dtype == dw.dtype == db.dtype == np.float32
    out64, _ = conv_forward_fast(x, w.astype(np.float64), b, conv_param)  # mixed: computed in float64
    assert out64.dtype == np.float64 and _relative(out64, want) < 1e-6


def test_bad_conv_param_is_refused_by_name():
    x, w, b, _ = _arrays(SHAPES[0])
    with pytest.raises(ValueError, match="conv_param must have the keys 'stride' and 'pad'; 'pad' missing"):
        conv_forward_fast(x, w, b, {"stride": 1})
    with pytest.raises(TypeError, match="conv_param must be a dict with 'stride' and 'pad', got tuple"):
        conv_forward_fast(x, w, b, (1, 1))
    with pytest.raises(ValueError, match=r"conv_param\['stride'\] must be >= 1, got 0"):
        conv_forward_fast(x, w, b, {"stride": 0, "pad": 1})
    with pytest.raises(TypeError, match="cache must be the"):
        conv_backward_fast(np.ones((2, 3, 2, 2)), (x, w))
