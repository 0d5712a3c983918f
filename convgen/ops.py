"""The public convolution ops: the only module that touches NumPy arrays.

Each op checks its arrays, works out the convolution's sizes, allocates (or checks) the output and
calls the compiled kernel, which trusts what it is given. Transposed convolution is conv2d's input
gradient (col2im of Wᵀ·x) and its gradients are conv2d's forward and weight gradient, so four ops
share three kernels.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

from .kernels import get_kernels, num_threads
from .spec import ConvSpec, Window, as_pair, explicit_padding

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_MAX_ELEMENTS = 2 ** 62  # any array or index the kernels form stays below this (int64 arithmetic)
_FORWARD, _BACKWARD_DATA, _BACKWARD_WEIGHT = 0, 1, 2  # op numbers of the kernels' workspace query
_SPATIAL_AXES = {"NCHW": (0, 2, 3), "NHWC": (0, 1, 2)}  # batch and space: what the bias gradient sums


class _Call:
    """The sizes of one convolution as the kernels see them (the forward direction, x → y)."""

    __slots__ = ("kernels", "spec", "window", "n", "c", "h", "w", "f", "ho", "wo", "groups", "args")

    def __init__(self, spec: ConvSpec, window: Window, n, c, h, w, f, ho, wo, groups):
        self.spec, self.window = spec, window
        self.n, self.c, self.h, self.w, self.f, self.ho, self.wo, self.groups = n, c, h, w, f, ho, wo, groups
        for name, count in (("input", n * c * h * w), ("output", n * f * ho * wo)):
            if count >= _MAX_ELEMENTS:
                raise ValueError(f"the {name} would have {count} elements, more than convgen's 64-bit indexing allows")
        self.kernels = get_kernels(spec)
        self.args = (n, c, h, w, f, ho, wo, groups)
        if not spec.specialized:
            (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
            self.args += (kh, kw, sh, sw, window.padding[0][0], window.padding[1][0], dh, dw)
        self.args += (num_threads(),)

    def ptr(self, array):
        return self.kernels.ffi.from_buffer(self.kernels.c_type + "[]", array, require_writable=False)

    def run(self, entry, *arrays):
        status = entry(*[self.ptr(a) if a is not None else self.kernels.ffi.NULL for a in arrays], *self.args)
        if status != 0:
            raise MemoryError(f"convgen kernel {self.spec} could not allocate its workspace")

    def workspace_bytes(self, op: int) -> int:
        return int(self.kernels.workspace(op, *self.args))


# ---------------------------------------------------------------------------------------- arrays
def _dtype_of(name, value):
    """The dtype an argument brings (None for plain Python sequences and numbers)."""
    if isinstance(value, np.ndarray):
        return value.dtype
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be an array of float32 or float64, got {type(value).__name__}")
    if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        return np.asarray(value).dtype
    return None


def _common_dtype(**arrays) -> np.dtype:
    """The one floating dtype shared by the given arrays (lists adopt it; alone they are float64)."""
    found = {}
    for name, value in arrays.items():
        if value is None and name in ("bias",):
            continue
        dtype = _dtype_of(name, value)
        if dtype is None:
            continue
        if dtype.kind != "f" or dtype.itemsize not in (4, 8):
            raise TypeError(f"{name} must have dtype float32 or float64, got {dtype}")
        found[name] = dtype.newbyteorder("=")
    kinds = set(found.values())
    if len(kinds) > 1:
        detail = ", ".join(f"{n} is {d}" for n, d in found.items())
        raise TypeError(f"{', '.join(found)} must share one dtype (float32 or float64); got {detail}")
    return kinds.pop() if kinds else np.dtype(np.float64)


def _as_c_array(name, value, dtype, ndim):
    """A C-contiguous native-order array of `dtype` with `ndim` dimensions (a copy only if needed)."""
    if value is None:
        raise TypeError(f"{name} must be an array, got None")
    try:
        array = np.ascontiguousarray(value, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of floats: {exc}") from None
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    return array


def _checked_out(name, out, shape, dtype, inputs):
    """Validate a caller's output array, or allocate a new one."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, got {out.shape} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name} must be a writeable C-contiguous array")
    for other in inputs:
        if other is not None and np.may_share_memory(out, other):
            raise ValueError(f"{name} must not overlap an input array")
    return out


# --------------------------------------------------------------------------------------- geometry
def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


@functools.lru_cache(maxsize=4096)
def _window(kernel, stride, padding, dilation, input_hw, transposed):
    return Window.resolve(kernel, stride, padding, dilation, input_hw, transposed)


def _resolve_window(kernel, stride, padding, dilation, input_hw, transposed=False) -> Window:
    stride, padding, dilation = _hashable(stride), _hashable(padding), _hashable(dilation)
    try:
        return _window(kernel, stride, padding, dilation, input_hw, transposed)
    except TypeError as exc:
        if "unhashable" not in str(exc):
            raise
        return Window.resolve(kernel, stride, padding, dilation, input_hw, transposed)


def _check_layout(layout) -> str:
    if layout not in ("NCHW", "NHWC"):
        if isinstance(layout, str) and layout.upper() in ("NCHW", "NHWC"):
            return layout.upper()
        raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
    return layout


def _check_groups(groups, channels, filters, channel_name, filter_name):
    groups = _as_groups(groups)
    if channels % groups or filters % groups:
        raise ValueError(f"groups={groups} must divide both {channel_name} ({channels}) and {filter_name} ({filters})")
    return groups


def _as_groups(groups) -> int:
    if isinstance(groups, (bool, np.bool_)) or not isinstance(groups, numbers.Integral):
        raise TypeError(f"groups must be an integer, got {groups!r}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    return int(groups)


def _image_dims(array, layout):
    """(N, C, H, W) of a 4-D image batch in `layout`."""
    if layout == "NCHW":
        return array.shape
    n, h, w, c = array.shape
    return n, c, h, w


def _image_shape(n, c, h, w, layout):
    return (n, c, h, w) if layout == "NCHW" else (n, h, w, c)


def _weight_dims(weight, layout):
    """(outer, inner, KH, KW) of a weight tensor: (F, C/groups) for conv2d, (C_in, C_out/groups) transposed."""
    if layout == "NCHW":
        return weight.shape
    kh, kw, inner, outer = weight.shape
    return outer, inner, kh, kw


def _spec(window, dtype, layout, specialize) -> ConvSpec:
    if not isinstance(specialize, (bool, np.bool_)):
        raise TypeError(f"specialize must be True or False, got {specialize!r}")
    return ConvSpec(window if specialize else None, dtype.name, layout)


# -------------------------------------------------------------------------------------- conv2d
def _conv2d_call(x, w, stride, padding, dilation, groups, layout, specialize, dy=None):
    n, c, h, width = _image_dims(x, layout)
    f, cg, kh, kw = _weight_dims(w, layout)
    groups = _check_groups(groups, c, f, "input channels", "output channels")
    if cg * groups != c:
        raise ValueError(f"w expects {cg} input channels per group ({cg * groups} in all with groups={groups}), "
                         f"but x has {c}")
    window = _resolve_window((kh, kw), stride, padding, dilation, (h, width))
    ho, wo = window.output_size((h, width))
    call = _Call(_spec(window, x.dtype, layout, specialize), window, n, c, h, width, f, ho, wo, groups)
    if dy is not None and dy.shape != _image_shape(n, f, ho, wo, layout):
        raise ValueError(f"dy must have shape {_image_shape(n, f, ho, wo, layout)} (the output of conv2d), "
                         f"got {dy.shape}")
    return call


def conv2d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW", specialize=True,
           out=None):
    """2-D convolution (cross-correlation, as PyTorch's conv2d).

    Parameters
    ----------
    x : array (N, C, H, W) for layout "NCHW", (N, H, W, C) for "NHWC"; float32 or float64.
    w : weights (F, C/groups, KH, KW) for "NCHW", (KH, KW, C/groups, F) for "NHWC"; x's dtype.
    bias : optional (F,) array.
    stride, dilation : int or (h, w) pair.
    padding : int, (h, w), ((top, bottom), (left, right)), "valid" or "same" (TensorFlow's rule:
        output ceil(input / stride), the odd extra row/column at the bottom/right).
    groups : input and output channels are split into this many independent groups.
    layout : "NCHW" or "NHWC".
    specialize : True calls the kernel compiled for exactly this window (kernel size, stride,
        padding, dilation as constants); False the generic kernel that takes them at run time.
    out : optional preallocated C-contiguous output array of the right shape and dtype.

    Returns y: (N, F, Ho, Wo) or (N, Ho, Wo, F), with Ho = (H + top + bottom − dh·(KH − 1) − 1)//sh + 1.
    """
    layout = _check_layout(layout)
    dtype = _common_dtype(x=x, w=w, bias=bias)
    x = _as_c_array("x", x, dtype, 4)
    w = _as_c_array("w", w, dtype, 4)
    call = _conv2d_call(x, w, stride, padding, dilation, groups, layout, specialize)
    if bias is not None:
        bias = _as_c_array("bias", bias, dtype, 1)
        if bias.shape != (call.f,):
            raise ValueError(f"bias must have shape ({call.f},) (one per output channel), got {bias.shape}")
    y = _checked_out("out", out, _image_shape(call.n, call.f, call.ho, call.wo, layout), dtype, (x, w, bias))
    if y.size:
        call.run(call.kernels.fwd, x, w, bias, y)
    return y


def conv2d_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW", specialize=True,
                    out=None):
    """Gradients of conv2d with respect to x, w and the bias, given dy = ∂L/∂y.

    Keyword arguments are those of `conv2d`. Returns (dx, dw, db) with the shapes of x, w and the
    bias (F,). `out` may be a (dx, dw, db) tuple of preallocated arrays (any of them None).
    dW = dY·im2col(X)ᵀ, dX = col2im(Wᵀ·dY), db = dY summed over batch and space.
    """
    layout = _check_layout(layout)
    dtype = _common_dtype(dy=dy, x=x, w=w)
    dy = _as_c_array("dy", dy, dtype, 4)
    x = _as_c_array("x", x, dtype, 4)
    w = _as_c_array("w", w, dtype, 4)
    call = _conv2d_call(x, w, stride, padding, dilation, groups, layout, specialize, dy=dy)
    out_dx, out_dw, out_db = _split_out(out)
    inputs = (dy, x, w)
    dx = _checked_out("out[0] (dx)", out_dx, x.shape, dtype, inputs)
    dw = _checked_out("out[1] (dw)", out_dw, w.shape, dtype, inputs)
    db = _checked_out("out[2] (db)", out_db, (call.f,), dtype, inputs)
    _backward(call, dy, x, w, dx, dw, db)
    return dx, dw, db


def _split_out(out):
    if out is None:
        return None, None, None
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError("out must be a (dx, dw, db) tuple of arrays or None")
    return tuple(out)


def _backward(call, dy, x, w, dx, dw, db):
    """dx, dw, db of the convolution x → y described by `call` (dx may be None)."""
    if dx is not None:
        if dy.size and dx.size:
            call.run(call.kernels.bwd_data, dy, w, dx)
        else:
            dx.fill(0)
    if dy.size and x.size:
        call.run(call.kernels.bwd_weight, dy, x, dw)
        np.sum(dy, axis=_SPATIAL_AXES[call.spec.layout], out=db)
    else:
        dw.fill(0)
        db.fill(0)


# ----------------------------------------------------------------------------- conv_transpose2d
def _transpose_call(x, w, stride, padding, output_padding, dilation, groups, layout, specialize):
    """The conv2d whose input gradient is this transposed convolution: its "input" is our output."""
    n, c_in, h, width = _image_dims(x, layout)
    w_in, c_out_g, kh, kw = _weight_dims(w, layout)
    if w_in != c_in:
        raise ValueError(f"w has {w_in} input channels (its {'first' if layout == 'NCHW' else 'last'} dimension) "
                         f"but x has {c_in}")
    groups = _as_groups(groups)
    if c_in % groups:
        raise ValueError(f"groups={groups} must divide the input channels ({c_in})")
    c_out = c_out_g * groups
    window = _resolve_window((kh, kw), stride, padding, dilation, (h, width), transposed=True)
    op = as_pair("output_padding", output_padding, minimum=0)
    if explicit_padding(_hashable(padding)) == "same":
        if op != (0, 0):
            raise ValueError(f"output_padding must be 0 with padding='same' (the output is input·stride), got {op}")
        op = window.implicit_output_padding((h, width))
    else:
        for axis, p, s, d in zip("hw", op, window.stride, window.dilation):
            if p >= max(s, d):
                raise ValueError(f"output_padding along {axis} must be smaller than max(stride, dilation) = "
                                 f"{max(s, d)}, got {p}")
    ho, wo = window.transposed_output_size((h, width), op)
    call = _Call(_spec(window, x.dtype, layout, specialize), window, n, c_out, ho, wo, c_in, h, width, groups)
    return call


def conv_transpose2d(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                     layout="NCHW", specialize=True, out=None):
    """Transposed 2-D convolution (PyTorch's conv_transpose2d): the input gradient of conv2d.

    x : (N, C_in, H, W) for "NCHW", (N, H, W, C_in) for "NHWC".
    w : (C_in, C_out/groups, KH, KW) for "NCHW" (PyTorch), (KH, KW, C_out/groups, C_in) for "NHWC"
        (TensorFlow's conv2d_transpose).
    bias : optional (C_out,).
    output_padding : int or pair, 0 <= op < max(stride, dilation): extra rows/cols at the bottom/right.
    padding : as conv2d; "same" gives an output of exactly input·stride.

    Returns y with Ho = (H − 1)·sh − top − bottom + dh·(KH − 1) + oph + 1. Computed as col2im of Wᵀ·x,
    never by convolving a zero-stuffed input.
    """
    layout = _check_layout(layout)
    dtype = _common_dtype(x=x, w=w, bias=bias)
    x = _as_c_array("x", x, dtype, 4)
    w = _as_c_array("w", w, dtype, 4)
    call = _transpose_call(x, w, stride, padding, output_padding, dilation, groups, layout, specialize)
    if bias is not None:
        bias = _as_c_array("bias", bias, dtype, 1)
        if bias.shape != (call.c,):
            raise ValueError(f"bias must have shape ({call.c},) (one per output channel), got {bias.shape}")
    y = _checked_out("out", out, _image_shape(call.n, call.c, call.h, call.w, layout), dtype, (x, w, bias))
    if y.size:
        if x.size and w.size:
            call.run(call.kernels.bwd_data, x, w, y)
        else:
            y.fill(0)
        if bias is not None:
            y += bias.reshape((-1, 1, 1) if layout == "NCHW" else (-1,))
    return y


def conv_transpose2d_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                              layout="NCHW", specialize=True, out=None):
    """Gradients of conv_transpose2d with respect to x, w and the bias, given dy = ∂L/∂y.

    Keyword arguments are those of `conv_transpose2d`. Returns (dx, dw, db) shaped as x, w and the
    bias (C_out,): dx is conv2d(dy, w), dw is conv2d's weight gradient with the roles of x and dy
    exchanged, db is dy summed over batch and space.
    """
    layout = _check_layout(layout)
    dtype = _common_dtype(dy=dy, x=x, w=w)
    dy = _as_c_array("dy", dy, dtype, 4)
    x = _as_c_array("x", x, dtype, 4)
    w = _as_c_array("w", w, dtype, 4)
    call = _transpose_call(x, w, stride, padding, output_padding, dilation, groups, layout, specialize)
    expected = _image_shape(call.n, call.c, call.h, call.w, layout)
    if dy.shape != expected:
        raise ValueError(f"dy must have shape {expected} (the output of conv_transpose2d), got {dy.shape}")
    out_dx, out_dw, out_db = _split_out(out)
    inputs = (dy, x, w)
    dx = _checked_out("out[0] (dx)", out_dx, x.shape, dtype, inputs)
    dw = _checked_out("out[1] (dw)", out_dw, w.shape, dtype, inputs)
    db = _checked_out("out[2] (db)", out_db, (call.c,), dtype, inputs)
    if dx.size:
        if dy.size and w.size:
            call.run(call.kernels.fwd, dy, w, None, dx)
        else:
            dx.fill(0)
    if x.size and dy.size:
        call.run(call.kernels.bwd_weight, x, dy, dw)
        np.sum(dy, axis=_SPATIAL_AXES[layout], out=db)
    else:
        dw.fill(0)
        db.fill(0)
    return dx, dw, db
