"""The parameter resolver: user arguments in, one checked `Problem` out. All validation lives here.

The ops (`convgen.frontend.ops`) and the layers (`convgen.frontend.layers`) both check their arguments through these
functions, so a value is refused with the same message wherever it is given. `resolve` turns one
op call's arrays and keyword arguments into its arrays (converted to C-contiguous native floats
where needed), its `Problem` and the shapes of its results; the kernels trust what it returns.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import numpy as np

from ..planning.epilogue import NO_EPILOGUE
from ..planning.problem import Problem
from ..planning.spec import DTYPES, LAYOUTS, PADDING_MODES, Window, as_int, as_pair, explicit_padding

FLOAT_DTYPES = tuple(np.dtype(name) for name in DTYPES)  # float32, float64, native byte order
OPS = ("conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward")
_MAX_ELEMENTS = 2 ** 62  # any array or index the kernels form stays below this (int64 arithmetic)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 2 ** 63


@dataclasses.dataclass
class Limits:
    """What a call may need: no array or kernel workspace larger than `memory_bytes` is attempted.

    The kernels' workspace (about threads × the weights at most) is asked for only when the weights
    times the threads reach `workspace_query_bytes`; below that it cannot matter.
    """

    memory_bytes: int = dataclasses.field(default_factory=_physical_memory)
    workspace_query_bytes: int = 2 ** 26


LIMITS = Limits()


# ----------------------------------------------------------------------------------- scalar values
def as_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def as_layout(value) -> str:
    """"NCHW" or "NHWC" (any case)."""
    if isinstance(value, str) and value.upper() in LAYOUTS:
        return value.upper()
    raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {value!r}")


def as_padding_mode(value) -> str:
    """What the padding holds, as PyTorch names it: "zeros", "reflect", "replicate" or "circular" (any case)."""
    if isinstance(value, str) and value.lower() in PADDING_MODES:
        return value.lower()
    raise ValueError(f"padding_mode must be one of {', '.join(map(repr, PADDING_MODES))}, got {value!r}")


def check_padding_fits(window: Window, input_hw, x_shape) -> None:
    """PyTorch's size rules for the padding modes that copy the image: reflect pads less than the
    input along each axis (the edge is not repeated), circular at most the input (it wraps once),
    replicate needs an input row or column to repeat."""
    mode = window.padding_mode
    for axis, n, pads in zip(("height", "width"), input_hw, window.padding):
        largest = max(pads)
        if largest == 0:
            continue
        if mode == "reflect" and largest >= n:
            raise ValueError(f"padding_mode='reflect' needs padding smaller than the input: padding {pads} along the "
                             f"{axis} is not smaller than x's {axis} {n} (x has shape {tuple(x_shape)})")
        if mode == "circular" and largest > n:
            raise ValueError(f"padding_mode='circular' needs padding at most the input: padding {pads} along the "
                             f"{axis} is more than x's {axis} {n} (x has shape {tuple(x_shape)}); it would wrap "
                             f"around more than once")
        if mode == "replicate" and n == 0:
            raise ValueError(f"padding_mode='replicate' needs an input to repeat: padding {pads} along the {axis} "
                             f"of an empty x (shape {tuple(x_shape)})")


def as_float_dtype(value) -> np.dtype:
    """float32 or float64 as a native-order NumPy dtype, from anything np.dtype reads or a torch dtype."""
    if type(value).__module__ == "torch":  # torch.float32 -> "float32", without importing torch
        value = str(value).removeprefix("torch.")
    try:
        found = None if value is None else np.dtype(value)  # np.dtype(None) would be float64
    except (TypeError, ValueError):
        found = None
    # (`in` alone is not enough: NumPy compares None equal to float64.)
    if found is None or found not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32 or float64, got {value!r}")
    return FLOAT_DTYPES[0] if found.itemsize == 4 else FLOAT_DTYPES[1]


def groups_dividing(groups, channels: int, filters: int, channel_name: str, filter_name: str) -> int:
    groups = as_int("groups", groups)
    if channels % groups or filters % groups:
        raise ValueError(f"groups={groups} must divide both {channel_name} ({channels}) and {filter_name} ({filters})")
    return groups


def as_output_padding(value, stride, dilation, padding) -> tuple[int, int]:
    """A transposed convolution's output_padding: 0 <= op < max(stride, dilation), and 0 with "same"."""
    op = as_pair("output_padding", value, minimum=0)
    if explicit_padding(padding) == "same":
        if op != (0, 0):
            raise ValueError(f"output_padding must be 0 with padding='same' (the output is input·stride), got {op}")
        return op
    for axis, p, s, d in zip("hw", op, as_pair("stride", stride), as_pair("dilation", dilation)):
        if p >= max(s, d):
            raise ValueError(f"output_padding along {axis} must be smaller than max(stride, dilation) = "
                             f"{max(s, d)}, got {p}")
    return op


# ------------------------------------------------------------------------------------------ arrays
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
        what = "strings" if kind in "US" else {"b": "booleans", "c": "complex numbers"}.get(kind, "objects")
        raise TypeError(f"{name} must be an array of floats, got a {type(value).__name__} of {what}")
    return None


def common_dtype(arrays: dict) -> np.dtype:
    """The one floating dtype shared by the named arrays (lists adopt it; alone they are float64).

    A None bias is skipped."""
    found = {}
    for name, value in arrays.items():
        if value is None and name == "bias":
            continue
        dtype = _dtype_of(name, value)
        if dtype is None:
            continue
        if dtype.kind != "f" or dtype.itemsize not in (4, 8):
            raise TypeError(f"{name} must have dtype float32 or float64, got {dtype}")
        found[name] = FLOAT_DTYPES[0] if dtype.itemsize == 4 else FLOAT_DTYPES[1]
    kinds = set(found.values())
    if len(kinds) > 1:
        detail = ", ".join(f"{n} is {d}" for n, d in found.items())
        raise TypeError(f"{', '.join(found)} must share one dtype (float32 or float64); got {detail}")
    return kinds.pop() if kinds else FLOAT_DTYPES[1]


def c_array(name, value, dtype, ndim):
    """A C-contiguous native-order array of `dtype` with `ndim` dimensions (a copy only if needed)."""
    if type(value) is np.ndarray and value.dtype == dtype and value.flags.c_contiguous:
        array = value
    else:
        if value is None:
            raise TypeError(f"{name} must be an array, got None")
        if isinstance(value, np.ndarray):
            # A broadcast or strided view can stand for far more elements than it stores.
            check_new_array(f"a contiguous copy of {name}", value.shape, dtype)
        try:
            array = np.asarray(value, dtype=dtype, order="C")  # (ascontiguousarray would make a scalar 1-D)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must be an array of floats: {exc}") from None
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    return array


def check_new_array(what, shape, dtype):
    """Refuse, before allocating it, an array that 64-bit indexing or this machine's memory cannot hold."""
    count = math.prod(shape)
    if count >= _MAX_ELEMENTS:
        raise ValueError(f"{what} would have shape {tuple(shape)}, {count} elements: more than the 2**62 that "
                         f"convgen's 64-bit indexing allows")
    if count * dtype.itemsize > LIMITS.memory_bytes:
        raise ValueError(f"{what} would have shape {tuple(shape)} and need {count * dtype.itemsize} bytes, more "
                         f"than this machine's memory ({LIMITS.memory_bytes} bytes)")


def result_array(name, out, shape, dtype, inputs):
    """The caller's output array `out`, checked, or a new one."""
    if out is None:
        check_new_array("the result" if name == "out" else f"the result {name.split()[-1]}", shape, dtype)
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


def split_out(out) -> tuple:
    """The (dx, dw, db) arrays of a backward op's `out` (None: three Nones)."""
    if out is None:
        return None, None, None
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(f"out must be a (dx, dw, db) tuple of arrays (each may be None) or None, got {out!r:.80}")
    return tuple(out)


# ---------------------------------------------------------------------------------------- geometry
def _image_dims(shape, layout):
    """(N, C, H, W) of a 4-D image batch's shape in `layout`."""
    if layout == "NCHW":
        return shape
    n, h, w, c = shape
    return n, c, h, w


def _weight_dims(shape, layout):
    """(outer, inner, KH, KW) of a weight shape: (F, C/groups) for conv2d, (C_in, C_out/groups) transposed."""
    if layout == "NCHW":
        return shape
    kh, kw, inner, outer = shape
    return outer, inner, kh, kw


def conv_problem(x_shape, w_shape, dtype, stride, padding, dilation, groups, layout,
                 padding_mode="zeros") -> Problem:
    """The Problem of conv2d(x, w), every parameter checked."""
    n, c, h, width = _image_dims(x_shape, layout)
    f, cg, kh, kw = _weight_dims(w_shape, layout)
    groups = groups_dividing(groups, c, f, "input channels", "output channels")
    if cg * groups != c:
        raise ValueError(f"w expects {cg} input channels per group ({cg * groups} in all with groups={groups}), "
                         f"but x has {c}")
    padding_mode = as_padding_mode(padding_mode)
    window = Window.resolve((kh, kw), stride, padding, dilation, (h, width), padding_mode=padding_mode)
    check_padding_fits(window, (h, width), x_shape)
    ho, wo = window.output_size((h, width))
    return Problem(n, c, h, width, f, ho, wo, groups, window, dtype.name, layout)


def transposed_problem(x_shape, w_shape, dtype, stride, padding, dilation, groups, layout, out_padding,
                       padding_mode="zeros") -> Problem:
    """The Problem of conv_transpose2d(x, w), every parameter checked."""
    if as_padding_mode(padding_mode) != "zeros":
        raise ValueError(f"padding_mode must be 'zeros' for a transposed convolution (as for torch's "
                         f"ConvTranspose2d), got {padding_mode!r}")
    n, c_in, h, width = _image_dims(x_shape, layout)
    w_in, c_out_g, kh, kw = _weight_dims(w_shape, layout)
    if w_in != c_in:
        raise ValueError(f"w has {w_in} input channels (its {'first' if layout == 'NCHW' else 'last'} dimension) "
                         f"but x has {c_in}")
    groups = as_int("groups", groups)
    if c_in % groups:
        raise ValueError(f"groups={groups} must divide the input channels ({c_in})")
    window = Window.resolve((kh, kw), stride, padding, dilation, (h, width), transposed=True)
    op = as_output_padding(out_padding, window.stride, window.dilation, padding)
    if explicit_padding(padding) == "same":
        op = window.implicit_output_padding((h, width))
    ho, wo = window.transposed_output_size((h, width), op)
    return Problem(n, c_in, h, width, c_out_g * groups, ho, wo, groups, window, dtype.name, layout, transpose=True)


# ------------------------------------------------------------------------------------------ a call
@dataclasses.dataclass(frozen=True)
class Resolved:
    """One op call after validation: its problem, dtype and the shapes of the arrays it returns."""

    op: str
    problem: Problem
    dtype: np.dtype
    result_shapes: tuple

    @property
    def backward(self) -> bool:
        return self.op.endswith("_backward")


def array_names(op: str) -> tuple[str, str, str]:
    """The names of an op's three array arguments, in order."""
    return ("dy", "x", "w") if op.endswith("_backward") else ("x", "w", "bias")


def resolve(op, arrays, stride=1, padding=0, dilation=1, groups=1, layout="NCHW", out_padding=0,
            padding_mode="zeros", epilogue=NO_EPILOGUE):
    """Check one call of `op` (one of OPS) and return (its arrays, converted if needed; Resolved).

    `arrays` are the op's three array arguments in `array_names(op)` order (the bias may be None);
    `epilogue` what conv2d's forward pass does after the bias (the other ops take none).
    """
    if epilogue.active and op != "conv2d":
        raise ValueError(f"{op} takes no activation or residual: only conv2d's forward pass fuses them")
    layout = as_layout(layout)
    names = array_names(op)
    dtype = common_dtype(dict(zip(names, arrays)))
    given = dict(zip(names, arrays))
    checked = {name: None if value is None else c_array(name, value, dtype, 1 if name == "bias" else 4)
               for name, value in given.items()}
    for name in ("x", "w") + (("dy",) if "dy" in names else ()):
        if checked[name] is None:
            raise TypeError(f"{name} must be an array of float32 or float64, got None")
    x, w = checked["x"], checked["w"]
    if op.startswith("conv_transpose2d"):
        problem = transposed_problem(x.shape, w.shape, dtype, stride, padding, dilation, groups, layout, out_padding,
                                     padding_mode)
    else:
        problem = conv_problem(x.shape, w.shape, dtype, stride, padding, dilation, groups, layout, padding_mode)
    if op.endswith("_backward"):
        dy = checked["dy"]
        if dy.shape != problem.output_shape:
            raise ValueError(f"dy must have shape {problem.output_shape} (the output of {op[:-9]}), got {dy.shape}")
        shapes = (x.shape, w.shape, (problem.f,))
    else:
        bias = checked["bias"]
        if bias is not None and bias.shape != (problem.f,):
            raise ValueError(f"bias must have shape ({problem.f},) (one per output channel), got {bias.shape}")
        shapes = (problem.output_shape,)
        check_new_array("the result", shapes[0], dtype)
        if epilogue.active:
            problem = dataclasses.replace(problem, epilogue=epilogue)
    return tuple(checked[name] for name in names), Resolved(op, problem, dtype, shapes)


__all__ = ["Limits", "LIMITS", "FLOAT_DTYPES", "OPS", "Resolved", "resolve", "array_names", "conv_problem",
           "transposed_problem", "as_flag", "as_layout", "as_float_dtype", "groups_dividing",
           "as_output_padding", "common_dtype", "c_array", "check_new_array", "result_array", "split_out",
           "as_padding_mode", "check_padding_fits"]
