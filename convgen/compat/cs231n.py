"""CS231n's fast convolution layers (assignment 2, `cs231n/fast_layers.py`), computed by convgen.

`conv_forward_fast(x, w, b, conv_param)` and `conv_backward_fast(dout, cache)` take and return what
the assignment's naive layers (`conv_forward_naive`, `conv_backward_naive`) do:

- x: (N, C, H, W) images; w: (F, C, HH, WW) filters; b: (F,) biases;
- conv_param: a dict with 'stride' and 'pad' (zero padding on all four sides);
- out: (N, F, H', W') with H' = 1 + (H + 2·pad − HH) // stride (rows the stride does not reach are
  left out, as the naive loop does), cache = (x, w, b, conv_param);
- conv_backward_fast returns (dx, dw, db), shaped as x, w and b.

So `from convgen.compat.cs231n import conv_forward_fast, conv_backward_fast` replaces the
assignment's Cython-backed import. The arrays are computed in their common float dtype: float32
when every one is float32, float64 otherwise (the naive layers compute in float64).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..frontend import ops
from ..planning.spec import as_int


def _params(conv_param) -> tuple[int, int]:
    """(stride, pad) of a conv_param dict, checked."""
    if not isinstance(conv_param, Mapping):
        raise TypeError(f"conv_param must be a dict with 'stride' and 'pad', got {type(conv_param).__name__}")
    missing = [key for key in ("stride", "pad") if key not in conv_param]
    if missing:
        raise ValueError(f"conv_param must have the keys 'stride' and 'pad'; {' and '.join(map(repr, missing))} "
                         f"missing from {dict(conv_param)!r}")
    return as_int("conv_param['stride']", conv_param["stride"]), as_int("conv_param['pad']", conv_param["pad"], 0)


def _common(*arrays) -> list[np.ndarray]:
    """The arrays in one float dtype: float32 if all are, else float64 (no copy when already so)."""
    arrays = [np.asarray(a) for a in arrays]
    dtype = np.float32 if all(a.dtype == np.float32 for a in arrays) else np.float64
    return [a.astype(dtype, copy=False) for a in arrays]


def conv_forward_fast(x, w, b, conv_param):
    """Forward pass of a convolutional layer: (out, cache), as CS231n's conv_forward_naive."""
    stride, pad = _params(conv_param)
    x_, w_, b_ = _common(x, w, b)
    out = ops.conv2d(x_, w_, b_, stride=stride, padding=pad)
    return out, (x, w, b, conv_param)


def conv_backward_fast(dout, cache):
    """Backward pass of a convolutional layer: (dx, dw, db), as CS231n's conv_backward_naive."""
    if not isinstance(cache, tuple) or len(cache) != 4:
        raise TypeError("cache must be the (x, w, b, conv_param) tuple that conv_forward_fast returned")
    x, w, b, conv_param = cache
    stride, pad = _params(conv_param)
    dout_, x_, w_, b_ = _common(dout, x, w, b)
    dx, dw, db = ops.conv2d_backward(dout_, x_, w_, stride=stride, padding=pad)
    return dx, dw, db


__all__ = ["conv_forward_fast", "conv_backward_fast"]
