"""The public convolution ops: the only module that touches NumPy arrays.

Each op checks its arrays, works out the convolution's sizes, allocates (or checks) the output and
calls the compiled kernel, which trusts what it is given. Transposed convolution is conv2d's input
gradient (col2im of Wᵀ·x) and its gradients are conv2d's forward and weight gradient, so four ops
share three kernels.
"""

from __future__ import annotations

import math
import numbers
import os

import numpy as np

from .kernels import get_kernels, num_threads, settings
from .spec import ConvSpec, Window, as_pair

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_MAX_ELEMENTS = 2 ** 62  # any array or index the kernels form stays below this (int64 arithmetic)
# Window values become C literals and int64 factors of sizes in the kernels: bounded, they cannot overflow.
_MAX_WINDOW_VALUE = 2 ** 31 - 1
_WORKSPACE_QUERY_BYTES = 2 ** 26  # below this weight size × threads the kernels' workspace is not worth a check


def _physical_memory() -> int:
    """Bytes of RAM on this machine: no single array or workspace may need more."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 2 ** 63


_MEMORY_BYTES = _physical_memory()
_FORWARD, _BACKWARD_DATA, _BACKWARD_WEIGHT = 0, 1, 2  # op numbers of the kernels' workspace query
_SPATIAL_AXES = {"NCHW": (0, 2, 3), "NHWC": (0, 1, 2)}  # batch and space: what the bias gradient sums


class _Call:
    """The sizes of one convolution as the kernels see them (the forward direction, x → y)."""

    __slots__ = ("kernels", "spec", "window", "n", "c", "h", "w", "f", "ho", "wo", "groups", "args",
                 "_from_buffer", "_c_array", "_null")

    def __init__(self, spec: ConvSpec, window: Window, n, c, h, w, f, ho, wo, groups):
        self.spec, self.window = spec, window
        self.n, self.c, self.h, self.w, self.f, self.ho, self.wo, self.groups = n, c, h, w, f, ho, wo, groups
        self.kernels = get_kernels(spec)
        self.args = (n, c, h, w, f, ho, wo, groups)
        if not spec.specialized:
            (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
            self.args += (kh, kw, sh, sw, window.padding[0][0], window.padding[1][0], dh, dw)
        self.args += (num_threads(),)
        self._from_buffer, self._c_array, self._null = self.kernels.ffi.from_buffer, spec.c_type + "[]", self.kernels.ffi.NULL

    def run(self, entry, *arrays):
        from_buffer, c_array = self._from_buffer, self._c_array
        status = entry(*[self._null if a is None else from_buffer(c_array, a, False) for a in arrays], *self.args)
        if status != 0:
            raise MemoryError(f"convgen kernel {self.spec} could not allocate its workspace")

    def workspace_bytes(self, op: int) -> int:
        return int(self.kernels.workspace(op, *self.args))


_PLANS: dict = {}  # call signature -> _Plan, for calls that were validated once already
_PLANS_MAX = 1024


class _Plan:
    """Everything one op needs for a call signature that passed validation: the kernel's spec and
    sizes, the dtype and the result shapes. Repeated calls with the same shapes and parameters (a
    training loop) skip straight to the kernel. `spec` is None when there is nothing to compute."""

    __slots__ = ("spec", "geometry", "dtype", "shapes", "layout", "workspace_op", "weight", "what", "_call")

    def __init__(self, spec, geometry, dtype, shapes, layout, workspace_op, weight, what):
        self.spec, self.geometry, self.dtype, self.shapes, self.layout = spec, geometry, dtype, shapes, layout
        self.workspace_op, self.weight, self.what = workspace_op, (weight.shape, weight.nbytes), what
        self._call = None

    def call(self) -> "_Call":
        """The kernel call, loading the kernels (and checking their workspace) on first use.

        The kernels are looked up each time (a dict lookup once loaded), so a plan never calls a
        module the process has since let go of, e.g. after the cache was cleared.
        """
        if self._call is None or self._call.kernels is not get_kernels(self.spec):
            call = _Call(self.spec, *self.geometry)
            _check_workspace(call, self.workspace_op, self.weight, self.what)
            self._call = call
        return self._call


def _plan_key(op, arrays, *params):
    """A hashable signature of a call whose arrays need no conversion, else None.

    Arrays must be exact, C-contiguous ndarrays of one native float dtype (what validation would
    leave untouched); parameters enter through `_key`, so 2.0 or True never match 2 or 1. The
    active settings and thread count are part of the key since the kernels depend on them.
    """
    if type(arrays[0]) is not np.ndarray:
        return None
    dtype = arrays[0].dtype
    if dtype is not _FLOAT_DTYPES[0] and dtype is not _FLOAT_DTYPES[1] and dtype not in _FLOAT_DTYPES:
        return None  # (`in` compares byte order too: a big-endian float32 is not in it)
    for array in arrays:
        if array is not None and (type(array) is not np.ndarray or not array.flags.c_contiguous
                                  or (array.dtype is not dtype and array.dtype != dtype)):
            return None
    try:
        return (op, dtype, tuple([None if a is None else a.shape for a in arrays]),
                tuple([p if type(p) is int or type(p) is str else _key(p) for p in params]),
                settings(), num_threads())
    except TypeError:  # unhashable parameters: validation will say what is wrong with them
        return None


def _remember(key, plan):
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


# ---------------------------------------------------------------------------------------- arrays
def _dtype_of(name, value):
    """The dtype an argument brings (None for Python sequences of numbers, which adopt the others')."""
    if isinstance(value, np.ndarray):
        return value.dtype
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be an array of float32 or float64, got {type(value).__name__}")
    if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        return np.asarray(value).dtype
    try:
        kind = np.asarray(value).dtype.kind
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of floats, got a {type(value).__name__} NumPy cannot read "
                        f"as one: {exc}") from None
    if kind not in "fiu":
        raise TypeError(f"{name} must be an array of floats, got a {type(value).__name__} of "
                        f"{'strings' if kind in 'US' else {'b': 'booleans', 'c': 'complex numbers'}.get(kind, 'objects')}")
    return None


def _common_dtype(**arrays) -> np.dtype:
    """The one floating dtype shared by the given arrays (lists adopt it; alone they are float64)."""
    found = {}
    for name, value in arrays.items():
        if value is None and name == "bias":
            continue
        dtype = _dtype_of(name, value)
        if dtype is None:
            continue
        if dtype.kind != "f" or dtype.itemsize not in (4, 8):
            raise TypeError(f"{name} must have dtype float32 or float64, got {dtype}")
        found[name] = _FLOAT_DTYPES[0] if dtype.itemsize == 4 else _FLOAT_DTYPES[1]  # native order
    kinds = set(found.values())
    if len(kinds) > 1:
        detail = ", ".join(f"{n} is {d}" for n, d in found.items())
        raise TypeError(f"{', '.join(found)} must share one dtype (float32 or float64); got {detail}")
    return kinds.pop() if kinds else np.dtype(np.float64)


def _as_c_array(name, value, dtype, ndim):
    """A C-contiguous native-order array of `dtype` with `ndim` dimensions (a copy only if needed)."""
    if type(value) is np.ndarray and value.dtype == dtype and value.flags.c_contiguous:
        array = value
    else:
        if value is None:
            raise TypeError(f"{name} must be an array, got None")
        if isinstance(value, np.ndarray):
            # A broadcast or strided view can stand for far more elements than it stores.
            _check_new_array(f"a contiguous copy of {name}", value.shape, dtype)
        try:
            array = np.asarray(value, dtype=dtype, order="C")  # (ascontiguousarray would make a scalar 1-D)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must be an array of floats: {exc}") from None
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    return array


def _check_new_array(what, shape, dtype):
    """Refuse, before allocating it, an array that 64-bit indexing or this machine's memory cannot hold."""
    count = math.prod(shape)
    if count >= _MAX_ELEMENTS:
        raise ValueError(f"{what} would have shape {tuple(shape)}, {count} elements: more than the 2**62 that "
                         f"convgen's 64-bit indexing allows")
    if count * dtype.itemsize > _MEMORY_BYTES:
        raise ValueError(f"{what} would have shape {tuple(shape)} and need {count * dtype.itemsize} bytes, more "
                         f"than this machine's memory ({_MEMORY_BYTES} bytes)")


def _checked_out(name, out, shape, dtype, inputs):
    """Validate a caller's output array, or allocate a new one."""
    if out is None:
        _check_new_array("the result" if name == "out" else f"the result {name.split()[-1]}", shape, dtype)
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


def _check_workspace(call, op, weight, what):
    """Refuse a call whose C workspace (about threads × the weights at most) this machine cannot hold."""
    weight_shape, weight_bytes = weight
    if weight_bytes * num_threads() < _WORKSPACE_QUERY_BYTES:
        return
    needed = call.workspace_bytes(op)
    if needed > _MEMORY_BYTES:
        raise ValueError(f"{what} would need a workspace of {needed} bytes for these weights {weight_shape}, "
                         f"more than this machine's memory ({_MEMORY_BYTES} bytes); use fewer threads")


# --------------------------------------------------------------------------------------- geometry
def _key(value):
    """A hashable stand-in for a window parameter that equals no differently typed value.

    Plain hashing would let 2.0 or True find the window cached for 2 or 1 and skip validation;
    here only ints and strings stand for themselves.
    """
    kind = type(value)
    if kind is int or kind is str:
        return value
    if kind is tuple or kind is list:
        return tuple(_key(v) for v in value)
    return (kind, value)


_WINDOWS: dict = {}  # (kernel, stride, padding, dilation, input size, transposed) keys -> checked Window
_WINDOWS_MAX = 4096


def _resolve_window(kernel, stride, padding, dilation, input_hw, transposed=False) -> Window:
    """The checked Window of these parameters (resolved once per distinct parameters and input size)."""
    try:
        key = (kernel, _key(stride), _key(padding), _key(dilation), input_hw, transposed)
        return _WINDOWS[key]
    except KeyError:
        pass
    except TypeError:  # unhashable parameters (e.g. arrays): resolve them uncached, which reports them
        key = None
    window = _bounded(Window.resolve(kernel, stride, padding, dilation, input_hw, transposed))
    if key is not None and len(_WINDOWS) < _WINDOWS_MAX:
        _WINDOWS[key] = window
    return window


def _bounded(window: Window) -> Window:
    """`window`, once every value is known to fit the kernels' 64-bit arithmetic."""
    (pt, pb), (pl, pr) = window.padding
    for name, values in (("the kernel size (of w)", window.kernel), ("stride", window.stride),
                         ("padding", (pt, pb, pl, pr)), ("dilation", window.dilation)):
        if max(values) > _MAX_WINDOW_VALUE:
            raise ValueError(f"{name} must be at most {_MAX_WINDOW_VALUE}, got {max(values)}")
    return window


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
def _conv2d_geometry(x, w, stride, padding, dilation, groups, layout):
    """(window, n, c, h, w, f, ho, wo, groups) of conv2d(x, w), every parameter checked."""
    n, c, h, width = _image_dims(x, layout)
    f, cg, kh, kw = _weight_dims(w, layout)
    groups = _check_groups(groups, c, f, "input channels", "output channels")
    if cg * groups != c:
        raise ValueError(f"w expects {cg} input channels per group ({cg * groups} in all with groups={groups}), "
                         f"but x has {c}")
    window = _resolve_window((kh, kw), stride, padding, dilation, (h, width))
    ho, wo = window.output_size((h, width))
    return window, n, c, h, width, f, ho, wo, groups


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
    key = _plan_key("conv2d", (x, w, bias), stride, padding, dilation, groups, layout, specialize)
    plan = _PLANS.get(key)
    if plan is None:
        x, w, bias, plan = _plan_conv2d(key, x, w, bias, stride, padding, dilation, groups, layout, specialize)
    y = _checked_out("out", out, plan.shapes[0], plan.dtype, (x, w, bias))
    if plan.spec is not None:
        call = plan.call()
        call.run(call.kernels.fwd, x, w, bias, y)
    elif y.size:  # no input values (C or H·W is 0): every output is the bias alone
        _fill_bias(y, bias, plan.layout)
    return y


def _plan_conv2d(key, x, w, bias, stride, padding, dilation, groups, layout, specialize):
    """Validate a conv2d call; return its arrays (converted if needed) and its plan."""
    layout = _check_layout(layout)
    dtype = _common_dtype(x=x, w=w, bias=bias)
    x = _as_c_array("x", x, dtype, 4)
    w = _as_c_array("w", w, dtype, 4)
    geometry = _conv2d_geometry(x, w, stride, padding, dilation, groups, layout)
    window, n, c, h, width, f, ho, wo, groups = geometry
    spec = _spec(window, dtype, layout, specialize)
    if bias is not None:
        bias = _as_c_array("bias", bias, dtype, 1)
        if bias.shape != (f,):
            raise ValueError(f"bias must have shape ({f},) (one per output channel), got {bias.shape}")
    y_shape = _image_shape(n, f, ho, wo, layout)
    _check_new_array("the result", y_shape, dtype)
    work = spec if math.prod(y_shape) and x.size else None
    return x, w, bias, _remember(key, _Plan(work, geometry, dtype, (y_shape,), layout, _FORWARD, w, "conv2d"))


def conv2d_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW", specialize=True,
                    out=None):
    """Gradients of conv2d with respect to x, w and the bias, given dy = ∂L/∂y.

    Keyword arguments are those of `conv2d`. Returns (dx, dw, db) with the shapes of x, w and the
    bias (F,). `out` may be a (dx, dw, db) tuple of preallocated arrays (any of them None).
    dW = dY·im2col(X)ᵀ, dX = col2im(Wᵀ·dY), db = dY summed over batch and space.
    """
    key = _plan_key("conv2d_backward", (dy, x, w), stride, padding, dilation, groups, layout, specialize)
    plan = _PLANS.get(key)
    if plan is None:
        dy, x, w, plan = _plan_conv2d_backward(key, dy, x, w, stride, padding, dilation, groups, layout, specialize)
    dx, dw, db = _checked_outs(out, plan, (dy, x, w))
    if plan.spec is not None:
        call = plan.call()
        if dx.size:
            call.run(call.kernels.bwd_data, dy, w, dx)
        call.run(call.kernels.bwd_weight, dy, x, dw)
    else:  # nothing to multiply: dx and dw are empty sums
        dx.fill(0)
        dw.fill(0)
    np.add.reduce(dy, axis=_SPATIAL_AXES[plan.layout], out=db)
    return dx, dw, db


def _plan_conv2d_backward(key, dy, x, w, stride, padding, dilation, groups, layout, specialize):
    """Validate a conv2d_backward call; return its arrays (converted if needed) and its plan."""
    layout = _check_layout(layout)
    dtype = _common_dtype(dy=dy, x=x, w=w)
    dy = _as_c_array("dy", dy, dtype, 4)
    x = _as_c_array("x", x, dtype, 4)
    w = _as_c_array("w", w, dtype, 4)
    geometry = _conv2d_geometry(x, w, stride, padding, dilation, groups, layout)
    window, n, c, h, width, f, ho, wo, groups = geometry
    spec = _spec(window, dtype, layout, specialize)
    expected = _image_shape(n, f, ho, wo, layout)
    if dy.shape != expected:
        raise ValueError(f"dy must have shape {expected} (the output of conv2d), got {dy.shape}")
    work = spec if dy.size and x.size else None
    return dy, x, w, _remember(key, _Plan(work, geometry, dtype, (x.shape, w.shape, (f,)), layout, _BACKWARD_WEIGHT,
                                          w, "conv2d_backward"))


def _checked_outs(out, plan, inputs):
    """(dx, dw, db): the caller's arrays from `out`, checked, or new ones."""
    out_dx, out_dw, out_db = _split_out(out)
    dx_shape, dw_shape, db_shape = plan.shapes
    return (_checked_out("out[0] (dx)", out_dx, dx_shape, plan.dtype, inputs),
            _checked_out("out[1] (dw)", out_dw, dw_shape, plan.dtype, inputs),
            _checked_out("out[2] (db)", out_db, db_shape, plan.dtype, inputs))


def _split_out(out):
    if out is None:
        return None, None, None
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(f"out must be a (dx, dw, db) tuple of arrays (each may be None) or None, got {out!r:.80}")
    return tuple(out)


def _fill_bias(y, bias, layout):
    if bias is None:
        y.fill(0)
    else:
        y[...] = bias.reshape((-1, 1, 1) if layout == "NCHW" else (-1,))


# ----------------------------------------------------------------------------- conv_transpose2d
def _transpose_geometry(x, w, stride, padding, output_padding, dilation, groups, layout):
    """The conv2d whose input gradient is this transposed convolution, as conv2d geometry:
    (window, n, c_out, ho, wo, c_in, h, w, groups): its "input" is our output."""
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
    if isinstance(padding, str) and padding.lower() == "same":
        if op != (0, 0):
            raise ValueError(f"output_padding must be 0 with padding='same' (the output is input·stride), got {op}")
        op = window.implicit_output_padding((h, width))
    else:
        for axis, p, s, d in zip("hw", op, window.stride, window.dilation):
            if p >= max(s, d):
                raise ValueError(f"output_padding along {axis} must be smaller than max(stride, dilation) = "
                                 f"{max(s, d)}, got {p}")
    ho, wo = window.transposed_output_size((h, width), op)
    return window, n, c_out, ho, wo, c_in, h, width, groups


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
    key = _plan_key("conv_transpose2d", (x, w, bias), stride, padding, output_padding, dilation, groups, layout,
                    specialize)
    plan = _PLANS.get(key)
    if plan is None:
        x, w, bias, plan = _plan_conv_transpose2d(key, x, w, bias, stride, padding, output_padding, dilation,
                                                  groups, layout, specialize)
    y = _checked_out("out", out, plan.shapes[0], plan.dtype, (x, w, bias))
    if plan.spec is not None:
        call = plan.call()
        call.run(call.kernels.bwd_data, x, w, y)
        if bias is not None:
            y += bias.reshape((-1, 1, 1) if plan.layout == "NCHW" else (-1,))
    elif y.size:  # no input values: every output is the bias alone
        _fill_bias(y, bias, plan.layout)
    return y


def _plan_conv_transpose2d(key, x, w, bias, stride, padding, output_padding, dilation, groups, layout, specialize):
    """Validate a conv_transpose2d call; return its arrays (converted if needed) and its plan."""
    layout = _check_layout(layout)
    dtype = _common_dtype(x=x, w=w, bias=bias)
    x = _as_c_array("x", x, dtype, 4)
    w = _as_c_array("w", w, dtype, 4)
    geometry = _transpose_geometry(x, w, stride, padding, output_padding, dilation, groups, layout)
    window, n, c_out, ho, wo = geometry[:5]
    spec = _spec(window, dtype, layout, specialize)
    if bias is not None:
        bias = _as_c_array("bias", bias, dtype, 1)
        if bias.shape != (c_out,):
            raise ValueError(f"bias must have shape ({c_out},) (one per output channel), got {bias.shape}")
    y_shape = _image_shape(n, c_out, ho, wo, layout)
    _check_new_array("the result", y_shape, dtype)
    work = spec if math.prod(y_shape) and x.size else None
    return x, w, bias, _remember(key, _Plan(work, geometry, dtype, (y_shape,), layout, _BACKWARD_DATA, w,
                                            "conv_transpose2d"))


def conv_transpose2d_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                              layout="NCHW", specialize=True, out=None):
    """Gradients of conv_transpose2d with respect to x, w and the bias, given dy = ∂L/∂y.

    Keyword arguments are those of `conv_transpose2d`. Returns (dx, dw, db) shaped as x, w and the
    bias (C_out,): dx is conv2d(dy, w), dw is conv2d's weight gradient with the roles of x and dy
    exchanged, db is dy summed over batch and space.
    """
    key = _plan_key("conv_transpose2d_backward", (dy, x, w), stride, padding, output_padding, dilation, groups,
                    layout, specialize)
    plan = _PLANS.get(key)
    if plan is None:
        dy, x, w, plan = _plan_conv_transpose2d_backward(key, dy, x, w, stride, padding, output_padding, dilation,
                                                         groups, layout, specialize)
    dx, dw, db = _checked_outs(out, plan, (dy, x, w))
    # dx is conv2d(dy, w); dw is conv2d's weight gradient with the roles of x and dy exchanged.
    if plan.spec is not None:
        call = plan.call()
        call.run(call.kernels.fwd, dy, w, None, dx)
        call.run(call.kernels.bwd_weight, x, dy, dw)
    else:  # nothing to multiply: dx and dw are empty sums
        dx.fill(0)
        dw.fill(0)
    np.add.reduce(dy, axis=_SPATIAL_AXES[plan.layout], out=db)
    return dx, dw, db


def _plan_conv_transpose2d_backward(key, dy, x, w, stride, padding, output_padding, dilation, groups, layout,
                                    specialize):
    """Validate a conv_transpose2d_backward call; return its arrays (converted if needed) and its plan."""
    layout = _check_layout(layout)
    dtype = _common_dtype(dy=dy, x=x, w=w)
    dy = _as_c_array("dy", dy, dtype, 4)
    x = _as_c_array("x", x, dtype, 4)
    w = _as_c_array("w", w, dtype, 4)
    geometry = _transpose_geometry(x, w, stride, padding, output_padding, dilation, groups, layout)
    window, n, c_out, ho, wo = geometry[:5]
    spec = _spec(window, dtype, layout, specialize)
    expected = _image_shape(n, c_out, ho, wo, layout)
    if dy.shape != expected:
        raise ValueError(f"dy must have shape {expected} (the output of conv_transpose2d), got {dy.shape}")
    work = spec if dy.size and x.size else None
    return dy, x, w, _remember(key, _Plan(work, geometry, dtype, (x.shape, w.shape, (c_out,)), layout,
                                          _BACKWARD_WEIGHT, w, "conv_transpose2d_backward"))
