"""What convgen is compared against: plain NumPy (im2col by as_strided, then one matmul on the
installed BLAS) and, when installed, PyTorch's CPU convolution. Used by `convgen compare` and bench/.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def numpy_conv2d(x, w, stride=(1, 1), padding=(0, 0)):
    """NCHW forward convolution: a strided im2col view copied out, then one matmul."""
    sh, sw = stride
    ph, pw = padding
    n, c, h, width = x.shape
    f, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x
    ho, wo = (h + 2 * ph - kh) // sh + 1, (width + 2 * pw - kw) // sw + 1
    s = xp.strides
    cols = as_strided(xp, (n, ho, wo, c, kh, kw), (s[0], s[2] * sh, s[3] * sw, s[1], s[2], s[3]))
    cols = np.ascontiguousarray(cols).reshape(n * ho * wo, c * kh * kw)
    y = cols @ w.reshape(f, -1).T
    return np.ascontiguousarray(y.reshape(n, ho, wo, f).transpose(0, 3, 1, 2))


def torch_module():
    """PyTorch if it is installed, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch
