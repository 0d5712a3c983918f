"""Plain-NumPy reference implementations of convolution (the test oracle): 2-D, and 1-D and 3-D below.

Every compiled kernel in convgen is checked against this module, so it is written
to be *obviously* correct rather than fast, and it deliberately uses different
algorithms from the fast path (which is im2col + GEMM / col2im):

* ``conv2d`` gathers: for each output position it takes the receptive field of the
  zero-padded input and contracts it with the weights (CS231n "naive" style).
* ``conv_transpose2d`` scatters: for each input position it adds the input value
  times the kernel into an output canvas, then crops the padding away.
* The backward passes are written out as their own loops, not by calling the
  forward functions.

All loops run over spatial positions only; batch, groups and channels are vectorized
(one ``numpy.matmul`` over the stack of groups per position).  Computation happens in
float64 and the result is cast back to ``numpy.result_type`` of the inputs
(integer/bool inputs give float64).

This module imports nothing from convgen: it has its own argument normalization
and shape arithmetic, so a bug there cannot hide a bug in the fast path.

Conventions (PyTorch semantics; TensorFlow weight layouts for NHWC):

==========  ==============  ===========================  ================================
layout      activations     conv2d weight                conv_transpose2d weight
==========  ==============  ===========================  ================================
``NCHW``    (N, C, H, W)    (F, C/groups, KH, KW)        (C_in, C_out/groups, KH, KW)
``NHWC``    (N, H, W, C)    (KH, KW, C/groups, F)        (KH, KW, C_out/groups, C_in)
==========  ==============  ===========================  ================================

``stride`` and ``dilation`` are an int or an (h, w) pair.  ``padding`` is an int,
an (h, w) pair (symmetric), ``((top, bottom), (left, right))``, ``"valid"`` or
``"same"`` (TensorFlow's rule; see :func:`resolve_padding`).  ``conv2d`` and
``conv2d_backward`` take PyTorch's ``padding_mode`` too (see :func:`pad`).
"""

import math
import operator

import numpy as np

__all__ = [
    "conv2d",
    "conv2d_backward",
    "conv_transpose2d",
    "conv_transpose2d_backward",
    "conv2d_output_size",
    "conv_transpose2d_output_size",
    "resolve_padding",
    "pad",
    "pad_adjoint",
    "epilogue",
]

_LAYOUTS = ("NCHW", "NHWC")


# --------------------------------------------------------------------------
# Shape arithmetic
# --------------------------------------------------------------------------

def conv2d_output_size(in_size, k, stride, pad_before, pad_after, dilation):
    """Output length of a convolution along one spatial dimension.

    ``(in + pad_before + pad_after - dilation*(k-1) - 1) // stride + 1``.
    The result may be zero or negative for impossible configurations; callers
    decide whether that is an error.
    """
    span = dilation * (k - 1) + 1  # extent of the dilated kernel
    return (in_size + pad_before + pad_after - span) // stride + 1


def conv_transpose2d_output_size(in_size, k, stride, pad_before, pad_after,
                                 dilation, output_padding):
    """Output length of a transposed convolution along one spatial dimension.

    ``(in - 1)*stride - pad_before - pad_after + dilation*(k-1) + output_padding + 1``
    (PyTorch's formula).
    """
    return ((in_size - 1) * stride - pad_before - pad_after
            + dilation * (k - 1) + output_padding + 1)


def _same_pads_1d(in_size, k, stride, dilation, transposed):
    """(before, after) padding for ``"same"`` along one dimension.

    Forward (TensorFlow): ``out = ceil(in / s)``,
    ``total = max((out - 1)*s + d*(k - 1) + 1 - in, 0)``.
    Transposed: the forward rule applied to the *output* of size ``in*s``,
    i.e. ``total = max((in - 1)*s + d*(k - 1) + 1 - in*s, 0)``.
    The extra odd pixel goes after (bottom/right).
    """
    span = dilation * (k - 1) + 1
    if transposed:
        total = max((in_size - 1) * stride + span - in_size * stride, 0)
    else:
        out = -(-in_size // stride)  # ceil division
        total = max((out - 1) * stride + span - in_size, 0)
    before = total // 2
    return before, total - before


def _same_transpose_output_padding_1d(in_size, k, stride, dilation):
    """Implicit output_padding that makes a ``"same"`` transposed conv output ``in*s``."""
    before, after = _same_pads_1d(in_size, k, stride, dilation, transposed=True)
    total = before + after
    return in_size * stride - ((in_size - 1) * stride - total + dilation * (k - 1) + 1)


def _as_int(value, name):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {value!r}") from None


def _pair(value, name):
    """Normalize an int or an (h, w) pair to a tuple of two ints."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name}: expected an int or an (h, w) pair, got {value!r}")
        return (_as_int(value[0], name), _as_int(value[1], name))
    v = _as_int(value, name)
    return (v, v)


def _positive_pair(value, name):
    pair = _pair(value, name)
    if pair[0] < 1 or pair[1] < 1:
        raise ValueError(f"{name}: expected positive values, got {value!r}")
    return pair


def resolve_padding(padding, in_hw, k_hw, stride_hw, dilation_hw, transposed=False):
    """Normalize ``padding`` to ``((top, bottom), (left, right))``.

    Accepted forms: an int (all four sides), an (h, w) pair (symmetric per
    dimension), an explicit ``((top, bottom), (left, right))``, or the strings
    ``"valid"`` (no padding) and ``"same"`` (case-insensitive).

    ``in_hw`` is the spatial size of the op's input (for a transposed conv,
    its input, i.e. the smaller side).  With ``"same"`` a forward conv gives
    ``ceil(in / stride)`` outputs and a transposed conv gives ``in * stride``
    (the latter also needs the implicit output_padding that
    :func:`conv_transpose2d` adds itself).
    """
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return ((0, 0), (0, 0))
        if mode == "same":
            return tuple(
                _same_pads_1d(in_hw[a], k_hw[a], stride_hw[a], dilation_hw[a], transposed)
                for a in range(2)
            )
        raise ValueError(f"padding: expected 'same' or 'valid', got {padding!r}")

    if isinstance(padding, (tuple, list)):
        if len(padding) != 2:
            raise ValueError(
                "padding: expected an int, (h, w), ((top, bottom), (left, right)), "
                f"'same' or 'valid', got {padding!r}")
        if all(isinstance(p, (tuple, list)) for p in padding):
            pads = tuple(_pair(p, "padding") for p in padding)
        elif not any(isinstance(p, (tuple, list)) for p in padding):
            ph, pw = _pair(padding, "padding")
            pads = ((ph, ph), (pw, pw))
        else:
            raise ValueError(f"padding: cannot mix ints and pairs, got {padding!r}")
    else:
        p = _as_int(padding, "padding")
        pads = ((p, p), (p, p))

    if min(pads[0] + pads[1]) < 0:
        raise ValueError(f"padding: expected non-negative values, got {padding!r}")
    return pads


# --------------------------------------------------------------------------
# Padding modes
# --------------------------------------------------------------------------

# PyTorch's padding_mode names and the np.pad mode of each.
_NUMPY_PAD_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _check_padding_mode(padding_mode, pads, in_hw):
    """PyTorch's rules: a known mode; reflect pads less than the input, circular at most the input,
    replicate needs an input to repeat (per axis, where it pads at all)."""
    if padding_mode not in _NUMPY_PAD_MODES:
        raise ValueError(f"padding_mode: expected one of {tuple(_NUMPY_PAD_MODES)}, got {padding_mode!r}")
    for (before, after), n in zip(pads, in_hw):
        most = max(before, after)
        if most == 0:
            continue
        if padding_mode == "reflect" and most >= n:
            raise ValueError(f"padding: reflect padding {(before, after)} must be smaller than the input size {n}")
        if padding_mode == "circular" and most > n:
            raise ValueError(f"padding: circular padding {(before, after)} must be at most the input size {n}")
        if padding_mode == "replicate" and n == 0:
            raise ValueError(f"padding: replicate padding {(before, after)} of an empty input")


def pad(x, pads, padding_mode="zeros"):
    """NCHW ``x`` padded by ``pads = ((top, bottom), (left, right))`` as PyTorch's ``padding_mode``
    fills it: zeros, reflect (numpy's "reflect": the edge is not repeated), replicate ("edge") or
    circular ("wrap")."""
    mode = _NUMPY_PAD_MODES[padding_mode]
    return np.pad(x, ((0, 0), (0, 0)) + tuple(pads), mode=mode)


def _source_indices(n, before, after, padding_mode):
    """For each position of a padded axis, the input index ``pad`` copied there (-1: a zero).

    Found by padding the indices themselves, so it is the same rule as ``pad``'s."""
    indices = np.arange(n)
    if padding_mode == "zeros":
        return np.pad(indices, (before, after), constant_values=-1)
    return np.pad(indices, (before, after), mode=_NUMPY_PAD_MODES[padding_mode])


def pad_adjoint(dxpad, pads, in_hw, padding_mode="zeros"):
    """The adjoint of :func:`pad`: every element of the padded gradient ``dxpad`` is added into
    the input element it was copied from (dropped where the padding was zeros)."""
    out = dxpad
    for axis, (before, after), n in zip((2, 3), pads, in_hw):
        source = _source_indices(n, before, after, padding_mode)
        shape = list(out.shape)
        shape[axis] = n
        folded = np.zeros(shape)
        keep = source >= 0
        index = [slice(None)] * 4
        index[axis] = source[keep]
        taken = np.compress(keep, out, axis=axis)
        np.add.at(folded, tuple(index), taken)
        out = folded
    return out


# --------------------------------------------------------------------------
# Layout and dtype helpers
# --------------------------------------------------------------------------

def _check_layout(layout):
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected one of {_LAYOUTS}, got {layout!r}")


def _check_4d(a, name):
    if a.ndim != 4:
        raise ValueError(f"{name}: expected a 4-D array, got shape {a.shape}")


def _act_to_nchw(a, layout):
    """Activations in ``layout`` -> float64 NCHW copy."""
    a = np.asarray(a)
    if layout == "NHWC":
        a = a.transpose(0, 3, 1, 2)
    return np.array(a, dtype=np.float64)  # always a copy: inputs are never touched


def _act_from_nchw(a, layout, dtype):
    if layout == "NHWC":
        a = a.transpose(0, 2, 3, 1)
    return np.ascontiguousarray(a, dtype=dtype)


def _weight_to_torch(w, layout):
    """Weights in ``layout`` -> float64 PyTorch order (out-ish, in-ish, KH, KW).

    For both conv2d (KH, KW, C/g, F) -> (F, C/g, KH, KW) and conv_transpose2d
    (KH, KW, C_out/g, C_in) -> (C_in, C_out/g, KH, KW) the permutation is the same.
    """
    w = np.asarray(w)
    if layout == "NHWC":
        w = w.transpose(3, 2, 0, 1)
    return np.array(w, dtype=np.float64)


def _weight_from_torch(w, layout, dtype):
    if layout == "NHWC":
        w = w.transpose(2, 3, 1, 0)
    return np.ascontiguousarray(w, dtype=dtype)


def _result_dtype(*arrays):
    dtype = np.result_type(*[np.asarray(a) for a in arrays if a is not None])
    if not np.issubdtype(dtype, np.floating):
        dtype = np.dtype(np.float64)
    return dtype


# --------------------------------------------------------------------------
# Geometry: everything a loop needs, computed once per call
# --------------------------------------------------------------------------

def _conv2d_geometry(x_shape, w_shape, stride, padding, dilation, groups):
    """Validate a conv2d (NCHW / PyTorch weights) and return its sizes."""
    N, C, H, W = x_shape
    F, Cg, KH, KW = w_shape
    groups = _as_int(groups, "groups")
    if groups < 1:
        raise ValueError(f"groups: expected a positive int, got {groups}")
    if C % groups or F % groups:
        raise ValueError(
            f"groups: input channels ({C}) and output channels ({F}) must both be "
            f"divisible by groups ({groups})")
    if Cg != C // groups:
        raise ValueError(
            f"w: expected {C // groups} input channels per group "
            f"(C={C}, groups={groups}), got weight shape {w_shape}")
    if KH < 1 or KW < 1:
        raise ValueError(f"w: kernel size must be positive, got {(KH, KW)}")
    sh, sw = _positive_pair(stride, "stride")
    dh, dw = _positive_pair(dilation, "dilation")
    (top, bottom), (left, right) = resolve_padding(
        padding, (H, W), (KH, KW), (sh, sw), (dh, dw), transposed=False)
    Ho = conv2d_output_size(H, KH, sh, top, bottom, dh)
    Wo = conv2d_output_size(W, KW, sw, left, right, dw)
    if Ho < 1 or Wo < 1:
        raise ValueError(
            f"conv2d: output size {(Ho, Wo)} is not positive for input {(H, W)}, "
            f"kernel {(KH, KW)}, stride {(sh, sw)}, padding {((top, bottom), (left, right))}, "
            f"dilation {(dh, dw)}")
    return dict(N=N, C=C, H=H, W=W, F=F, KH=KH, KW=KW, sh=sh, sw=sw, dh=dh, dw=dw,
                top=top, bottom=bottom, left=left, right=right, Ho=Ho, Wo=Wo,
                groups=groups)


def _conv_transpose2d_geometry(x_shape, w_shape, stride, padding, output_padding,
                               dilation, groups):
    """Validate a conv_transpose2d (NCHW / PyTorch weights) and return its sizes."""
    N, Cin, H, W = x_shape
    Cin_w, Cog, KH, KW = w_shape
    groups = _as_int(groups, "groups")
    if groups < 1:
        raise ValueError(f"groups: expected a positive int, got {groups}")
    if Cin_w != Cin:
        raise ValueError(
            f"w: expected {Cin} input channels (dimension C_in of the weight), "
            f"got weight shape {w_shape}")
    if Cin % groups:
        raise ValueError(f"groups: input channels ({Cin}) must be divisible by groups ({groups})")
    if KH < 1 or KW < 1 or Cog < 1:
        raise ValueError(f"w: kernel and channel sizes must be positive, got shape {w_shape}")
    Cout = Cog * groups
    sh, sw = _positive_pair(stride, "stride")
    dh, dw = _positive_pair(dilation, "dilation")
    oph, opw = _pair(output_padding, "output_padding")
    for op, s, d, axis in ((oph, sh, dh, "h"), (opw, sw, dw, "w")):
        if not 0 <= op < max(s, d):
            raise ValueError(
                f"output_padding: must satisfy 0 <= output_padding < max(stride, dilation) "
                f"per dimension; got {op} along {axis} with stride {s}, dilation {d}")
    (top, bottom), (left, right) = resolve_padding(
        padding, (H, W), (KH, KW), (sh, sw), (dh, dw), transposed=True)
    if isinstance(padding, str) and padding.lower() == "same":
        if (oph, opw) != (0, 0):
            raise ValueError(
                f"output_padding: must be 0 with padding='same', got {output_padding!r}")
        oph = _same_transpose_output_padding_1d(H, KH, sh, dh)
        opw = _same_transpose_output_padding_1d(W, KW, sw, dw)
    Ho = conv_transpose2d_output_size(H, KH, sh, top, bottom, dh, oph)
    Wo = conv_transpose2d_output_size(W, KW, sw, left, right, dw, opw)
    if Ho < 1 or Wo < 1:
        raise ValueError(
            f"conv_transpose2d: output size {(Ho, Wo)} is not positive for input {(H, W)}, "
            f"kernel {(KH, KW)}, stride {(sh, sw)}, padding {((top, bottom), (left, right))}, "
            f"dilation {(dh, dw)}, output_padding {(oph, opw)}")
    # The scatter canvas holds every position a (input pixel, tap) pair can reach,
    # and is extended with zeros when output_padding reaches past it.
    canvas_h = max((H - 1) * sh + dh * (KH - 1) + 1, top + Ho)
    canvas_w = max((W - 1) * sw + dw * (KW - 1) + 1, left + Wo)
    return dict(N=N, Cin=Cin, H=H, W=W, Cout=Cout, KH=KH, KW=KW, sh=sh, sw=sw,
                dh=dh, dw=dw, top=top, bottom=bottom, left=left, right=right,
                Ho=Ho, Wo=Wo, groups=groups, canvas_h=canvas_h, canvas_w=canvas_w)


def _window(g, h0, w0):
    """Index tuple (spatial part) of the dilated kernel window anchored at (h0, w0)."""
    return (slice(h0, h0 + g["dh"] * (g["KH"] - 1) + 1, g["dh"]),
            slice(w0, w0 + g["dw"] * (g["KW"] - 1) + 1, g["dw"]))


def _positions(g, rows, cols):
    """(row, col, window) for every position of a rows × cols grid: the strided window it meets."""
    for r in range(rows):
        for c in range(cols):
            yield r, c, _window(g, r * g["sh"], c * g["sw"])


def _by_group(a, groups):
    """`a` (N, C, ...) channels-first as a stack of its groups: (groups, N, C / groups × the rest)."""
    return a.reshape(a.shape[0], groups, math.prod(a.shape[1:]) // groups).transpose(1, 0, 2)


def _weights_by_group(w, groups):
    """Weights (groups × A, B, *K) as a stack of their groups: (groups, A, B × prod(K))."""
    return w.reshape(groups, w.shape[0] // groups, math.prod(w.shape[1:]))


def _from_groups(stack, shape):
    """A (groups, N, X) stack of per-group results as one channels-first array of `shape`."""
    return stack.transpose(1, 0, 2).reshape(shape)


_ALL = (slice(None), slice(None))  # batch and channels, in front of a window's spatial slices


# --------------------------------------------------------------------------
# conv2d
# --------------------------------------------------------------------------

def _bias64(bias, channels):
    """The bias as float64 of shape (channels,), zeros when there is none."""
    if bias is None:
        return np.zeros(channels)
    b64 = np.array(np.asarray(bias), dtype=np.float64)
    if b64.shape != (channels,):
        raise ValueError(f"bias: expected shape {(channels,)}, got {b64.shape}")
    return b64


def _float64_inputs(layout, bias, **arrays):
    """(result dtype, the arrays as float64 NCHW, w in PyTorch's weight order): each checked 4-D."""
    _check_layout(layout)
    given = {name: np.asarray(value) for name, value in arrays.items()}
    for name, value in given.items():
        _check_4d(value, name)
    dtype = _result_dtype(*given.values(), bias)
    return (dtype, *(_weight_to_torch(value, layout) if name == "w" else _act_to_nchw(value, layout)
                     for name, value in given.items()))


def conv2d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW",
           padding_mode="zeros", scale=None, activation=None, residual=None, residual_position="before"):
    """2-D cross-correlation (PyTorch ``conv2d`` semantics).

    ``y[n, f, oh, ow] = bias[f] + sum_{c, i, j} w[f, c, i, j] *
    xpad[n, g*Cg + c, oh*sh + i*dh, ow*sw + j*dw]`` where ``g = f // (F/groups)``
    and ``xpad`` is ``x`` padded by (top, bottom, left, right) as ``padding_mode``
    says (PyTorch's ``nn.Conv2d``): "zeros", "reflect", "replicate" or "circular".

    With ``scale`` (F,) the sum is multiplied by ``scale[f]`` before the bias is
    added; ``activation``, ``residual`` and ``residual_position`` then apply
    :func:`epilogue` to the result (in float64, before the cast to the result dtype).

    Returns ``y`` of shape (N, F, Ho, Wo) for NCHW or (N, Ho, Wo, F) for NHWC.
    """
    dtype, x64, w64 = _float64_inputs(layout, bias, x=x, w=w)
    g = _conv2d_geometry(x64.shape, w64.shape, stride, padding, dilation, groups)
    F, G = g["F"], g["groups"]

    b64 = _bias64(bias, F)

    pads = ((g["top"], g["bottom"]), (g["left"], g["right"]))
    _check_padding_mode(padding_mode, pads, (g["H"], g["W"]))
    xpad = pad(x64, pads, padding_mode)
    y = np.empty((g["N"], F, g["Ho"], g["Wo"]))
    w_groups = _weights_by_group(w64, G).transpose(0, 2, 1)        # (G, Cg·KH·KW, Fg)
    for oh, ow, win in _positions(g, g["Ho"], g["Wo"]):
        # each group's (N, Cg·KH·KW) receptive field times its weights -> (N, Fg)
        y[:, :, oh, ow] = _from_groups(_by_group(xpad[_ALL + win], G) @ w_groups, (g["N"], F))
    if scale is not None:
        y *= _bias64(scale, F)[None, :, None, None]
    y += b64[None, :, None, None]
    if residual is not None:
        residual = _act_to_nchw(residual, layout)
        if residual.shape != y.shape:
            raise ValueError(f"residual: expected the output's shape, got {np.shape(residual)}")
    y = epilogue(y, activation, residual, residual_position)
    return _act_from_nchw(y, layout, dtype)


# The activations by name, each on a float64 array (PyTorch's functions; gelu is the exact one).
def _gelu(v):
    return 0.5 * v * (1.0 + np.frompyfunc(math.erf, 1, 1)(v / math.sqrt(2.0)).astype(np.float64))


_ACTIVATIONS = {
    "relu": lambda v: np.where(v < 0, 0.0, v),
    "silu": lambda v: v / (1.0 + np.exp(-v)),
    "hardswish": lambda v: v * np.where(v + 3 < 0, 0.0, np.where(v + 3 > 6, 6.0, v + 3)) / 6.0,
    "gelu": _gelu,
    "gelu_tanh": lambda v: 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3))),
    "sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
}


def _activation(v, activation):
    """``v`` (float64) through ``activation``: None, a name, or (name, parameters...)."""
    if activation is None:
        return v
    name, params = (activation[0], tuple(activation[1:])) if isinstance(activation, tuple) else (activation, ())
    if name in ("none", "identity", "linear"):
        return v
    if name == "relu6":
        name, params = "clamp", (0.0, 6.0)
    elif name == "hardtanh":
        name, params = "clamp", (-1.0, 1.0)
    if name == "clamp":
        low = params[0] if len(params) > 0 and params[0] is not None else -np.inf
        high = params[1] if len(params) > 1 and params[1] is not None else np.inf
        return np.where(v < low, low, np.where(v > high, high, v))  # NaN stays NaN (as torch.clamp)
    if name == "leaky_relu":
        slope = params[0] if params else 0.01
        return np.where(v < 0, v * slope, v)
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name](v)
    raise ValueError(f"activation: unknown {activation!r}")


def epilogue(y, activation=None, residual=None, residual_position="before"):
    """What a fused convolution does to its output ``y`` (float64 here): ``residual``
    added before the activation (``residual_position="before"``: ``act(y + r)``) or
    after it (``act(y) + r``). ``activation`` is None, a name ("relu", "relu6", "clamp",
    "leaky_relu", "silu", "hardswish", "gelu", "gelu_tanh", "sigmoid") or a tuple of
    a name and its parameters (``("leaky_relu", 0.2)``, ``("clamp", min, max)``),
    each as PyTorch's function of that name computes it."""
    y = np.array(y, dtype=np.float64)
    r = None if residual is None else np.asarray(residual, dtype=np.float64)
    if residual_position not in ("before", "after"):
        raise ValueError(f"residual_position: expected 'before' or 'after', got {residual_position!r}")
    with np.errstate(over="ignore", invalid="ignore"):
        if r is not None and residual_position == "before":
            y = y + r
        y = _activation(y, activation)
        if r is not None and residual_position == "after":
            y = y + r
    return y


def conv2d_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW",
                    padding_mode="zeros"):
    """Gradients of ``sum(conv2d(x, w, b) * dy)`` with respect to x, w and b.

    Returns ``(dx, dw, db)`` with the shapes (and layout) of ``x``, ``w`` and (F,).
    For every output position: ``db += dy``, ``dw += dy^T . field`` and the
    field-shaped ``dy . w`` is scatter-added into a padded canvas, which is
    finally folded back onto the input by the adjoint of the padding
    (:func:`pad_adjoint`: cropped for zeros; for the other modes the border
    is added into the input pixels it copied).
    """
    dtype, dy64, x64, w64 = _float64_inputs(layout, None, dy=dy, x=x, w=w)
    g = _conv2d_geometry(x64.shape, w64.shape, stride, padding, dilation, groups)
    N, H, W, F, G = g["N"], g["H"], g["W"], g["F"], g["groups"]
    pads = ((g["top"], g["bottom"]), (g["left"], g["right"]))
    _check_padding_mode(padding_mode, pads, (H, W))
    if dy64.shape != (N, F, g["Ho"], g["Wo"]):
        raise ValueError(
            f"dy: expected NCHW-equivalent shape {(N, F, g['Ho'], g['Wo'])}, got {dy64.shape}")

    xpad = pad(x64, pads, padding_mode)
    dxpad = np.zeros_like(xpad)
    dw64 = np.zeros_like(w64)
    db64 = np.zeros(F)
    w_groups = _weights_by_group(w64, G)                            # (G, Fg, Cg·KH·KW)
    for oh, ow, win in _positions(g, g["Ho"], g["Wo"]):
        field = xpad[_ALL + win]                                    # (N, C, KH, KW)
        grad = dy64[:, :, oh, ow]                                   # (N, F)
        db64 += grad.sum(axis=0)
        field_groups, grad_groups = _by_group(field, G), _by_group(grad, G)
        # per group: (Fg, N) x (N, Cg·KH·KW) -> (Fg, Cg, KH, KW)
        dw64 += (grad_groups.transpose(0, 2, 1) @ field_groups).reshape(dw64.shape)
        # per group: (N, Fg) x (Fg, Cg·KH·KW) -> (N, Cg, KH, KW)
        dxpad[_ALL + win] += _from_groups(grad_groups @ w_groups, field.shape)
    dx64 = pad_adjoint(dxpad, pads, (H, W), padding_mode)
    return (_act_from_nchw(dx64, layout, dtype),
            _weight_from_torch(dw64, layout, dtype),
            db64.astype(dtype))


# --------------------------------------------------------------------------
# conv_transpose2d
# --------------------------------------------------------------------------

def conv_transpose2d(x, w, bias=None, *, stride=1, padding=0, output_padding=0,
                     dilation=1, groups=1, layout="NCHW"):
    """Transposed 2-D convolution (PyTorch ``conv_transpose2d`` semantics).

    The adjoint of :func:`conv2d` with respect to its input.  Computed as a
    scatter-add: every input value ``x[n, c, h, w]`` adds ``x * w[c, f, :, :]``
    into a canvas at rows ``h*sh + i*dh`` and columns ``w*sw + j*dw``; the output
    is the canvas with ``top`` rows and ``left`` columns cropped, Ho x Wo in size
    (``output_padding`` extends the canvas with zeros at the bottom/right).

    Weights: NCHW (C_in, C_out/groups, KH, KW); NHWC (KH, KW, C_out/groups, C_in).
    ``padding="same"`` gives an output of exactly ``in * stride`` per dimension.
    """
    dtype, x64, w64 = _float64_inputs(layout, bias, x=x, w=w)
    g = _conv_transpose2d_geometry(x64.shape, w64.shape, stride, padding,
                                   output_padding, dilation, groups)
    Cout, G = g["Cout"], g["groups"]

    b64 = _bias64(bias, Cout)

    canvas = np.zeros((g["N"], Cout, g["canvas_h"], g["canvas_w"]))
    w_groups = _weights_by_group(w64, G)                            # (G, Cig, Cog·KH·KW)
    for h, w_, win in _positions(g, g["H"], g["W"]):
        target = canvas[_ALL + win]                                 # (N, Cout, KH, KW), a view
        # per group: (N, Cig) x (Cig, Cog·KH·KW) -> (N, Cog, KH, KW)
        target += _from_groups(_by_group(x64[:, :, h, w_], G) @ w_groups, target.shape)
    top, left = g["top"], g["left"]
    y = canvas[:, :, top:top + g["Ho"], left:left + g["Wo"]] + b64[None, :, None, None]
    return _act_from_nchw(y, layout, dtype)


def conv_transpose2d_backward(dy, x, w, *, stride=1, padding=0, output_padding=0,
                              dilation=1, groups=1, layout="NCHW"):
    """Gradients of ``sum(conv_transpose2d(x, w, b) * dy)`` w.r.t. x, w and b.

    Returns ``(dx, dw, db)`` with the shapes (and layout) of ``x``, ``w`` and
    (C_out,).  ``dy`` is placed into the zero canvas used by the forward
    scatter; for every input position the canvas window it scattered into is
    gathered back: ``dx = window . w`` and ``dw += x^T . window``.
    """
    dtype, dy64, x64, w64 = _float64_inputs(layout, None, dy=dy, x=x, w=w)
    g = _conv_transpose2d_geometry(x64.shape, w64.shape, stride, padding,
                                   output_padding, dilation, groups)
    N, Cout, G = g["N"], g["Cout"], g["groups"]
    if dy64.shape != (N, Cout, g["Ho"], g["Wo"]):
        raise ValueError(
            f"dy: expected NCHW-equivalent shape {(N, Cout, g['Ho'], g['Wo'])}, got {dy64.shape}")

    top, left = g["top"], g["left"]
    dcanvas = np.zeros((N, Cout, g["canvas_h"], g["canvas_w"]))
    dcanvas[:, :, top:top + g["Ho"], left:left + g["Wo"]] = dy64

    dx64 = np.zeros_like(x64)
    dw64 = np.zeros_like(w64)
    w_groups = _weights_by_group(w64, G)                            # (G, Cig, Cog·KH·KW)
    for h, w_, win in _positions(g, g["H"], g["W"]):
        field_groups = _by_group(dcanvas[_ALL + win], G)            # (G, N, Cog·KH·KW)
        x_groups = _by_group(x64[:, :, h, w_], G)                   # (G, N, Cig)
        # per group: (N, Cog·KH·KW) . (Cig, Cog·KH·KW) -> (N, Cig)
        dx64[:, :, h, w_] = _from_groups(field_groups @ w_groups.transpose(0, 2, 1), (N, g["Cin"]))
        # per group: (Cig, N) x (N, Cog·KH·KW) -> (Cig, Cog, KH, KW)
        dw64 += (x_groups.transpose(0, 2, 1) @ field_groups).reshape(dw64.shape)
    db64 = dy64.sum(axis=(0, 2, 3))
    return (_act_from_nchw(dx64, layout, dtype),
            _weight_from_torch(dw64, layout, dtype),
            db64.astype(dtype))


# --------------------------------------------------------------------------
# 1-D and 3-D convolution (one rank-generic implementation), with padding modes
# --------------------------------------------------------------------------
#
# The same conventions one rank down and up: layouts NCL / NLC and NCDHW / NDHWC, weights
# (F, C/groups, *K) channels-first and (*K, C/groups, F) channels-last (transposed: C_in and
# C_out/groups in their places).  ``padding`` is an int, a sequence of one value (expanded) or one
# per axis (each an int or a (before, after) pair), "valid" or "same".  ``padding_mode`` says what
# the border holds: "zeros", "reflect" (mirrored without repeating the edge), "replicate" (the edge
# repeated) or "circular" (wrapped around).  The padded input is built explicitly here, by index
# arrays, and its adjoint folds a padded gradient back onto the positions each border value came
# from; a transposed convolution's output is that fold of its scatter canvas.

_ND_LAYOUTS = {1: ("NCL", "NLC"), 3: ("NCDHW", "NDHWC")}
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

__all__ += ["conv1d", "conv1d_backward", "conv_transpose1d", "conv_transpose1d_backward",
            "conv3d", "conv3d_backward", "conv_transpose3d", "conv_transpose3d_backward"]


def _per_axis(value, rank, name, minimum):
    """An int or a sequence of 1 (expanded) or `rank` ints, each >= minimum, as a tuple."""
    if isinstance(value, (tuple, list)):
        if len(value) not in (1, rank):
            raise ValueError(f"{name}: expected an int or {rank} values, got {value!r}")
        values = tuple(_as_int(v, name) for v in value) * (rank if len(value) == 1 else 1)
    else:
        values = (_as_int(value, name),) * rank
    if min(values) < minimum:
        raise ValueError(f"{name}: expected values >= {minimum}, got {value!r}")
    return values


def _nd_pads(padding, rank, sizes, kernel, stride, dilation, transposed):
    """One (before, after) pair per axis."""
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return ((0, 0),) * rank
        if mode == "same":
            return tuple(_same_pads_1d(n, k, s, d, transposed)
                         for n, k, s, d in zip(sizes, kernel, stride, dilation))
        raise ValueError(f"padding: expected 'same' or 'valid', got {padding!r}")
    items = padding if isinstance(padding, (tuple, list)) else (padding,)
    if len(items) not in (1, rank):
        raise ValueError(f"padding: expected an int or {rank} values, got {padding!r}")
    pads = tuple(_pair(item, "padding") if isinstance(item, (tuple, list)) else (_as_int(item, "padding"),) * 2
                 for item in items)
    pads = pads * (rank if len(pads) == 1 else 1)
    if min(min(p) for p in pads) < 0:
        raise ValueError(f"padding: expected non-negative values, got {padding!r}")
    return pads


def _border_source(i, n, mode):
    """Which of n positions the padded position i (counted from the first real one) holds; -1 for zero."""
    if 0 <= i < n:
        return i
    if mode == "zeros":
        return -1
    if mode == "replicate":
        return 0 if i < 0 else n - 1
    if mode == "circular":
        return i % n
    mirrored = -i if i < 0 else 2 * (n - 1) - i  # reflect: mirror at the end it passed
    if not 0 <= mirrored < n:
        raise ValueError(f"padding_mode='reflect': position {i} is beyond one reflection of size {n}")
    return mirrored


def _border_indices(n, before, after, mode):
    """Index array of a padded axis: the source position of each padded position, n for a zero."""
    return np.array([n if s < 0 else s for s in
                     (_border_source(i - before, n, mode) for i in range(before + n + after))], dtype=np.intp)


def _pad_nd(a, pads, mode):
    """a (N, C, *sizes) padded along every spatial axis (a new array)."""
    for axis, (before, after) in enumerate(pads, start=2):
        n = a.shape[axis]
        zero = np.zeros(a.shape[:axis] + (1,) + a.shape[axis + 1:])
        a = np.take(np.concatenate([a, zero], axis=axis), _border_indices(n, before, after, mode), axis=axis)
    return a


def _unpad_nd(apad, pads, sizes, mode):
    """The adjoint of `_pad_nd`: each padded position added onto the position it holds."""
    for axis, ((before, after), n) in enumerate(zip(pads, sizes), start=2):
        moved = np.moveaxis(apad, axis, 0)
        folded = np.zeros((n + 1,) + moved.shape[1:])
        for i, src in enumerate(_border_indices(n, before, after, mode)):
            folded[src] += moved[i]
        apad = np.moveaxis(folded[:n], 0, axis)
    return apad


def _nd_arrays(rank, layout, bias, **arrays):
    """(result dtype, the arrays as float64 channels-first copies, weights in PyTorch's order)."""
    if layout not in _ND_LAYOUTS[rank]:
        raise ValueError(f"layout: expected one of {_ND_LAYOUTS[rank]}, got {layout!r}")
    given = {name: np.asarray(value) for name, value in arrays.items()}
    for name, value in given.items():
        if value.ndim != rank + 2:
            raise ValueError(f"{name}: expected a {rank + 2}-D array, got shape {value.shape}")
    dtype = _result_dtype(*given.values(), bias)
    last = layout == _ND_LAYOUTS[rank][1]
    out = []
    for name, value in given.items():
        if last:
            value = (value.transpose(rank + 1, rank, *range(rank)) if name == "w"
                     else value.transpose(0, rank + 1, *range(1, rank + 1)))
        out.append(np.array(value, dtype=np.float64))
    return (dtype, *out)


def _nd_from_channels_first(a, rank, layout, dtype, weight=False):
    if layout == _ND_LAYOUTS[rank][1]:
        a = a.transpose(*range(2, rank + 2), 1, 0) if weight else a.transpose(0, *range(2, rank + 2), 1)
    return np.ascontiguousarray(a, dtype=dtype)


def _nd_geometry(rank, x_shape, w_shape, stride, padding, dilation, groups, transposed, output_padding,
                 padding_mode):
    """Validate a rank-generic (transposed) convolution in channels-first terms; return its sizes."""
    N, C, sizes = x_shape[0], x_shape[1], tuple(x_shape[2:])
    outer, inner, kernel = w_shape[0], w_shape[1], tuple(w_shape[2:])
    groups = _as_int(groups, "groups")
    if groups < 1:
        raise ValueError(f"groups: expected a positive int, got {groups}")
    if padding_mode not in _PADDING_MODES:
        raise ValueError(f"padding_mode: expected one of {_PADDING_MODES}, got {padding_mode!r}")
    if transposed:
        if outer != C or C % groups:
            raise ValueError(f"w: expected {C} input channels divisible by groups ({groups}), got {w_shape}")
        F = inner * groups
    else:
        F = outer
        if C % groups or F % groups or inner != C // groups:
            raise ValueError(f"w: shape {w_shape} does not fit {C} input channels in {groups} groups")
    if min(kernel) < 1:
        raise ValueError(f"w: kernel size must be positive, got {kernel}")
    stride = _per_axis(stride, rank, "stride", 1)
    dilation = _per_axis(dilation, rank, "dilation", 1)
    pads = _nd_pads(padding, rank, sizes, kernel, stride, dilation, transposed)
    span = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
    if transposed:
        ops_ = _per_axis(output_padding, rank, "output_padding", 0)
        if isinstance(padding, str) and padding.lower() == "same":
            if set(ops_) != {0}:
                raise ValueError(f"output_padding: must be 0 with padding='same', got {output_padding!r}")
            ops_ = tuple(_same_transpose_output_padding_1d(n, k, s, d)
                         for n, k, s, d in zip(sizes, kernel, stride, dilation))
        if any(not o < max(s, d) for o, s, d in zip(ops_, stride, dilation)):
            raise ValueError(f"output_padding: must be < max(stride, dilation), got {ops_}")
        out_sizes = tuple(conv_transpose2d_output_size(n, k, s, b, a, d, o)
                          for n, k, s, (b, a), d, o in zip(sizes, kernel, stride, pads, dilation, ops_))
        border_sizes = out_sizes  # the border lies around the output, which the convolution reads
    else:
        out_sizes = tuple(conv2d_output_size(n, k, s, b, a, d)
                          for n, k, s, (b, a), d in zip(sizes, kernel, stride, pads, dilation))
        border_sizes = sizes
    if min(out_sizes) < 1:
        raise ValueError(f"output size {out_sizes} is not positive for input {sizes}, kernel {kernel}, "
                         f"stride {stride}, padding {pads}, dilation {dilation}")
    for n, (b, a) in zip(border_sizes, pads):
        limit = {"zeros": np.inf, "replicate": np.inf, "circular": n, "reflect": n - 1}[padding_mode]
        if max(b, a) > limit:
            raise ValueError(f"padding {pads} is too large for padding_mode={padding_mode!r} on size {n}")
    return dict(N=N, C=C, F=F, sizes=sizes, out_sizes=out_sizes, kernel=kernel, stride=stride, dilation=dilation,
                pads=pads, groups=groups, span=span)


def _nd_window(g, position):
    """Spatial index of the dilated window anchored at a strided `position` of the padded array."""
    return tuple(slice(p * s, p * s + sp, d) for p, s, sp, d in zip(position, g["stride"], g["span"], g["dilation"]))


def _nd_conv(rank, x, w, bias, stride, padding, dilation, groups, layout, padding_mode):
    dtype, x64, w64 = _nd_arrays(rank, layout, bias, x=x, w=w)
    g = _nd_geometry(rank, x64.shape, w64.shape, stride, padding, dilation, groups, False, 0, padding_mode)
    G, F = g["groups"], g["F"]
    xpad = _pad_nd(x64, g["pads"], padding_mode)
    y = np.empty((g["N"], F) + g["out_sizes"])
    w_groups = _weights_by_group(w64, G).transpose(0, 2, 1)        # (G, Cg·prod(K), Fg)
    for position in np.ndindex(*g["out_sizes"]):
        field = xpad[_ALL + _nd_window(g, position)]
        y[_ALL + position] = _from_groups(_by_group(field, G) @ w_groups, (g["N"], F))
    y += _bias64(bias, F).reshape((F,) + (1,) * rank)
    return _nd_from_channels_first(y, rank, layout, dtype)


def _nd_conv_backward(rank, dy, x, w, stride, padding, dilation, groups, layout, padding_mode):
    dtype, dy64, x64, w64 = _nd_arrays(rank, layout, None, dy=dy, x=x, w=w)
    g = _nd_geometry(rank, x64.shape, w64.shape, stride, padding, dilation, groups, False, 0, padding_mode)
    G, F = g["groups"], g["F"]
    if dy64.shape != (g["N"], F) + g["out_sizes"]:
        raise ValueError(f"dy: expected channels-first shape {(g['N'], F) + g['out_sizes']}, got {dy64.shape}")
    xpad = _pad_nd(x64, g["pads"], padding_mode)
    dxpad, dw64 = np.zeros_like(xpad), np.zeros_like(w64)
    w_groups = _weights_by_group(w64, G)                            # (G, Fg, Cg·prod(K))
    for position in np.ndindex(*g["out_sizes"]):
        win = _nd_window(g, position)
        field, grad = xpad[_ALL + win], dy64[_ALL + position]       # (N, C, *K), (N, F)
        field_groups, grad_groups = _by_group(field, G), _by_group(grad, G)
        dw64 += (grad_groups.transpose(0, 2, 1) @ field_groups).reshape(dw64.shape)
        dxpad[_ALL + win] += _from_groups(grad_groups @ w_groups, field.shape)
    dx64 = _unpad_nd(dxpad, g["pads"], g["sizes"], padding_mode)
    db64 = dy64.sum(axis=(0, *range(2, rank + 2)))
    return (_nd_from_channels_first(dx64, rank, layout, dtype),
            _nd_from_channels_first(dw64, rank, layout, dtype, weight=True), db64.astype(dtype))


def _nd_conv_transpose(rank, x, w, bias, stride, padding, output_padding, dilation, groups, layout, padding_mode):
    dtype, x64, w64 = _nd_arrays(rank, layout, bias, x=x, w=w)
    g = _nd_geometry(rank, x64.shape, w64.shape, stride, padding, dilation, groups, True, output_padding,
                     padding_mode)
    G, F = g["groups"], g["F"]
    canvas = np.zeros((g["N"], F) + tuple(b + n + a for n, (b, a) in zip(g["out_sizes"], g["pads"])))
    w_groups = _weights_by_group(w64, G)                            # (G, Cig, Cog·prod(K))
    for position in np.ndindex(*g["sizes"]):
        target = canvas[_ALL + _nd_window(g, position)]             # (N, F, *K), a view
        target += _from_groups(_by_group(x64[_ALL + position], G) @ w_groups, target.shape)
    y = _unpad_nd(canvas, g["pads"], g["out_sizes"], padding_mode)
    y += _bias64(bias, F).reshape((F,) + (1,) * rank)
    return _nd_from_channels_first(y, rank, layout, dtype)


def _nd_conv_transpose_backward(rank, dy, x, w, stride, padding, output_padding, dilation, groups, layout,
                                padding_mode):
    dtype, dy64, x64, w64 = _nd_arrays(rank, layout, None, dy=dy, x=x, w=w)
    g = _nd_geometry(rank, x64.shape, w64.shape, stride, padding, dilation, groups, True, output_padding,
                     padding_mode)
    G, F = g["groups"], g["F"]
    if dy64.shape != (g["N"], F) + g["out_sizes"]:
        raise ValueError(f"dy: expected channels-first shape {(g['N'], F) + g['out_sizes']}, got {dy64.shape}")
    dcanvas = _pad_nd(dy64, g["pads"], padding_mode)  # the adjoint of the fold that made the output
    dx64, dw64 = np.zeros_like(x64), np.zeros_like(w64)
    w_groups = _weights_by_group(w64, G)                            # (G, Cig, Cog·prod(K))
    for position in np.ndindex(*g["sizes"]):
        field_groups = _by_group(dcanvas[_ALL + _nd_window(g, position)], G)   # (G, N, Cog·prod(K))
        x_groups = _by_group(x64[_ALL + position], G)                           # (G, N, Cig)
        dx64[_ALL + position] = _from_groups(field_groups @ w_groups.transpose(0, 2, 1), (g["N"], g["C"]))
        dw64 += (x_groups.transpose(0, 2, 1) @ field_groups).reshape(dw64.shape)
    db64 = dy64.sum(axis=(0, *range(2, rank + 2)))
    return (_nd_from_channels_first(dx64, rank, layout, dtype),
            _nd_from_channels_first(dw64, rank, layout, dtype, weight=True), db64.astype(dtype))


def conv1d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, layout="NCL", padding_mode="zeros"):
    """1-D cross-correlation (PyTorch ``conv1d``): x (N, C, L) / (N, L, C), w (F, C/g, K) / (K, C/g, F)."""
    return _nd_conv(1, x, w, bias, stride, padding, dilation, groups, layout, padding_mode)


def conv1d_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCL", padding_mode="zeros"):
    """(dx, dw, db) of ``sum(conv1d(x, w, b) * dy)``."""
    return _nd_conv_backward(1, dy, x, w, stride, padding, dilation, groups, layout, padding_mode)


def conv_transpose1d(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                     layout="NCL", padding_mode="zeros"):
    """Transposed 1-D convolution (PyTorch ``conv_transpose1d``): w (C_in, C_out/g, K) / (K, C_out/g, C_in)."""
    return _nd_conv_transpose(1, x, w, bias, stride, padding, output_padding, dilation, groups, layout, padding_mode)


def conv_transpose1d_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                              layout="NCL", padding_mode="zeros"):
    """(dx, dw, db) of ``sum(conv_transpose1d(x, w, b) * dy)``."""
    return _nd_conv_transpose_backward(1, dy, x, w, stride, padding, output_padding, dilation, groups, layout,
                                       padding_mode)


def conv3d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, layout="NCDHW", padding_mode="zeros"):
    """3-D cross-correlation (PyTorch ``conv3d``): x (N, C, D, H, W) / (N, D, H, W, C), w (F, C/g, KD, KH, KW)
    / (KD, KH, KW, C/g, F)."""
    return _nd_conv(3, x, w, bias, stride, padding, dilation, groups, layout, padding_mode)


def conv3d_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCDHW", padding_mode="zeros"):
    """(dx, dw, db) of ``sum(conv3d(x, w, b) * dy)``."""
    return _nd_conv_backward(3, dy, x, w, stride, padding, dilation, groups, layout, padding_mode)


def conv_transpose3d(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                     layout="NCDHW", padding_mode="zeros"):
    """Transposed 3-D convolution (PyTorch ``conv_transpose3d``): w (C_in, C_out/g, KD, KH, KW) /
    (KD, KH, KW, C_out/g, C_in)."""
    return _nd_conv_transpose(3, x, w, bias, stride, padding, output_padding, dilation, groups, layout, padding_mode)


def conv_transpose3d_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                              layout="NCDHW", padding_mode="zeros"):
    """(dx, dw, db) of ``sum(conv_transpose3d(x, w, b) * dy)``."""
    return _nd_conv_transpose_backward(3, dy, x, w, stride, padding, output_padding, dilation, groups, layout,
                                       padding_mode)
