"""The public convolution ops: resolve the arguments once, plan, call the kernels, return.

All checking happens in `convgen.frontend.resolve`, the choice of kernels in `convgen.planning.planner`, the C call
in `Kernels.call`. Transposed convolution is conv2d's input gradient (col2im of Wᵀ·x) and its
gradients are conv2d's forward and weight gradient, so four ops share three entry points. A call
signature that passed validation once (same shapes, dtype and parameters: a training loop) is
remembered and goes straight to the kernels.
"""

from __future__ import annotations

import math

import numpy as np

from ..planning import planner
from .batching import accepts_unbatched
from ..runtime import wisdom
from ..runtime.kernels import Kernels, get_kernels, num_threads, settings, with_schedule
from .resolve import FLOAT_DTYPES, LIMITS, Resolved, as_flag, c_array, resolve, result_array, split_out
from ..planning.epilogue import NO_EPILOGUE, Epilogue, as_epilogue

# The kernel entry points each op runs (a transposed problem runs them as its conv()).
OP_ENTRIES = {"conv2d": ("fwd",), "conv2d_backward": ("bwd_data", "bwd_weight"),
            "conv_transpose2d": ("bwd_data",), "conv_transpose2d_backward": ("fwd", "bwd_weight")}
_SPATIAL_AXES = {"NCHW": (0, 2, 3), "NHWC": (0, 1, 2)}  # batch and space: what the bias gradient sums
_BIAS_SHAPE = {"NCHW": (-1, 1, 1), "NHWC": (-1,)}        # the bias broadcast over an output batch


class _Call:
    """A call signature that passed validation: its resolved problem and the plan that computes it;
    `adjoint`, where the plan computes its input gradient (conv2d's dx, a transposed call's output)
    as a forward convolution (`planner.adjoint_forward`), the call of that convolution, else None."""

    __slots__ = ("resolved", "problem", "plan", "empty", "adjoint", "entries", "_checked", "_settings", "_spec")

    def __init__(self, resolved: Resolved, plan: planner.Plan, adjoint: "_Call | None" = None):
        self.resolved, self.problem, self.plan, self.adjoint = resolved, resolved.problem, plan, adjoint
        self.empty = resolved.problem.empty  # nothing to multiply: the kernels are not called
        # the entry points of the plan's kernels the op runs (not the input gradient's, when the adjoint does)
        self.entries = tuple(e for e in OP_ENTRIES[resolved.op] if not (adjoint is not None and e == "bwd_data"))
        self._checked = None
        # a measured schedule variant builds its kernels with its own fields
        self._settings = with_schedule(settings(), plan.overrides) if plan.overrides else None
        self._spec = plan.spec

    def kernels(self) -> Kernels:
        """The plan's kernels, looked up on each use (a dict lookup once loaded), so a call never
        reaches a module the process has let go of; their workspace is checked on first use."""
        kernels = get_kernels(self._spec, self._settings)
        # (later lookups with the spec object the loaded kernels' key holds: an equal spec of another
        # call, compared field by field, made a lookup cost as much as a tiny convolution's C)
        self._spec = kernels.spec
        if kernels is not self._checked:
            kernels.prepare(self.entries)
            _check_workspace(kernels, self.resolved, self.entries)
            self._checked = kernels
        return kernels


def _adjoint_call(resolved: Resolved, plan: planner.Plan, specialize: bool) -> _Call | None:
    """The forward call that computes the input gradient of `resolved`'s op, where the planner says so."""
    if "bwd_data" not in OP_ENTRIES[resolved.op]:
        return None
    adjoint = planner.adjoint_forward(resolved.problem, plan)
    if adjoint is None:
        return None
    return _Call(Resolved("conv2d", adjoint, resolved.dtype, (adjoint.output_shape,)),
                 planner.plan(adjoint, specialize, settings().schedule(), "direct"))


def adjoint_weights(w, groups: int, layout: str):
    """conv2d's weights `w` as the adjoint forward convolution of its input gradient reads them
    (`planner.adjoint_forward`): each group's filters and channels exchanged, the window flipped.
    NCHW (F, C/g, KH, KW) becomes (C, F/g, KH, KW); NHWC (KH, KW, C/g, F) becomes (KH, KW, F/g, C).
    A new C-contiguous array."""
    if layout == "NCHW":
        f, cg, kh, kw = w.shape
        grouped = w.reshape(groups, f // groups, cg, kh, kw).transpose(0, 2, 1, 3, 4)[..., ::-1, ::-1]
        return np.ascontiguousarray(grouped).reshape(groups * cg, f // groups, kh, kw)
    kh, kw, cg, f = w.shape
    grouped = w.reshape(kh, kw, cg, groups, f // groups)[::-1, ::-1].transpose(0, 1, 4, 3, 2)
    return np.ascontiguousarray(grouped).reshape(kh, kw, f // groups, groups * cg)


def input_gradient(call: _Call, dy, w, dx) -> None:
    """conv2d's input gradient of `call`'s problem (conv2d_backward's dx, conv_transpose2d's output)
    into dx, from dy and the weights w: by the plan's input-gradient kernels, or by the adjoint
    forward convolution where the plan has one."""
    if call.adjoint is None:
        call.kernels().call("bwd_data", call.problem, (dy, w, None, dx))
    else:
        adjoint = call.adjoint
        flipped = adjoint_weights(w, adjoint.problem.groups, adjoint.problem.layout)
        adjoint.kernels().call("fwd", adjoint.problem, (dy, flipped, None, None, None, dx))


def _check_workspace(kernels: Kernels, resolved: Resolved, entries) -> None:
    """Refuse a call whose C workspace (about threads × the weights at most) this machine cannot hold."""
    problem = resolved.problem
    weight_shape = problem.weight_shape
    if not entries or int(np.prod(weight_shape)) * resolved.dtype.itemsize * num_threads() < LIMITS.workspace_query_bytes:
        return
    needed = max(kernels.workspace_bytes(entry, problem) for entry in entries)
    if needed > LIMITS.memory_bytes:
        raise ValueError(f"{resolved.op} would need a workspace of {needed} bytes for these weights {weight_shape}, "
                         f"more than this machine's memory ({LIMITS.memory_bytes} bytes); use fewer threads")


_CALLS: dict = {}  # call signature -> _Call
_CALLS_MAX = 1024


def _key(value):
    """A hashable stand-in for a parameter that equals no differently typed value (2.0 and True
    must not find the call remembered for 2 and 1 and skip their validation)."""
    kind = type(value)
    if kind is int or kind is str:
        return value
    if kind is tuple or kind is list:
        return tuple(_key(v) for v in value)
    return (kind, value)


def _signature(op, arrays, params):
    """A hashable signature of a call whose arrays need no conversion, else None.

    Arrays must be exact, C-contiguous ndarrays of one native float dtype (what validation leaves
    untouched). The active settings, thread count and wisdom are part of it: the kernels and the plan
    depend on them.
    """
    if type(arrays[0]) is not np.ndarray:
        return None
    dtype = arrays[0].dtype
    if dtype is not FLOAT_DTYPES[0] and dtype is not FLOAT_DTYPES[1] and dtype not in FLOAT_DTYPES:
        return None  # (`in` compares byte order too: a big-endian float32 is not in it)
    for array in arrays:
        if array is not None and (type(array) is not np.ndarray or not array.flags.c_contiguous
                                  or (array.dtype is not dtype and array.dtype != dtype)):
            return None
    try:
        return (op, dtype, tuple([None if a is None else a.shape for a in arrays]),
                tuple([p if type(p) is int or type(p) is str else _key(p) for p in params]),
                settings(), num_threads(), wisdom.generation())
    except TypeError:  # unhashable parameters: validation will say what is wrong with them
        return None


def _prepare(op, arrays, specialize, algorithm, stride, padding, dilation, groups, layout, output_padding=0,
             padding_mode="zeros", epilogue=NO_EPILOGUE):
    """(arrays, _Call) of one call: remembered, or resolved and planned now."""
    key = _signature(op, arrays, (specialize, algorithm, stride, padding, dilation, groups, layout, output_padding,
                                  padding_mode, epilogue))
    call = _CALLS.get(key)
    if call is not None:
        return arrays, call
    specialize = as_flag("specialize", specialize)
    algorithm = planner.as_algorithm(algorithm)
    arrays, resolved = resolve(op, arrays, stride, padding, dilation, groups, layout, output_padding, padding_mode,
                               epilogue)
    active = settings()
    # "auto" (and "auto-training") takes what `convgen tune` measured fastest for the problem's class,
    # where it did
    automatic = algorithm in planner.AUTOMATIC and specialize
    measured = wisdom.lookup(op, resolved.problem, active) if automatic else None
    plan = planner.plan(resolved.problem, specialize, active.schedule(), algorithm, measured)
    call = _Call(resolved, plan, _adjoint_call(resolved, plan, specialize))
    if key is not None:
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = call
    return arrays, call


def prepare(op: str, arrays, *, specialize=True, algorithm="auto", stride=1, padding=0, dilation=1, groups=1,
            layout="NCHW", output_padding=0, padding_mode="zeros", epilogue: Epilogue = NO_EPILOGUE) -> _Call:
    """The checked and planned form of one call of `op` ("conv2d", "conv2d_backward", ... ) on
    `arrays` (its array arguments, as the op takes them, each C-contiguous and of one float dtype),
    for front ends that run the kernels on memory of their own (convgen.torch): `.problem`,
    `.kernels()` and `.empty` (nothing to multiply; the kernels must not be called). Every call with
    arrays of the same shapes, dtype and layout is checked by it. conv2d takes an `epilogue`
    (`convgen.planning.epilogue`; its residual, if any, is the caller's to pass). Raises what the op
    would."""
    checked, call = _prepare(op, tuple(arrays), specialize, algorithm, stride, padding, dilation, groups, layout,
                             output_padding, padding_mode, epilogue)
    if any(a is not b for a, b in zip(checked, arrays)):
        raise ValueError(f"{op}: prepare() needs arrays the op takes as they are (C-contiguous, one float dtype)")
    return call


def runner(op: str, arrays, measured, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW"):
    """A function of no arguments that runs `op` on `arrays` with the specialized plan of the
    `measured` choice (convgen.runtime.wisdom.Choice): what `convgen tune` times. ValueError where
    the choice cannot compute the call."""
    arrays, resolved = resolve(op, tuple(arrays), stride, padding, dilation, groups, layout)
    plan = planner.plan(resolved.problem, True, settings().schedule(), "auto", measured)
    if (plan.family != measured.algorithm or (plan.family == "winograd" and plan.spec.tile != measured.tile)
            or plan.variant != measured.variant):
        raise ValueError(f"{measured.text()} cannot compute this {op} call")
    call = _Call(resolved, plan, _adjoint_call(resolved, plan, True))
    if resolved.backward:
        dy, x, w = arrays
        return lambda: _backward(call, dy, x, w, None)
    x, w, bias = arrays
    return lambda: _forward(call, x, w, bias, None)


def _forward(call: _Call, x, w, bias, out, residual=None):
    """y of conv2d or conv_transpose2d: `out` (checked) or a new array; conv2d's epilogue adds
    `residual` (checked) where it says."""
    resolved, problem = call.resolved, call.problem
    y = result_array("out", out, resolved.result_shapes[0], resolved.dtype, (x, w, bias))
    if residual is not None and np.may_share_memory(residual, y):
        residual = residual.copy()  # the kernels write y before they read the residual
    if call.empty:  # no input values: every output is the bias alone, then the epilogue
        y[...] = 0 if bias is None else bias.reshape(_BIAS_SHAPE[problem.layout])
        _numpy_epilogue(y, problem.epilogue, residual)
    elif not problem.transpose:
        call.kernels().call("fwd", problem, (x, w, None, bias, residual, y))
    else:
        input_gradient(call, x, w, y)
        if bias is not None:
            y += bias.reshape(_BIAS_SHAPE[problem.layout])
    return y


def _backward(call: _Call, dy, x, w, out):
    """(dx, dw, db) of conv2d_backward or conv_transpose2d_backward: `out`'s arrays (checked) or new ones."""
    resolved, problem = call.resolved, call.problem
    (dx_shape, dw_shape, db_shape), dtype, inputs = resolved.result_shapes, resolved.dtype, (dy, x, w)
    out_dx, out_dw, out_db = split_out(out)
    dx = result_array("out[0] (dx)", out_dx, dx_shape, dtype, inputs)
    dw = result_array("out[1] (dw)", out_dw, dw_shape, dtype, inputs)
    db = result_array("out[2] (db)", out_db, db_shape, dtype, inputs)
    if call.empty:  # nothing to multiply: dx and dw are empty sums
        dx.fill(0)
        dw.fill(0)
    elif not problem.transpose:
        input_gradient(call, dy, w, dx)
        call.kernels().call("bwd_weight", problem, (dy, x, dw))
    else:  # dx is conv2d(dy, w); dw is conv2d's weight gradient with the roles of x and dy exchanged
        kernels = call.kernels()
        kernels.call("fwd", problem, (dy, w, None, None, None, dx))
        kernels.call("bwd_weight", problem, (x, dy, dw))
    _bias_gradient(dy, problem.layout, db)
    return dx, dw, db


def _bias_gradient(dy, layout, out):
    """db: dy summed over batch and space, into `out`. In NHWC the rows of F channels are first
    taken k at a time (rows of up to 1024 values) and the k partial sums folded after: NumPy's
    reduction over axes (0, 1, 2) walks the short channel axis and ran 2.5-19× slower (32-144
    channels)."""
    f = dy.shape[-1]
    if layout == "NHWC" and f:
        rows, k = dy.size // f, 1
        while f * k < 1024 and rows % (2 * k) == 0:
            k *= 2
        np.add.reduce(np.add.reduce(dy.reshape(rows // k, k * f), axis=0).reshape(k, f), axis=0, out=out)
    else:
        np.add.reduce(dy, axis=_SPATIAL_AXES[layout], out=out)


def _numpy_epilogue(y, epilogue: Epilogue, residual) -> None:
    """The epilogue on y in place, in NumPy: for the calls whose kernels are not run (nothing to
    multiply, so y is the bias alone). The kernels' formulas (templates/common/epilogue.c.j2)."""
    if not epilogue.active:
        return
    if epilogue.residual == "before":
        y += residual
    a, b, v = epilogue.alpha, epilogue.beta, y.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        if epilogue.activation == "relu":
            y[v < 0] = 0
        elif epilogue.activation == "clamp":
            y[v < a], y[v > b] = a, b
        elif epilogue.activation == "leaky_relu":
            y[v < 0] *= a
        elif epilogue.activation in ("silu", "sigmoid"):
            y[...] = (v if epilogue.activation == "silu" else 1) / (1 + np.exp(-v))
        elif epilogue.activation == "hardswish":
            y[...] = v * np.clip(v + 3, 0, 6) / 6
        elif epilogue.activation == "gelu":
            y[...] = 0.5 * v * (1 + np.vectorize(math.erf, otypes=[v.dtype])(v / math.sqrt(2)))
        elif epilogue.activation == "gelu_tanh":
            y[...] = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    if epilogue.residual == "after":
        y += residual


def _epilogue_arguments(activation, residual, residual_position) -> Epilogue:
    """The epilogue of conv2d's keyword arguments (none without an activation or a residual)."""
    if activation is None and residual is None:
        return NO_EPILOGUE
    return as_epilogue(activation, residual is not None, residual_position)


def check_residual(residual, dtype, shape):
    """The residual array of a forward call whose output has `shape` and `dtype`, checked: C-contiguous
    (copied if not), of that shape and dtype; None stays None."""
    if residual is None:
        return None
    residual = c_array("residual", residual, dtype, len(shape))
    if residual.shape != tuple(shape):
        raise ValueError(f"residual must have the output's shape {tuple(shape)}, got {residual.shape}")
    return residual


def scaled_weights(w, scale, call: _Call):
    """conv2d's weights with each output channel's filter times `scale` (an (F,) array): conv(x, w)·s =
    conv(x, w·s), so a per-channel scale (a frozen BatchNorm's) costs nothing in the kernels."""
    if scale is None:
        return w
    channels = call.problem.f
    scale = c_array("scale", scale, call.resolved.dtype, 1)
    if scale.shape != (channels,):
        raise ValueError(f"scale must have shape ({channels},) (one per output channel), got {scale.shape}")
    return np.ascontiguousarray(w * (scale.reshape(-1, 1, 1, 1) if call.problem.layout == "NCHW" else scale))


@accepts_unbatched(2)
def conv2d(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW", specialize=True,
           algorithm="auto", padding_mode="zeros", scale=None, activation=None, residual=None,
           residual_position="before", out=None):
    """2-D convolution (cross-correlation, as PyTorch's conv2d).

    Parameters
    ----------
    x : array (N, C, H, W) for layout "NCHW", (N, H, W, C) for "NHWC"; float32 or float64. Unbatched
        x, (C, H, W) or (H, W, C), gives an unbatched y (as PyTorch; `out` then is unbatched too).
    w : weights (F, C/groups, KH, KW) for "NCHW", (KH, KW, C/groups, F) for "NHWC"; x's dtype.
    bias : optional (F,) array.
    stride, dilation : int or (h, w) pair.
    padding : int, (h, w), ((top, bottom), (left, right)), "valid" or "same" (TensorFlow's rule:
        output ceil(input / stride), the odd extra row/column at the bottom/right).
    groups : input and output channels are split into this many independent groups.
    layout : "NCHW" or "NHWC".
    padding_mode : what the padding holds, as PyTorch's Conv2d: "zeros" (default), "reflect" (the
        image mirrored at its edge, the edge not repeated; padding < the input size), "replicate"
        (the edge repeated) or "circular" (the image wrapped around; padding <= the input size).
        Computed where the kernels split x into phase planes, without a padded copy of x.
    specialize : True calls the kernel compiled for exactly this window (kernel size, stride,
        padding, dilation as constants); False the generic kernel that takes them at run time.
    algorithm : "auto" (default), "direct", "winograd" or "depthwise". Winograd F(m×m, 3×3) computes
        3×3 windows at stride 1 without dilation with fewer multiplies, rounding differently (its
        error bound is in convgen.planning.winograd); "auto" takes it where the schedule's cost model says it
        is faster; its generic build is direct. "depthwise" computes groups == input channels (any
        number of filters per group), specialized or generic; "auto" takes it for such calls from
        8 channels up (`depthwise_min_channels`). Winograd and depthwise pad with zeros only: with
        another padding_mode "auto" runs the direct kernels and naming either is refused.
        "auto-training" is "auto" for a training step's calls, whose rounding compounds through the
        step: Winograd only at F(2×2) and on images of 14×14 outputs or more (what convgen.torch
        runs where a gradient is wanted).
    scale : optional (F,) array: each output channel's sum times scale[f], before the bias (a frozen
        BatchNorm is scale = γ/√(σ² + ε) and bias = β − μ·scale). Folded into a copy of the weights.
    activation : None, or what each output value goes through after the bias, in the kernels' store
        (a fused epilogue): "relu", "relu6", "clamp", "hardtanh", "leaky_relu", "silu", "hardswish",
        "gelu" (exact), "gelu_tanh", "sigmoid", each as PyTorch's function of that name, or a tuple
        with parameters: ("leaky_relu", negative_slope), ("clamp", min, max).
    residual : optional array shaped as y (a skip connection), added in the same pass: before the
        activation (residual_position="before", default: y = act(conv + bias + residual), as a
        ResNet block) or after it ("after": y = act(conv + bias) + residual).
    out : optional preallocated C-contiguous output array of the right shape and dtype.

    Returns y: (N, F, Ho, Wo) or (N, Ho, Wo, F), with Ho = (H + top + bottom − dh·(KH − 1) − 1)//sh + 1.
    """
    epilogue = _epilogue_arguments(activation, residual, residual_position)
    (x, w, bias), call = _prepare("conv2d", (x, w, bias), specialize, algorithm, stride, padding, dilation, groups,
                                  layout, padding_mode=padding_mode, epilogue=epilogue)
    return _forward(call, x, scaled_weights(w, scale, call), bias, out,
                    check_residual(residual, call.resolved.dtype, call.resolved.result_shapes[0]))


@accepts_unbatched(2)
def conv2d_backward(dy, x, w, *, stride=1, padding=0, dilation=1, groups=1, layout="NCHW", specialize=True,
                    algorithm="auto", padding_mode="zeros", out=None):
    """Gradients of conv2d with respect to x, w and the bias, given dy = ∂L/∂y.

    Keyword arguments are those of `conv2d`. Returns (dx, dw, db) with the shapes of x, w and the
    bias (F,). `out` may be a (dx, dw, db) tuple of preallocated arrays (any of them None).
    dW = dY·im2col(X)ᵀ, dX = col2im(Wᵀ·dY), db = dY summed over batch and space. With Winograd, dX
    is the Winograd correlation of dY with the flipped filters; dW is always direct. With a
    padding_mode other than zeros, the gradient that reaches the padding is added into the input
    pixels the padding copied (the adjoint of the padding).
    """
    (dy, x, w), call = _prepare("conv2d_backward", (dy, x, w), specialize, algorithm, stride, padding, dilation,
                                groups, layout, padding_mode=padding_mode)
    return _backward(call, dy, x, w, out)


@accepts_unbatched(2)
def conv_transpose2d(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                     layout="NCHW", specialize=True, algorithm="auto", padding_mode="zeros", out=None):
    """Transposed 2-D convolution (PyTorch's conv_transpose2d): the input gradient of conv2d.

    x : (N, C_in, H, W) for "NCHW", (N, H, W, C_in) for "NHWC".
    w : (C_in, C_out/groups, KH, KW) for "NCHW" (PyTorch), (KH, KW, C_out/groups, C_in) for "NHWC"
        (TensorFlow's conv2d_transpose).
    bias : optional (C_out,).
    output_padding : int or pair, 0 <= op < max(stride, dilation): extra rows/cols at the bottom/right.
    padding : as conv2d; "same" gives an output of exactly input·stride.
    algorithm : as conv2d (a 3×3 stride-1 transposed convolution is a Winograd correlation too).
    padding_mode : only "zeros", as torch's ConvTranspose2d (a ValueError otherwise).

    Returns y with Ho = (H − 1)·sh − top − bottom + dh·(KH − 1) + oph + 1. Computed as col2im of Wᵀ·x,
    never by convolving a zero-stuffed input.
    """
    (x, w, bias), call = _prepare("conv_transpose2d", (x, w, bias), specialize, algorithm, stride, padding,
                                  dilation, groups, layout, output_padding, padding_mode)
    return _forward(call, x, w, bias, out)


@accepts_unbatched(2)
def conv_transpose2d_backward(dy, x, w, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                              layout="NCHW", specialize=True, algorithm="auto", padding_mode="zeros", out=None):
    """Gradients of conv_transpose2d with respect to x, w and the bias, given dy = ∂L/∂y.

    Keyword arguments are those of `conv_transpose2d`. Returns (dx, dw, db) shaped as x, w and the
    bias (C_out,): dx is conv2d(dy, w), dw is conv2d's weight gradient with the roles of x and dy
    exchanged, db is dy summed over batch and space.
    """
    (dy, x, w), call = _prepare("conv_transpose2d_backward", (dy, x, w), specialize, algorithm, stride, padding,
                                dilation, groups, layout, output_padding, padding_mode)
    return _backward(call, dy, x, w, out)


__all__ = ["conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward", "prepare"]
