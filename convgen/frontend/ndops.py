"""1-D and 3-D convolution ops, lowered onto the 2-D ops and their kernels.

Each op checks its arguments in its own terms (axes l or d, h, w), then runs the 2-D op that
computes it, with every window value explicit:

* 1-D: the arrays with a unit height axis (views, no copy): x (N, C, L) is (N, C, 1, L), the
  weights (F, C/g, K) are (F, C/g, 1, K), and the window is the 1 × K window of one row. Measured
  as fast as a 1-D kernel could be: the 2-D kernels' GEMM sees the same sizes.
* 3-D: the depth taps folded into the channels (`convgen.frontend.depthfold`, which says what that copies),
  the height × width window on the 2-D kernels.

Specialization, the algorithm choice (Winograd F(m×m, 3×3) for a 3×3 height × width window at
stride 1, any depth) and the padding modes are those of the 2-D kernels; a 3-D padding mode along
depth is applied by the fold.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import ops
from ..planning import planner
from .batching import accepts_unbatched
from .depthfold import DepthFold, batch_into_slices, slices_as_batch
from ..planning.ndspec import AXES, PLANAR_LAYOUT, NdWindow, as_rank_layout, as_values, explicit_padding
from .resolve import (array_names, as_flag, as_padding_mode, c_array, check_new_array, common_dtype, groups_dividing,
                      result_array, split_out)
from ..planning.spec import WINOGRAD_WINDOW_TEXT, as_int, winograd_computes


@dataclasses.dataclass(frozen=True)
class NdCall:
    """One checked 1-D or 3-D op call: its sizes and window (for a transposed op, those of the call:
    input c channels of `sizes`, output f channels of `out_sizes`)."""

    op: str
    layout: str
    dtype: np.dtype
    n: int
    c: int
    sizes: tuple
    f: int
    out_sizes: tuple
    groups: int
    window: NdWindow
    output_padding: tuple

    @property
    def rank(self) -> int:
        return self.window.rank

    @property
    def transposed(self) -> bool:
        return self.op.startswith("conv_transpose")

    @property
    def channels_last(self) -> bool:
        return self.layout in ("NLC", "NDHWC")

    def image_shape(self, channels, sizes) -> tuple:
        return (self.n, *sizes, channels) if self.channels_last else (self.n, channels, *sizes)

    @property
    def output_shape(self) -> tuple:
        return self.image_shape(self.f, self.out_sizes)

    def planar_keywords(self) -> dict:
        """The 2-D op's window keywords, every value explicit."""
        window = self.window.lower()[1]
        keywords = dict(stride=window.stride, padding=window.padding, dilation=window.dilation, groups=self.groups,
                        layout=PLANAR_LAYOUT[self.layout])
        if self.transposed:
            keywords["output_padding"] = (0, *self.output_padding) if self.rank == 1 else self.output_padding[1:]
        keywords["padding_mode"] = window.padding_mode  # ("zeros" where the 2-D window has no padding)
        return keywords


def as_output_padding_nd(value, stride, dilation, padding, rank) -> tuple:
    """A transposed op's output_padding, one value per axis: 0 <= op < max(stride, dilation), 0 with "same"."""
    out_pad = as_values("output_padding", value, rank, 0)
    if explicit_padding(padding, rank) == "same":
        if set(out_pad) != {0}:
            raise ValueError(f"output_padding must be 0 with padding='same' (the output is input·stride), "
                             f"got {out_pad}")
        return out_pad
    for axis, p, s, d in zip(AXES[rank], out_pad, stride, dilation):
        if p >= max(s, d):
            raise ValueError(f"output_padding along {axis} must be smaller than max(stride, dilation) = "
                             f"{max(s, d)}, got {p}")
    return out_pad


def _split(shape, channels_last):
    """(N, C, sizes) of an image batch's shape."""
    return (shape[0], shape[-1], shape[1:-1]) if channels_last else (shape[0], shape[1], shape[2:])


def _check_padding_mode(mode, window, sizes):
    """PyTorch's bounds on the padding of a convolution's input of `sizes`: a reflected border is
    shorter than the input, a wrapped one at most as long, a replicated one needs an input."""
    if mode == "zeros":
        return
    for axis, n, pads in zip(AXES[window.rank], sizes, window.padding):
        if max(pads) == 0:
            continue
        if mode == "reflect" and max(pads) >= n:
            raise ValueError(f"padding_mode='reflect' needs padding smaller than the input along {axis} ({n}), "
                             f"got {pads[0]}+{pads[1]}")
        if mode == "circular" and max(pads) > n:
            raise ValueError(f"padding_mode='circular' needs padding at most the input along {axis} ({n}), "
                             f"got {pads[0]}+{pads[1]}")
        if mode == "replicate" and n == 0:
            raise ValueError(f"padding_mode='replicate' needs a non-empty input along {axis} to pad")


def resolve_nd(op, rank, arrays, stride, padding, dilation, groups, layout, output_padding, padding_mode):
    """Check one call of a 1-D or 3-D op; return (its arrays, converted where needed; NdCall)."""
    layout = as_rank_layout(layout, rank)
    padding_mode = as_padding_mode(padding_mode)
    names = array_names(op)
    given = dict(zip(names, arrays))
    dtype = common_dtype(given)
    checked = {name: None if value is None else c_array(name, value, dtype, 1 if name == "bias" else rank + 2)
               for name, value in given.items()}
    for name in ("x", "w") + (("dy",) if "dy" in names else ()):
        if checked[name] is None:
            raise TypeError(f"{name} must be an array of float32 or float64, got None")
    channels_last = layout in ("NLC", "NDHWC")
    x, w = checked["x"], checked["w"]
    n, c, sizes = _split(x.shape, channels_last)
    outer, inner, kernel = (w.shape[-1], w.shape[-2], w.shape[:-2]) if channels_last else (w.shape[0], w.shape[1],
                                                                                            w.shape[2:])
    transposed = op.startswith("conv_transpose")
    if transposed and padding_mode != "zeros":
        raise ValueError(f"padding_mode must be 'zeros' for a transposed convolution (as for torch's "
                         f"ConvTranspose{rank}d), got {padding_mode!r}")
    if transposed:
        if outer != c:
            raise ValueError(f"w has {outer} input channels (its {'last' if channels_last else 'first'} dimension) "
                             f"but x has {c}")
        groups = as_int("groups", groups)
        if c % groups:
            raise ValueError(f"groups={groups} must divide the input channels ({c})")
        f = inner * groups
    else:
        f = outer
        groups = groups_dividing(groups, c, f, "input channels", "output channels")
        if inner * groups != c:
            raise ValueError(f"w expects {inner} input channels per group ({inner * groups} in all with "
                             f"groups={groups}), but x has {c}")
    kernel = as_values("kernel_size", tuple(kernel), rank)
    window = NdWindow.resolve(kernel, stride, padding, dilation, sizes, transposed, padding_mode)
    if transposed:
        out_pad = as_output_padding_nd(output_padding, window.stride, window.dilation, padding, rank)
        if explicit_padding(padding, rank) == "same":
            out_pad = window.implicit_output_padding(sizes)
        out_sizes = window.transposed_output_size(sizes, out_pad)
    else:
        out_pad = (0,) * rank
        out_sizes = window.output_size(sizes)
    _check_padding_mode(padding_mode, window, sizes)
    call = NdCall(op, layout, dtype, n, c, tuple(sizes), f, out_sizes, groups, window, out_pad)
    if op.endswith("_backward"):
        if checked["dy"].shape != call.output_shape:
            raise ValueError(f"dy must have shape {call.output_shape} (the output of {op[:-9]}), "
                             f"got {checked['dy'].shape}")
    else:
        bias = checked["bias"]
        if bias is not None and bias.shape != (f,):
            raise ValueError(f"bias must have shape ({f},) (one per output channel), got {bias.shape}")
        check_new_array("the result", call.output_shape, dtype)
    return tuple(checked[name] for name in names), call


def _check_algorithm(call: NdCall, specialize, algorithm) -> tuple[bool, str]:
    """specialize and algorithm checked; a Winograd request refused in the op's own terms."""
    specialize, algorithm = as_flag("specialize", specialize), planner.as_algorithm(algorithm)
    if algorithm == "winograd" and (call.rank == 1 or not winograd_computes(call.window.lower()[1])):
        what = ("Winograd computes 2-D and 3-D windows only" if call.rank == 1 else
                f"Winograd computes 3-D windows whose height × width part is one of the {WINOGRAD_WINDOW_TEXT}, "
                f"with any depth")
        raise ValueError(f"algorithm='winograd' cannot compute {call.op} with window {call.window.short()}: "
                         f"{what}; use 'auto' or 'direct'")
    return specialize, algorithm


# ------------------------------------------------------------------------------------------ 1-D
def _row(a, layout):
    """An NCL/NLC array (or NCL-ordered weights) with a unit height axis: a view."""
    return a[:, :, np.newaxis] if layout == "NCL" else a[:, np.newaxis]


def _row_weights(w, layout):
    return w[:, :, np.newaxis] if layout == "NCL" else w[np.newaxis]


def _forward_1d(call, x, w, bias, out, keywords, fused):
    planar_op = ops.conv_transpose2d if call.transposed else ops.conv2d
    y = result_array("out", out, call.output_shape, call.dtype, (x, w, bias))
    if fused.get("residual") is not None:
        fused = dict(fused, residual=_row(fused["residual"], call.layout))
    planar_op(_row(x, call.layout), _row_weights(w, call.layout), bias, out=_row(y, call.layout), **keywords, **fused)
    return y


def _backward_1d(call, dy, x, w, out, keywords):
    planar_op = ops.conv_transpose2d_backward if call.transposed else ops.conv2d_backward
    dx, dw, db = _results(call, dy, x, w, out)
    planar_op(_row(dy, call.layout), _row(x, call.layout), _row_weights(w, call.layout),
              out=(_row(dx, call.layout), _row_weights(dw, call.layout), db), **keywords)
    return dx, dw, db


def _results(call, dy, x, w, out):
    out_dx, out_dw, out_db = split_out(out)
    inputs = (dy, x, w)
    return (result_array("out[0] (dx)", out_dx, x.shape, call.dtype, inputs),
            result_array("out[1] (dw)", out_dw, w.shape, call.dtype, inputs),
            result_array("out[2] (db)", out_db, (call.f,), call.dtype, inputs))


# ------------------------------------------------------------------------------------------ 3-D
def _fold(call) -> DepthFold:
    """The depth fold of the convolution that computes `call` (transposed: the one from its output back)."""
    depth = call.window.lower()[0]
    if call.transposed:
        return DepthFold(depth, call.out_sizes[0], call.sizes[0])
    return DepthFold(depth, call.sizes[0], call.out_sizes[0])


def _folded_weights(w, layout):
    """3-D weights as the 2-D weights of the folded channels: (F, C/g·KD, KH, KW), a view, in NCDHW;
    (KH, KW, KD·C/g, F), reordered, in NDHWC (see convgen.frontend.depthfold for the channel order)."""
    if layout == "NCDHW":
        outer, inner, kd, kh, kw = w.shape
        return w.reshape(outer, inner * kd, kh, kw)
    kd, kh, kw, inner, outer = w.shape
    return np.ascontiguousarray(w.transpose(1, 2, 0, 3, 4)).reshape(kh, kw, kd * inner, outer)


def _unfold_weights(dw2, layout, dw):
    """The inverse of `_folded_weights`, written into dw (nothing to do when dw2 is dw's view)."""
    if layout == "NDHWC":
        kd, kh, kw, inner, outer = dw.shape
        np.copyto(dw, dw2.reshape(kh, kw, kd, inner, outer).transpose(2, 0, 1, 3, 4))
    return dw


def _bias_view(bias, layout):
    return bias.reshape(-1, 1, 1, 1) if layout == "NCDHW" else bias


def _forward_3d(call, x, w, bias, out, keywords, fused):
    fold, layout = _fold(call), call.layout
    y = result_array("out", out, call.output_shape, call.dtype, (x, w, bias))
    w2 = _folded_weights(w, layout)
    if not call.transposed:
        x2 = fold.gather(x, layout, call.groups)
        planar_out = y.reshape(x2.shape[0], *y.shape[2:]) if layout == "NDHWC" else None  # a view
        if fused.get("residual") is not None:  # (as the output's depth slices: a view in NDHWC)
            fused = dict(fused, residual=slices_as_batch(fused["residual"], layout))
        y2 = ops.conv2d(x2, w2, bias, out=planar_out, **keywords, **fused)
        return batch_into_slices(y2, layout, y)
    # conv_transpose3d: conv_transpose2d of every depth slice onto the folded channels, then the
    # adjoint of the gather adds each folded channel into its output depth.
    y2 = ops.conv_transpose2d(slices_as_batch(x, layout), w2, None, **keywords)
    fold.scatter(y2, layout, call.groups, y)
    if bias is not None:
        y += _bias_view(bias, layout)
    return y


def _backward_3d(call, dy, x, w, out, keywords):
    fold, layout = _fold(call), call.layout
    dx, dw, db = _results(call, dy, x, w, out)
    w2 = _folded_weights(w, layout)
    dw2_out = dw.reshape(w2.shape) if layout == "NCDHW" else None  # a view
    if not call.transposed:
        dx2, dw2, _ = ops.conv2d_backward(slices_as_batch(dy, layout), fold.gather(x, layout, call.groups), w2,
                                          out=(None, dw2_out, db), **keywords)
        fold.scatter(dx2, layout, call.groups, dx)
    else:
        dx2_out = slices_as_batch(dx, layout) if layout == "NDHWC" else None
        dx2, dw2, _ = ops.conv_transpose2d_backward(fold.gather(dy, layout, call.groups), slices_as_batch(x, layout),
                                                    w2, out=(dx2_out, dw2_out, None), **keywords)
        batch_into_slices(dx2, layout, dx)
        np.add.reduce(dy, axis=(0, 2, 3, 4) if layout == "NCDHW" else (0, 1, 2, 3), out=db)
    _unfold_weights(dw2, layout, dw)
    return dx, dw, db


# ------------------------------------------------------------------------------------- the ops
def _fused(scale, activation, residual, residual_position) -> dict:
    """The epilogue keywords of a forward call, for the 2-D op that runs it."""
    if scale is None and activation is None and residual is None:
        return {}
    return dict(scale=scale, activation=activation, residual=residual, residual_position=residual_position)


def _forward(op, rank, x, w, bias, stride, padding, output_padding, dilation, groups, layout, specialize, algorithm,
             padding_mode, out, fused=None):
    (x, w, bias), call = resolve_nd(op, rank, (x, w, bias), stride, padding, dilation, groups, layout,
                                    output_padding, padding_mode)
    specialize, algorithm = _check_algorithm(call, specialize, algorithm)
    keywords = dict(call.planar_keywords(), specialize=specialize, algorithm=algorithm)
    fused = dict(fused or {})
    if fused.get("residual") is not None:
        fused["residual"] = ops.check_residual(fused["residual"], call.dtype, call.output_shape)
    return (_forward_1d if rank == 1 else _forward_3d)(call, x, w, bias, out, keywords, fused)


def _backward(op, rank, dy, x, w, stride, padding, output_padding, dilation, groups, layout, specialize, algorithm,
              padding_mode, out):
    (dy, x, w), call = resolve_nd(op, rank, (dy, x, w), stride, padding, dilation, groups, layout, output_padding,
                                  padding_mode)
    specialize, algorithm = _check_algorithm(call, specialize, algorithm)
    keywords = dict(call.planar_keywords(), specialize=specialize, algorithm=algorithm)
    return (_backward_1d if rank == 1 else _backward_3d)(call, dy, x, w, out, keywords)


@accepts_unbatched(1)
def conv1d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, layout="NCL", specialize=True,
           algorithm="auto", padding_mode="zeros", scale=None, activation=None, residual=None,
           residual_position="before", out=None):
    """1-D convolution (cross-correlation, as PyTorch's conv1d).

    x : (N, C, L) for layout "NCL", (N, L, C) for "NLC"; unbatched (C, L) / (L, C) gives an unbatched y.
    w : (F, C/groups, K) for "NCL", (K, C/groups, F) for "NLC".
    bias : optional (F,).
    stride, dilation : an int or a 1-sequence.
    padding : an int, (p,), ((before, after),), "valid" or "same".
    padding_mode : "zeros" (default), "reflect", "replicate" or "circular": what the border reads.
    groups, specialize, algorithm, out : as `convgen.conv2d`.
    scale, activation, residual, residual_position : the fused epilogue, as `convgen.conv2d`'s (the
        residual shaped as y).

    Returns y: (N, F, Lo) or (N, Lo, F), Lo = (L + before + after − d·(K − 1) − 1)//s + 1. Runs on the
    2-D kernel of the 1 × K window with a unit height axis (views of the arrays, no copies).
    """
    return _forward("conv1d", 1, x, w, bias, stride, padding, 0, dilation, groups, layout, specialize, algorithm,
                    padding_mode, out, _fused(scale, activation, residual, residual_position))


@accepts_unbatched(1)
def conv1d_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCL", specialize=True,
                    algorithm="auto", padding_mode="zeros", out=None):
    """Gradients (dx, dw, db) of conv1d given dy = ∂L/∂y; keywords as `conv1d`, `out` a (dx, dw, db) tuple."""
    return _backward("conv1d_backward", 1, dy, x, w, stride, padding, 0, dilation, groups, layout, specialize,
                     algorithm, padding_mode, out)


@accepts_unbatched(1)
def conv_transpose1d(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1, layout="NCL",
                     specialize=True, algorithm="auto", padding_mode="zeros", out=None):
    """Transposed 1-D convolution (PyTorch's conv_transpose1d): the input gradient of conv1d.

    x : (N, C_in, L) for "NCL", (N, L, C_in) for "NLC". w : (C_in, C_out/groups, K) for "NCL",
    (K, C_out/groups, C_in) for "NLC". output_padding : 0 <= op < max(stride, dilation). padding_mode :
    "zeros" only, as torch's ConvTranspose1d. The rest as `conv1d`. Returns y with
    Lo = (L − 1)·s − before − after + d·(K − 1) + op + 1.
    """
    return _forward("conv_transpose1d", 1, x, w, bias, stride, padding, output_padding, dilation, groups, layout,
                    specialize, algorithm, padding_mode, out)


@accepts_unbatched(1)
def conv_transpose1d_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                              layout="NCL", specialize=True, algorithm="auto", padding_mode="zeros", out=None):
    """Gradients (dx, dw, db) of conv_transpose1d given dy; keywords as `conv_transpose1d`."""
    return _backward("conv_transpose1d_backward", 1, dy, x, w, stride, padding, output_padding, dilation, groups,
                     layout, specialize, algorithm, padding_mode, out)


@accepts_unbatched(3)
def conv3d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, layout="NCDHW", specialize=True,
           algorithm="auto", padding_mode="zeros", scale=None, activation=None, residual=None,
           residual_position="before", out=None):
    """3-D convolution (cross-correlation, as PyTorch's conv3d).

    x : (N, C, D, H, W) for layout "NCDHW", (N, D, H, W, C) for "NDHWC"; unbatched (C, D, H, W) /
        (D, H, W, C) gives an unbatched y.
    w : (F, C/groups, KD, KH, KW) for "NCDHW", (KD, KH, KW, C/groups, F) for "NDHWC".
    stride, dilation : an int or a (d, h, w) sequence (a 1-sequence is expanded).
    padding : an int, (d, h, w) (each an int or a (before, after) pair), "valid" or "same".
    padding_mode, groups, specialize, algorithm, out : as `conv1d`. Winograd computes a 3×3 height ×
        width window at stride 1 without dilation, with any depth window.
    scale, activation, residual, residual_position : the fused epilogue, as `convgen.conv2d`'s.

    Returns y: (N, F, Do, Ho, Wo) or (N, Do, Ho, Wo, F). Runs on the 2-D kernel of the height × width
    window with the depth taps folded into the channels (`convgen.frontend.depthfold`: it copies the input
    KD/sd times over, and in NCDHW transposes the output once).
    """
    return _forward("conv3d", 3, x, w, bias, stride, padding, 0, dilation, groups, layout, specialize, algorithm,
                    padding_mode, out, _fused(scale, activation, residual, residual_position))


@accepts_unbatched(3)
def conv3d_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCDHW", specialize=True,
                    algorithm="auto", padding_mode="zeros", out=None):
    """Gradients (dx, dw, db) of conv3d given dy = ∂L/∂y; keywords as `conv3d`, `out` a (dx, dw, db) tuple."""
    return _backward("conv3d_backward", 3, dy, x, w, stride, padding, 0, dilation, groups, layout, specialize,
                     algorithm, padding_mode, out)


@accepts_unbatched(3)
def conv_transpose3d(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                     layout="NCDHW", specialize=True, algorithm="auto", padding_mode="zeros", out=None):
    """Transposed 3-D convolution (PyTorch's conv_transpose3d): the input gradient of conv3d.

    x : (N, C_in, D, H, W) for "NCDHW", (N, D, H, W, C_in) for "NDHWC". w : (C_in, C_out/groups, KD, KH,
    KW) for "NCDHW", (KD, KH, KW, C_out/groups, C_in) for "NDHWC". output_padding : an int or (d, h, w),
    each 0 <= op < max(stride, dilation). padding_mode : "zeros" only, as torch's ConvTranspose3d.
    The rest as `conv3d`.
    """
    return _forward("conv_transpose3d", 3, x, w, bias, stride, padding, output_padding, dilation, groups, layout,
                    specialize, algorithm, padding_mode, out)


@accepts_unbatched(3)
def conv_transpose3d_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                              layout="NCDHW", specialize=True, algorithm="auto", padding_mode="zeros", out=None):
    """Gradients (dx, dw, db) of conv_transpose3d given dy; keywords as `conv_transpose3d`."""
    return _backward("conv_transpose3d_backward", 3, dy, x, w, stride, padding, output_padding, dilation, groups,
                     layout, specialize, algorithm, padding_mode, out)


__all__ = ["conv1d", "conv1d_backward", "conv_transpose1d", "conv_transpose1d_backward", "conv3d", "conv3d_backward",
           "conv_transpose3d", "conv_transpose3d_backward", "NdCall", "resolve_nd", "as_output_padding_nd"]
