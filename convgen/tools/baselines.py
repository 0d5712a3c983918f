"""What convgen is compared against: plain NumPy (im2col by as_strided, then matmuls on the
installed BLAS) and, when installed, PyTorch's CPU convolution. Used by `convgen compare` and bench/.

The NumPy baselines cover what the benchmark suite needs: NCHW, symmetric padding, no dilation,
one group, and (the depthwise rows) groups == channels with one filter each. Every gradient is a matmul against the same im2col matrix as the forward; the input
gradient scatters its columns back with col2im, one window tap at a time.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def _im2col(x, kernel, stride, padding):
    """The (N·Ho·Wo, C·KH·KW) matrix of receptive fields of NCHW `x`, and (Ho, Wo)."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    n, c, h, width = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x
    ho, wo = (h + 2 * ph - kh) // sh + 1, (width + 2 * pw - kw) // sw + 1
    s = xp.strides
    cols = as_strided(xp, (n, ho, wo, c, kh, kw), (s[0], s[2] * sh, s[3] * sw, s[1], s[2], s[3]))
    return np.ascontiguousarray(cols).reshape(n * ho * wo, c * kh * kw), (ho, wo)


def _col2im(cols, image_shape, kernel, stride, padding, out_hw):
    """The adjoint of _im2col: scatter-add (N·Ho·Wo, C·KH·KW) columns into an NCHW image."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    n, c, h, width = image_shape
    ho, wo = out_hw
    taps = cols.reshape(n, ho, wo, c, kh, kw)
    # The canvas holds every position a window reaches, padding included; it is cropped at the end.
    canvas = np.zeros((n, c, max(h + 2 * ph, (ho - 1) * sh + kh), max(width + 2 * pw, (wo - 1) * sw + kw)),
                      dtype=cols.dtype)
    for i in range(kh):
        for j in range(kw):
            canvas[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw] += taps[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    return np.ascontiguousarray(canvas[:, :, ph:ph + h, pw:pw + width])


def _pixels_by_channel(a):
    """NCHW `a` as an (N·H·W, C) matrix: the layout the im2col rows are in."""
    return a.transpose(0, 2, 3, 1).reshape(-1, a.shape[1])


def numpy_conv2d(x, w, stride=(1, 1), padding=(0, 0)):
    """NCHW forward convolution: a strided im2col view copied out, then one matmul."""
    n, f = x.shape[0], w.shape[0]
    cols, (ho, wo) = _im2col(x, w.shape[2:], stride, padding)
    y = cols @ w.reshape(f, -1).T
    return np.ascontiguousarray(y.reshape(n, ho, wo, f).transpose(0, 3, 1, 2))


def numpy_conv2d_backward(dy, x, w, stride=(1, 1), padding=(0, 0)):
    """(dx, dw, db) of numpy_conv2d: dW = dYᵀ·im2col(X), dX = col2im(dY·W), db = Σ dY."""
    f = w.shape[0]
    cols, out_hw = _im2col(x, w.shape[2:], stride, padding)
    dy_rows = _pixels_by_channel(dy)
    dw = (dy_rows.T @ cols).reshape(w.shape)
    dx = _col2im(dy_rows @ w.reshape(f, -1), x.shape, w.shape[2:], stride, padding, out_hw)
    return dx, dw, dy.sum(axis=(0, 2, 3))


def numpy_conv_transpose2d(x, w, stride=(1, 1), padding=(0, 0)):
    """NCHW transposed convolution, w (C_in, C_out, KH, KW): col2im of one matmul X·W (no zero-stuffing).

    No output_padding: the output is ((H − 1)·sh − 2·ph + KH, (W − 1)·sw − 2·pw + KW).
    """
    n, c_in, h, width = x.shape
    c_out, (kh, kw) = w.shape[1], w.shape[2:]
    (sh, sw), (ph, pw) = stride, padding
    out_shape = (n, c_out, (h - 1) * sh - 2 * ph + kh, (width - 1) * sw - 2 * pw + kw)
    cols = _pixels_by_channel(x) @ w.reshape(c_in, -1)
    return _col2im(cols, out_shape, (kh, kw), stride, padding, (h, width))


def numpy_conv_transpose2d_backward(dy, x, w, stride=(1, 1), padding=(0, 0)):
    """(dx, dw, db) of numpy_conv_transpose2d: dX = conv2d(dY, W), dW = Xᵀ·im2col(dY), db = Σ dY."""
    dx = numpy_conv2d(dy, w, stride, padding)
    cols, _ = _im2col(dy, w.shape[2:], stride, padding)
    dw = (_pixels_by_channel(x).T @ cols).reshape(w.shape)
    return dx, dw, dy.sum(axis=(0, 2, 3))


def _tap_views(xp, kernel, stride, out_hw):
    """Each tap (i, j) of a padded NCHW batch as the strided view of the inputs it meets, (N, C, Ho, Wo)."""
    (kh, kw), (sh, sw), (ho, wo) = kernel, stride, out_hw
    for i in range(kh):
        for j in range(kw):
            yield i, j, xp[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]


def numpy_depthwise_conv2d(x, w, stride=(1, 1), padding=(0, 0)):
    """NCHW depthwise convolution (groups == channels, w (C, 1, KH, KW)): one multiply-add of a strided
    view of the padded input per tap."""
    (kh, kw), (sh, sw), (ph, pw) = w.shape[2:], stride, padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    ho, wo = (xp.shape[2] - kh) // sh + 1, (xp.shape[3] - kw) // sw + 1
    y = np.zeros((x.shape[0], x.shape[1], ho, wo), dtype=x.dtype)
    for i, j, view in _tap_views(xp, (kh, kw), stride, (ho, wo)):
        y += view * w[None, :, 0, i, j, None, None]
    return y


def numpy_depthwise_conv2d_backward(dy, x, w, stride=(1, 1), padding=(0, 0)):
    """(dx, dw, db) of numpy_depthwise_conv2d, tap by tap: dW[c, i, j] = Σ dY · view, view += dY · W."""
    (kh, kw), (ph, pw) = w.shape[2:], padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    dxp = np.zeros_like(xp)
    dw = np.empty_like(w)
    for (i, j, view), (_, _, dview) in zip(_tap_views(xp, (kh, kw), stride, dy.shape[2:]),
                                           _tap_views(dxp, (kh, kw), stride, dy.shape[2:])):
        dw[:, 0, i, j] = np.einsum("nchw,nchw->c", dy, view)
        dview += dy * w[None, :, 0, i, j, None, None]
    return np.ascontiguousarray(dxp[:, :, ph:ph + x.shape[2], pw:pw + x.shape[3]]), dw, dy.sum(axis=(0, 2, 3))


def torch_module():
    """PyTorch if it is installed, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch
