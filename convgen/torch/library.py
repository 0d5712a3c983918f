"""convgen's convolutions as PyTorch custom ops: ``convgen::conv2d`` and ``convgen::conv_transpose2d``.

Each op is a `torch.library.custom_op` (so autograd, `torch.compile` and `torch.export` see one opaque
node) with three parts:

- the CPU implementation: the call's `Bound` (checked and planned by convgen's front end on its first
  call), which runs the kernels on the tensors' memory (no copies) into new tensors, on
  `torch.get_num_threads()` threads;
- a fake implementation: the output's shape and strides without computing it, for tracing;
- an autograd formula from convgen's backward op, itself a custom op (``convgen::conv2d_backward``,
  ``convgen::conv_transpose2d_backward``) so that a traced backward graph holds it too.

Memory formats map to convgen's layouts: a contiguous tensor is computed as "NCHW", a channels_last
one as "NHWC" (its memory *is* an NHWC array), and the result comes back in the same memory format.
Any other strides are made contiguous first. Every op takes the same arguments, as aten's
`convolution` does (plus `algorithm` and `padding_mode`): the forward convolutions ignore
`output_padding` (always zeros), the transposed ones pad with zeros only, as PyTorch's.

An eager call (nothing tracing it) of a signature seen before skips both the checks and the custom
op's dispatch: `apply` runs its `Bound` at once (section "eager calls" below).

The ops are described by a table of `Kind`s; a convolution of another dimensionality (1-D, 3-D) is one
more entry there, plus its public function, once convgen computes it.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable

import numpy as np
import torch

from ..frontend import ops as convgen_ops
from ..planning.planner import as_algorithm
from ..frontend.resolve import as_padding_mode, conv_problem, transposed_problem
from ..planning.spec import Window, as_int, explicit_padding
from ..runtime import wisdom
from ..runtime.kernels import settings
from ..runtime.memory import MIN_BYTES as HUGE_PAGES_MIN_BYTES, advise_huge_pages

DTYPES = (torch.float32, torch.float64)
_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}
NAMESPACE = "convgen"


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(perm)), key=perm.__getitem__))


@dataclasses.dataclass(frozen=True)
class Kind:
    """One convolution op as PyTorch sees it: its convgen functions, dimensionality and layouts.

    `layouts` are convgen's names for the channels-first and channels-last layouts. Weights are
    PyTorch's (outer, inner, *kernel) in the channels-first layout and convgen's (*kernel, inner, outer)
    in the channels-last one. `adjoint` is the kind whose forward op is this kind's input gradient.
    `resolve_padding(padding, kernel, stride, dilation, sizes, transposed)` turns the public padding
    argument into explicit pads, [before, after] per spatial axis in one flat list, and the output
    padding that it implies (transposed "same"), else None. `problem` is convgen's resolver, which
    checks a call's shapes and parameters.
    """

    name: str
    spatial: int
    transposed: bool
    layouts: tuple[str, str]
    adjoint: str
    resolve_padding: Callable
    problem: Callable

    @property
    def forward(self) -> str:
        """The convgen op (a function in `convgen.frontend.ops`) of the forward pass."""
        return self.name

    @property
    def backward(self) -> str:
        """The convgen op that returns (dx, dw, db)."""
        return f"{self.name}_backward"

    @property
    def to_last(self) -> tuple[int, ...]:
        """Logical (N, C, *spatial) to channels-last (N, *spatial, C)."""
        return (0, *range(2, self.spatial + 2), 1)

    @property
    def weight_to_last(self) -> tuple[int, ...]:
        """PyTorch's (outer, inner, *kernel) to convgen's channels-last (*kernel, inner, outer)."""
        return (*range(2, self.spatial + 2), 1, 0)

    @functools.cached_property
    def from_last(self) -> tuple[int, ...]:
        """Channels-last (N, *spatial, C) back to logical (N, C, *spatial)."""
        return _inverse(self.to_last)

    @functools.cached_property
    def weight_from_last(self) -> tuple[int, ...]:
        return _inverse(self.weight_to_last)

    def out_channels(self, weight_shape, groups) -> int:
        return weight_shape[1] * groups if self.transposed else weight_shape[0]


def _padding_2d(padding, kernel, stride, dilation, sizes, transposed):
    """convgen's 2-D padding forms resolved: ([top, bottom, left, right], output padding or None)."""
    pads = explicit_padding(padding)
    if pads == "valid":
        return [0, 0, 0, 0], None
    if pads == "same":  # depends on the input size for strides > 1 and for transposed convolutions
        window = Window.resolve(kernel, stride, "same", dilation, tuple(int(n) for n in sizes), transposed)
        implied = list(window.implicit_output_padding(tuple(int(n) for n in sizes))) if transposed else None
        return [p for side in window.padding for p in side], implied
    return [p for side in pads for p in side], None


KINDS = {
    "conv2d": Kind("conv2d", 2, False, ("NCHW", "NHWC"), "conv_transpose2d", _padding_2d, conv_problem),
    "conv_transpose2d": Kind("conv_transpose2d", 2, True, ("NCHW", "NHWC"), "conv2d", _padding_2d,
                             transposed_problem),
}


# --------------------------------------------------------------------------- tensors and arrays
def channels_last(kind: Kind, x: torch.Tensor) -> bool:
    """Whether x is computed in the channels-last layout: its memory is (N, *spatial, C) and not also
    (N, C, *spatial) (with one channel or one pixel it is both, and stays channels-first)."""
    return not x.is_contiguous() and x.permute(kind.to_last).is_contiguous()


def _numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a NumPy array (a view: `detach` and `numpy` copy nothing)."""
    return t.detach().numpy()


def _in_layout(kind: Kind, t: torch.Tensor, last: bool) -> torch.Tensor:
    """An image batch whose memory is the chosen layout's: t itself (contiguous() returns t when it
    already is), or a contiguous copy when its strides are neither layout's."""
    return t.permute(kind.to_last).contiguous() if last else t.contiguous()


def _weight_in_layout(kind: Kind, weight: torch.Tensor, last: bool) -> torch.Tensor:
    """The weights in the chosen layout. For channels-last this is a reordered copy unless the tensor
    already lies in convgen's (*kernel, inner, outer) order; the weights are small beside the images
    (and beside one call's work on them), so the copy costs little and keeps the kernels' layout."""
    return weight.permute(kind.weight_to_last).contiguous() if last else weight.contiguous()


def weight_in_layout(kind: Kind, weight: torch.Tensor, last: bool) -> bool:
    """Whether the weights' memory already is the layout's order (no copy needed)."""
    return weight.permute(kind.weight_to_last).is_contiguous() if last else weight.is_contiguous()


def relay_weight(kind: Kind, weight: torch.nn.Parameter, last: bool) -> None:
    """Re-lay a Parameter's memory, in place, in the order the kernels read in the layout: convgen's
    (*kernel, inner, outer) for channels-last, contiguous for channels-first.

    Its shape, values and identity stay (an optimizer and a state_dict see the same Parameter, as after
    `Module.to(memory_format=...)`, which also changes a weight's strides). Calls then read the weights
    where they lie instead of reordering a copy on every call, and a change to their values can never
    be missed: there is no second copy to go stale.
    """
    # (the new memory is an inference tensor exactly when the old one was: one made in inference mode
    # from a trainable weight could not be trained)
    with torch.inference_mode(weight.is_inference()), torch.no_grad():
        laid = _weight_in_layout(kind, weight.detach(), last)
        weight.data = laid.permute(kind.weight_from_last) if last else laid


def image_array(kind: Kind, t: torch.Tensor, last: bool) -> np.ndarray:
    """`_in_layout` as a NumPy array (a view: no copy)."""
    return _numpy(_in_layout(kind, t, last))


def weight_array(kind: Kind, weight: torch.Tensor, last: bool) -> np.ndarray:
    return _numpy(_weight_in_layout(kind, weight, last))


def _empty_image(kind: Kind, like: torch.Tensor, shape, last: bool) -> torch.Tensor:
    """The result's tensor, without data: the shape and strides the kernels' output has."""
    if last:
        return like.new_empty([shape[i] for i in kind.to_last]).permute(_inverse(kind.to_last))
    return like.new_empty(shape)


def _empty_weight(kind: Kind, like: torch.Tensor, last: bool) -> torch.Tensor:
    if last:
        return like.new_empty([like.shape[i] for i in kind.weight_to_last]).permute(_inverse(kind.weight_to_last))
    return like.new_empty(like.shape)


# ------------------------------------------------------------------------------- the op parts
def _ints(name: str, value, count: int, minimum: int = 1) -> list[int]:
    """An int or a sequence of `count` ints (one per spatial axis), each >= minimum, as a list."""
    if isinstance(value, (tuple, list, torch.Size)):
        if len(value) != count:
            raise ValueError(f"{name} must be an int or {count} ints (one per spatial axis), got {value!r}")
        return [as_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value)]
    return [as_int(name, value, minimum)] * count


def _pairs(flat) -> tuple:
    """[before0, after0, before1, after1, ...] as ((before0, after0), (before1, after1), ...)."""
    return tuple(zip(flat[0::2], flat[1::2]))


def _convgen_kwargs(kind: Kind, stride, padding, output_padding, dilation, groups, algorithm, padding_mode,
                    last) -> dict:
    kwargs = dict(stride=tuple(stride), padding=_pairs(padding), dilation=tuple(dilation), groups=groups,
                  layout=kind.layouts[last], algorithm=algorithm, padding_mode=padding_mode)
    if kind.transposed:
        kwargs["output_padding"] = tuple(output_padding)
    return kwargs


def output_shape(kind: Kind, x_shape, w_shape, stride, padding, output_padding, dilation, groups) -> list:
    """The logical (N, C_out, *spatial) output shape; plain arithmetic, so symbolic sizes pass."""
    sizes = []
    for axis in range(kind.spatial):
        n, k = x_shape[2 + axis], w_shape[2 + axis]
        before, after = padding[2 * axis], padding[2 * axis + 1]
        extent = dilation[axis] * (k - 1) + 1
        if kind.transposed:
            sizes.append((n - 1) * stride[axis] - before - after + extent + output_padding[axis])
        else:
            sizes.append((n + before + after - extent) // stride[axis] + 1)
    return [x_shape[0], kind.out_channels(w_shape, groups), *sizes]


def _problem(kind: Kind, x, weight, stride, padding, output_padding, dilation, groups, padding_mode, last):
    """convgen's Problem of a call with sizes known as numbers, every parameter checked by convgen."""
    x_shape = tuple(x.shape[i] for i in kind.to_last) if last else tuple(x.shape)
    w_shape = tuple(weight.shape[i] for i in kind.weight_to_last) if last else tuple(weight.shape)
    args = (x_shape, w_shape, _NUMPY_DTYPES[x.dtype], tuple(stride), _pairs(padding), tuple(dilation), groups,
            kind.layouts[last])
    return kind.problem(*args, tuple(output_padding)) if kind.transposed else kind.problem(*args, padding_mode)


def _check_geometry(kind: Kind, x, weight, stride, padding, output_padding, dilation, groups, padding_mode, last):
    """convgen's own checks of the shapes and parameters, where the sizes are known numbers (eager
    calls, and traces with static shapes), so a bad call fails where it is made, with convgen's message."""
    if all(isinstance(n, int) for n in (*x.shape, *weight.shape)):  # symbolic sizes: checked when run
        _problem(kind, x, weight, stride, padding, output_padding, dilation, groups, padding_mode, last)


def _schema(inputs: str, returns: str) -> str:
    return (f"({inputs}, SymInt[] stride, SymInt[] padding, SymInt[] output_padding, SymInt[] dilation, "
            f"SymInt groups, str algorithm, str padding_mode=\"zeros\") -> {returns}")


def _define(kind: Kind):
    """Register the forward and backward custom ops of one kind, their fake implementations and the
    forward's autograd formula; returns the forward op."""

    def forward(x, weight, bias, stride, padding, output_padding, dilation, groups, algorithm,
                 padding_mode="zeros"):
        params = (stride, padding, output_padding, dilation, groups, algorithm, padding_mode)
        # (below autograd: whether the weights are being trained is not known here, so only weights
        # that cannot be are laid out once)
        return bound_call(kind, x, weight, bias, params).forward(x, weight, bias, trained=weight.requires_grad)

    def forward_fake(x, weight, bias, stride, padding, output_padding, dilation, groups, algorithm,
                      padding_mode="zeros"):
        last = channels_last(kind, x)
        _check_geometry(kind, x, weight, stride, padding, output_padding, dilation, groups, padding_mode, last)
        shape = output_shape(kind, x.shape, weight.shape, stride, padding, output_padding, dilation, groups)
        return _empty_image(kind, x, shape, last)

    def backward(dy, x, weight, stride, padding, output_padding, dilation, groups, algorithm,
                  padding_mode="zeros"):
        params = (stride, padding, output_padding, dilation, groups, algorithm, padding_mode)
        bound = bound_call(kind, x, weight, None, params)  # dy follows x's layout, whatever its own strides
        dx, dw = bound.gradients(dy, x, weight, True, True)
        return dx, dw, dy.sum(bound.bias_axes)

    def backward_fake(dy, x, weight, stride, padding, output_padding, dilation, groups, algorithm,
                       padding_mode="zeros"):
        last = channels_last(kind, x)
        return (_empty_image(kind, x, x.shape, last), _empty_weight(kind, weight, last),
                weight.new_empty([kind.out_channels(weight.shape, groups)]))

    forward_op = torch.library.custom_op(
        f"{NAMESPACE}::{kind.name}", forward, mutates_args=(), device_types="cpu",
        schema=_schema("Tensor x, Tensor weight, Tensor? bias", "Tensor"))
    forward_op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(
        f"{NAMESPACE}::{kind.backward}", backward, mutates_args=(), device_types="cpu",
        schema=_schema("Tensor dy, Tensor x, Tensor weight", "(Tensor, Tensor, Tensor)"))
    backward_op.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        x, weight, _, *params = inputs
        ctx.save_for_backward(x, weight)
        ctx.params = params

    def gradients(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        dx = dw = db = None
        # convgen computes dx beside dw (there is no dw-only entry point); the adjoint convolution gives
        # dx alone only over zero padding
        if need_w or (need_x and ctx.params[-1] != "zeros"):
            dx, dw, db = backward_op(dy, x, weight, *ctx.params)
        elif need_x:
            dx = _input_gradient(kind, dy, x, weight, *ctx.params)
        if need_bias and db is None:
            db = dy.sum([0, *range(2, kind.spatial + 2)])
        return (dx if need_x else None, dw, db if need_bias else None) + (None,) * len(ctx.params)

    forward_op.register_autograd(gradients, setup_context=setup_context)
    return forward_op


def _input_gradient(kind: Kind, dy, x, weight, stride, padding, output_padding, dilation, groups, algorithm,
                    padding_mode):
    """dx alone, as the adjoint convolution's forward pass (one kernel call instead of two).

    conv2d's dx is conv_transpose2d(dy) with the output padding that restores x's size (the rows the
    strided windows never reached); conv_transpose2d's dx is conv2d(dy), cut to x's size where an
    output padding of stride or more (with dilation > stride) added rows that no input feeds.
    """
    adjoint = KINDS[kind.adjoint]
    spatial = x.shape[2:]
    if adjoint.transposed:
        restore = [(n + padding[2 * i] + padding[2 * i + 1] - dilation[i] * (weight.shape[2 + i] - 1) - 1) % stride[i]
                   for i, n in enumerate(spatial)]
    else:
        restore = [0] * kind.spatial
    dx = OPS[adjoint.name](dy, weight, None, stride, padding, restore, dilation, groups, algorithm, padding_mode)
    if list(dx.shape[2:]) != list(spatial):
        dx = dx[(slice(None), slice(None), *(slice(0, n) for n in spatial))]
    return dx


OPS = {name: _define(kind) for name, kind in KINDS.items()}  # name -> the registered forward op


# ------------------------------------------------------------------- eager calls: checked once
# An eager call (no torch.compile, export or tracing of any kind at work) of a signature seen before
# -- the same kind, tensor shapes, strides and dtypes, the same parameters, convgen settings and
# thread count -- skips the argument checks and the custom-op dispatch and runs the kernels on the
# tensors' memory; with autograd wanted, through a `torch.autograd.Function` of the same kernels. The
# custom ops stay what tracing records. On a tiny convolution this cuts the cost of a call from PyTorch
# to that of convgen's NumPy op (bench/overhead.py).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_BOUND: dict = {}  # call signature -> Bound
_BOUND_MAX = 1024
# (the tests of `_eager`, looked up once: on a tiny convolution each attribute lookup counts)
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_transforms = torch._C._are_functorch_transforms_active
_tracing = torch._C._get_tracing_state


def _eager(x, weight, bias) -> bool:
    """Whether this call may skip the custom op: plain CPU tensors, and nothing that records or
    transforms the call (dynamo, a dispatch mode such as make_fx's or FakeTensorMode's, functorch
    transforms, the JIT tracer)."""
    if type(x) not in _PLAIN or type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN):
        return False
    if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)):
        return False
    return not (_is_compiling() or _dispatch_modes() or _functorch_transforms() or _tracing())


def _parameter_key(value):
    """A parameter as part of a hashable key, equal to no differently typed value (True is not 1)."""
    kind = type(value)
    if kind is int or kind is str:
        return value
    if kind is tuple or kind is list or kind is torch.Size:
        return tuple(_parameter_key(v) for v in value)
    return (kind, value)


def _immutable(value) -> bool:
    """Whether `value` is an int, str, bool or None, or a tuple of such values: what an equal object
    of the same identity always is."""
    kind = type(value)
    if kind is tuple or kind is torch.Size:
        return all(_immutable(v) for v in value)
    return kind is int or kind is str or kind is bool or value is None


# The parameters of recent calls by identity -> (those parameter objects, their key), for parameters
# of immutable values only: the entry holds the objects, so their ids are not reused while it lives,
# and the same objects of immutable values are the same parameters. A module passes the same stride
# and padding objects on every call, and so does a call written with constants; the key of the
# values themselves (`_parameter_key`) costs a few microseconds, as much as a tiny convolution.
_PARAMETER_KEYS: dict = {}


def _parameters_key(params) -> tuple:
    ids = tuple(map(id, params))
    found = _PARAMETER_KEYS.get(ids)
    if found is not None:
        return found[1]
    key = tuple([_parameter_key(p) for p in params])
    if all(_immutable(p) for p in params):
        if len(_PARAMETER_KEYS) >= _BOUND_MAX:
            _PARAMETER_KEYS.clear()
        _PARAMETER_KEYS[ids] = (params, key)
    return key


def _eager_key(kind_name, x, weight, bias, params):
    try:
        return (kind_name, x.shape, x.stride(), x.dtype, weight.shape, weight.stride(), weight.dtype,
                None if bias is None else (bias.shape, bias.stride(), bias.dtype),
                _parameters_key(params), settings(), torch.get_num_threads(), wisdom.generation())
    except TypeError:  # an unhashable parameter: the checks will say what is wrong with it
        return None


def _version(tensor):
    """The tensor's version counter, or None for an inference tensor, which has none. (Asked, not
    tested first with torch.is_inference: that costs a tenth of a microsecond more on every call.)"""
    try:
        return tensor._version
    except RuntimeError:
        return None


class LaidOut:
    """One entry point's weights laid out once (`Kernels.prepare_weights`: packed panels, Winograd's
    transformed filters), for as long as the weight tensor keeps its values.

    Only weights no gradient is taken of (inference: `torch.no_grad`, `torch.inference_mode`, or
    weights that do not require it), and only from the second call that sees the same values: a weight
    that will be trained is never laid out ahead (its calls lay it out themselves, as before), and
    neither is one that `torch.autograd.gradcheck` perturbs. "The same values" is PyTorch's own test:
    the same tensor object, data pointer and version counter, which every in-place change through
    the tensor, its views or `detach()` bumps (optimizer steps, `load_state_dict`, `torch.nn.init`,
    `copy_`). Writes through `.data` or a NumPy view are invisible to it, as they are to autograd:
    after them, `forget_laid_out_weights()`.
    """

    __slots__ = ("entry", "states")
    NONE = (None, 0)  # nothing laid out: the kernels read the weights as they are, or lay them out themselves

    def __init__(self, entry: str):
        self.entry = entry
        # id(weight) -> (weakref to it, its data pointer, version, the kernels, (laid out, its address), or
        # None before the second call), one per weight tensor: layers of the same signature (ResNet's
        # repeated blocks) share a Bound
        self.states: dict = {}

    def get(self, kernels, problem, weight, threads: int, trained: bool):
        """(the laid-out weights for this call, their address), or `NONE`. `weight`: in the layout's
        order and kept, as `Bound._weight` says (a copy new on every call is never asked about).
        `trained`: a gradient of the weights is being taken (their values will change, or are being
        perturbed). (The caller holds the array until the kernel returns: another thread may drop it
        from here meanwhile. Its address is kept with it: NumPy's `ctypes.data` costs a microsecond
        and a half, more than a tiny convolution's whole C call.)"""
        version = None if trained else _version(weight)
        if version is None:
            return self.NONE
        key, address = id(weight), weight.data_ptr()
        state = self.states.get(key)
        if (state is None or state[0]() is not weight or state[1] != address or state[2] != version
                or state[3] is not kernels):
            # seen once with these values: not laid out yet (a training step changes them before the next call)
            self.states[key] = (weakref.ref(weight, functools.partial(self._dropped, key)), address, version,
                                kernels, None)
            return self.NONE
        laid_out = state[4]
        if laid_out is None:  # the second call with these values
            array = kernels.prepare_weights(self.entry, problem, address, threads)
            laid_out = self.NONE if array is None else (array, array.ctypes.data)
            self.states[key] = (*state[:4], laid_out)
        return laid_out

    def _dropped(self, key, reference) -> None:
        """The weight tensor is gone: so is its layout (unless its id already names another's)."""
        state = self.states.get(key)
        if state is not None and state[0] is reference:
            del self.states[key]


def forget_laid_out_weights() -> None:
    """Drop every weight layout kept for eager calls (`LaidOut`), and every copy of weights in a
    layout's order (`Bound._weight`): the next calls make them afresh. For programs that write
    weights where PyTorch's version counter does not see it (`.data`, NumPy)."""
    for bound in list(_BOUND.values()):
        bound.forward_weights.states.clear()
        bound.input_gradient_weights.states.clear()
        bound.relaid_weights.clear()


class Bound:
    """An eager call signature, checked and planned once by convgen's own front end: what each call
    of it runs. `forward` gives y; `gradients` (dx, dw), either alone if only it is needed. The
    weights of the forward pass and of the input gradient are laid out once per weight value
    (`LaidOut`)."""

    __slots__ = ("kind", "last", "unbatched", "forward_call", "backward_call", "params", "y_shape",
                 "x_ready", "weight_ready", "weight_stride", "bias_axes", "forward_weights", "input_gradient_weights",
                 "relaid_weights", "image_strides", "dw_strides")

    def __init__(self, kind: Kind, x, weight, bias, params, unbatched: bool):
        """x is batched; `unbatched`: the calls of this signature give it without its batch dimension."""
        self.kind, self.params, self.unbatched = kind, params, unbatched
        last = self.last = channels_last(kind, x)
        x_array, w_array = image_array(kind, x, last), weight_array(kind, weight, last)
        kwargs = _convgen_kwargs(kind, *params, last)
        self.forward_call = convgen_ops.prepare(
            kind.forward, (x_array, w_array, None if bias is None else _numpy(bias.contiguous())), **kwargs)
        self.backward_call = None  # planned on the first backward pass
        self.y_shape = self.forward_call.resolved.result_shapes[0]  # in the layout's order
        self.x_ready = x.is_contiguous() if not last else x.permute(kind.to_last).is_contiguous()
        self.weight_ready = weight_in_layout(kind, weight, last)
        self.weight_stride = weight.stride()
        self.bias_axes = [0, *range(2, kind.spatial + 2)]
        transpose = self.forward_call.problem.transpose
        self.forward_weights = LaidOut("bwd_data" if transpose else "fwd")
        self.input_gradient_weights = LaidOut("fwd" if transpose else "bwd_data")
        # id(weight) -> (weakref to it, its data pointer, version, its copy in the layout's order), for
        # weights that do not lie in it and that no gradient is taken of (see `_weight`)
        self.relaid_weights: dict = {}
        self.image_strides: dict = {}  # an image's shape in the layout's order -> its logical shape, strides and bytes
        self.dw_strides = None  # a weight gradient's strides in the layout's order, made on first use

    def _x(self, x):
        return x if self.x_ready else _in_layout(self.kind, x, self.last)

    def _weight_as_planned(self, weight) -> bool:
        # (the strides are compared because a module's weight may have been re-laid, by `relay_weight`,
        # between a forward pass and its backward pass)
        return self.weight_ready and weight.stride() == self.weight_stride

    def _weight(self, weight, trained: bool = True) -> tuple[torch.Tensor, bool]:
        """(the weights in the layout's order, whether they keep their values while they live): the
        tensor itself when it lies so (LaidOut checks its values); else a copy, new on every call when
        a gradient of the weights is taken (`trained`: their values change between calls), else made
        once per weight value, as `LaidOut` keys its layouts, and kept."""
        if self._weight_as_planned(weight):
            return weight, True
        version = None if trained else _version(weight)
        if version is None:
            return _weight_in_layout(self.kind, weight, self.last), False
        key, address = id(weight), weight.data_ptr()
        state = self.relaid_weights.get(key)
        if state is None or state[0]() is not weight or state[1] != address or state[2] != version:
            with torch.inference_mode(False):  # (a normal tensor, which LaidOut can key, under inference_mode too)
                copy = _weight_in_layout(self.kind, weight, self.last)
            state = self.relaid_weights[key] = (weakref.ref(weight, functools.partial(self._relaid_dropped, key)),
                                                address, version, copy)
        return state[3], True

    def _relaid_dropped(self, key, reference) -> None:
        state = self.relaid_weights.get(key)
        if state is not None and state[0] is reference:
            del self.relaid_weights[key]

    def _image(self, array_shape, like):
        """A new tensor of the layout's shape, as the logical (N, C, *spatial) tensor it holds (made
        with the logical shape and the layout's strides: no permuted view per call)."""
        found = self.image_strides.get(array_shape)
        if found is None:
            t = torch.empty(array_shape, dtype=like.dtype, device="meta")
            t = t.permute(self.kind.from_last) if self.last else t
            found = self.image_strides[array_shape] = (t.shape, t.stride(), t.numel() * like.element_size())
        shape, strides, nbytes = found
        t = torch.empty_strided(shape, strides, dtype=like.dtype)
        if nbytes >= HUGE_PAGES_MIN_BYTES:  # (smaller ones: not worth the call)
            advise_huge_pages(t.data_ptr(), nbytes)
        return t

    def run(self, x, weight, bias):
        """y for an eager call, recorded for autograd when a gradient is wanted."""
        if self.unbatched:
            return _run_batched(self, x.unsqueeze(0), weight, bias).squeeze(0)
        return _run_batched(self, x, weight, bias)

    def forward(self, x, weight, bias, trained: bool, weight_in_order=None):
        """y; `trained`: a gradient of the weights will be taken (they are not laid out ahead).
        `weight_in_order`: what `_weight(weight, trained)` gives, if the caller has it already."""
        call = self.forward_call
        problem = call.problem
        xa, (wa, kept) = self._x(x), weight_in_order or self._weight(weight, trained)
        y = self._image(self.y_shape, x)
        if call.empty:  # no input values: every output is the bias alone
            y.zero_()
        elif call.adjoint is not None:  # (a transposed call's output: conv2d's forward call has no adjoint)
            _adjoint_input_gradient(call, xa, wa, y, torch.get_num_threads())
        else:
            kernels, threads = call.kernels(), torch.get_num_threads()
            laid_out, laid_out_address = (self.forward_weights.get(kernels, problem, wa, threads, trained) if kept
                                          else LaidOut.NONE)
            if not problem.transpose:
                bias_address = 0 if bias is None else bias.contiguous().data_ptr()
                kernels.call_addresses("fwd", problem, (xa.data_ptr(), wa.data_ptr(), laid_out_address,
                                                        bias_address, 0, y.data_ptr()), threads)
            else:
                kernels.call_addresses("bwd_data", problem, (xa.data_ptr(), wa.data_ptr(), laid_out_address,
                                                             y.data_ptr()), threads)
        if bias is not None and (call.empty or problem.transpose):
            y += bias.view(-1, *([1] * self.kind.spatial))
        return y

    def _planned_backward(self):
        if self.backward_call is None:
            kind, last = self.kind, self.last
            dy = np.empty(self.y_shape, self.forward_call.resolved.dtype)
            x_shape, w_shape = self.forward_call.problem.input_shape, self.forward_call.problem.weight_shape
            self.backward_call = convgen_ops.prepare(
                kind.backward, (dy, np.empty(x_shape, dy.dtype), np.empty(w_shape, dy.dtype)),
                **_convgen_kwargs(kind, *self.params, last))
        return self.backward_call

    def gradients(self, dy, x, weight, need_x: bool, need_w: bool, weight_in_order=None):
        """(dx, dw) of dy, each None unless needed. `weight_in_order`: what `_weight` gave the forward
        pass of these weights (a copy of them in the layout's order is not made again)."""
        call = self._planned_backward()
        if call.empty:  # nothing multiplied: empty sums
            return (torch.zeros_like(x) if need_x else None), (torch.zeros_like(weight) if need_w else None)
        problem, kernels, threads = call.problem, call.kernels(), torch.get_num_threads()
        # (the backward pass runs without grad mode: whether the weights are trained is theirs to say)
        dya = _in_layout(self.kind, dy, self.last)
        wa, kept = weight_in_order or self._weight(weight, weight.requires_grad)
        dx = dw = None
        if need_x and call.adjoint is not None:  # (conv2d's dx: a transposed call's backward has no adjoint)
            dx = self._image(problem.input_shape, dy)
            _adjoint_input_gradient(call, dya, wa, dx, threads)
        elif need_x:
            dx = self._image(problem.input_shape, dy)
            laid_out, laid_out_address = (
                self.input_gradient_weights.get(kernels, problem, wa, threads, weight.requires_grad) if kept
                else LaidOut.NONE)
            if not problem.transpose:
                kernels.call_addresses("bwd_data", problem, (dya.data_ptr(), wa.data_ptr(), laid_out_address,
                                                             dx.data_ptr()), threads)
            else:
                kernels.call_addresses("fwd", problem, (dya.data_ptr(), wa.data_ptr(), laid_out_address, 0, 0,
                                                        dx.data_ptr()), threads)
        if need_w:
            xa = self._x(x)
            # dw takes the weights' own strides when they lie in the layout's order (the same memory
            # order, whatever strides their size-1 axes carry): PyTorch's gradient layout contract,
            # which DistributedDataParallel's buckets check
            if self._weight_as_planned(weight):
                dw = torch.empty_strided(weight.shape, weight.stride(), dtype=dy.dtype)
                dw_address = dw.data_ptr()
            else:  # (the layout's order, as the weights' shape: no permuted view made per call)
                if self.dw_strides is None:
                    t = torch.empty(problem.weight_shape, device="meta")
                    self.dw_strides = (t.permute(self.kind.weight_from_last) if self.last else t).stride()
                dw = torch.empty_strided(weight.shape, self.dw_strides, dtype=dy.dtype)
                dw_address = dw.data_ptr()
            first, second = (dya, xa) if not problem.transpose else (xa, dya)
            kernels.call_addresses("bwd_weight", problem, (first.data_ptr(), second.data_ptr(), dw_address), threads)
        return dx, dw


def _adjoint_input_gradient(call, dy, weight, out, threads: int) -> None:
    """conv2d's input gradient of `call`'s problem into `out`, as the adjoint forward convolution of
    dy with the weights (in the layout's order) flipped (`convgen.frontend.ops.input_gradient`)."""
    adjoint, shape = call.adjoint, call.problem.weight_shape
    # (the weights' memory is the layout's order, whatever their tensor's shape: viewed as that array)
    in_layout = _numpy(weight.as_strided(shape, [int(np.prod(shape[i + 1:])) for i in range(len(shape))]))
    flipped = convgen_ops.adjoint_weights(in_layout, adjoint.problem.groups, adjoint.problem.layout)
    adjoint.kernels().call_addresses("fwd", adjoint.problem, (dy.data_ptr(), flipped.ctypes.data, 0, 0, 0,
                                                              out.data_ptr()), threads)


class _EagerAutograd(torch.autograd.Function):
    """An eager call with autograd: y from the kernels; in the backward pass dx and dw from the
    kernels (only those wanted), db summed by PyTorch."""

    @staticmethod
    def forward(ctx, bound, x, weight, bias):
        ctx.bound = bound
        trained = weight.requires_grad
        in_order = bound._weight(weight, trained)
        # a copy of the weights in the layout's order is kept for the backward pass (autograd's check
        # of the saved weights' version guards it too)
        ctx.kept = in_order[1]
        ctx.save_for_backward(x, weight, None if in_order[0] is weight else in_order[0])
        return bound.forward(x, weight, bias, trained, in_order)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, copy = ctx.saved_tensors
        bound = ctx.bound
        need_x, need_w, need_bias = ctx.needs_input_grad[1:4]
        # (without a copy the weights are read where they lie now: a call on the other layout may have
        # re-laid them since the forward pass)
        in_order = None if copy is None else (copy, ctx.kept)
        dx, dw = bound.gradients(dy, x, weight, need_x, need_w, in_order) if need_x or need_w else (None, None)
        db = dy.sum(bound.bias_axes) if need_bias else None
        return None, dx, dw, db


def _wants_gradient(x, weight, bias) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


def _run_batched(bound: Bound, x, weight, bias):
    if _wants_gradient(x, weight, bias):
        return _EagerAutograd.apply(bound, x, weight, bias)
    return bound.forward(x, weight, bias, trained=False)


def _remember(key, bound) -> None:
    if len(_BOUND) >= _BOUND_MAX:
        _BOUND.clear()
    _BOUND[key] = bound


def bound_call(kind: Kind, x, weight, bias, params) -> Bound:
    """The Bound of a custom op's call (explicit parameter lists), made on its first call."""
    key = _eager_key(("op", kind.name), x, weight, bias, params)
    bound = _BOUND.get(key)
    if bound is None:
        bound = Bound(kind, x, weight, bias, params, unbatched=False)
        _remember(key, bound)
    return bound


# ----------------------------------------------------------------------------- public functions
# The algorithm a call whose gradients are wanted passes for "auto", in eager calls and in traced
# graphs alike: the planner's "auto" for the calls of a training step, which takes Winograd only with
# a tile whose rounding does not compound through the step (see convgen.planning.planner).
AUTO_FOR_TRAINING = "auto-training"


def _check_tensors(kind: Kind, x, weight, bias):
    """The tensor arguments: CPU tensors of one convgen dtype, the right number of dimensions."""
    for name, t in (("input", x), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be float32 or float64 (the dtypes convgen computes), got {t.dtype}")
        if t.device.type not in ("cpu", "meta"):
            raise ValueError(f"{name} is on device {t.device}; convgen runs on the CPU (move it with .cpu())")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"input and {name} must share one dtype; got input {x.dtype}, {name} {t.dtype}")
    if x.dim() not in (kind.spatial + 1, kind.spatial + 2):
        raise ValueError(f"input must be a {kind.spatial + 2}-D batch (N, C, {'H, W' if kind.spatial == 2 else '...'}) "
                         f"or one unbatched {kind.spatial + 1}-D sample, got shape {tuple(x.shape)}")
    if weight.dim() != kind.spatial + 2:
        raise ValueError(f"weight must have {kind.spatial + 2} dimensions, got shape {tuple(weight.shape)}")
    if bias is not None and bias.dim() != 1:
        raise ValueError(f"bias must be 1-D (one value per output channel), got shape {tuple(bias.shape)}")


def _module_weight_needs_relaying(bound: Bound, weight) -> bool:
    """Whether a module's weight should be re-laid for this eager call: a Parameter (never a tensor
    computed from one), not in the order the call's layout reads, and not in a torch.distributed
    process (DistributedDataParallel's gradient buckets keep the strides the weights had when it was
    built: a change of them mixes up the gradients it hands back)."""
    return (not bound.weight_ready and type(weight) is torch.nn.Parameter
            and not (torch.distributed.is_available() and torch.distributed.is_initialized()))


def apply(kind_name: str, x, weight, bias, stride, padding, output_padding, dilation, groups, algorithm,
          padding_mode="zeros", *, module_weight=False):
    """Check a public call's arguments, resolve them to the op's explicit lists and run the op (an
    eager call of a signature checked before runs its `Bound` at once).

    `module_weight`: the weight is a convgen module's own Parameter, which the second eager call of a
    signature re-lays in the memory order its input's layout reads (`relay_weight`), so that no
    later call copies it (the first call is planned, and runs, on the weight as it lies).
    """
    key = None
    if _eager(x, weight, bias):
        wants_gradient = _wants_gradient(x, weight, bias)
        key = _eager_key(kind_name, x, weight, bias, (stride, padding, output_padding, dilation, groups, algorithm,
                                                      padding_mode, wants_gradient))
        bound = _BOUND.get(key) if key is not None else None
        if bound is not None:
            if module_weight and _module_weight_needs_relaying(bound, weight):
                relay_weight(bound.kind, weight, bound.last)  # then the call is of another signature:
                return apply(kind_name, x, weight, bias, stride, padding, output_padding, dilation, groups,
                             algorithm, padding_mode)
            if bound.unbatched:
                return bound.run(x, weight, bias)
            # (what `run` does, a call or two shorter: on a tiny convolution every call counts)
            if wants_gradient:
                return _EagerAutograd.apply(bound, x, weight, bias)
            return bound.forward(x, weight, bias, False)
    kind = KINDS[kind_name]
    _check_tensors(kind, x, weight, bias)
    unbatched = x.dim() == kind.spatial + 1
    if unbatched:
        x = x.unsqueeze(0)
    stride = _ints("stride", stride, kind.spatial)
    dilation = _ints("dilation", dilation, kind.spatial)
    groups = as_int("groups", groups)
    algorithm = as_algorithm(algorithm)
    padding_mode = as_padding_mode(padding_mode)
    if kind.transposed and padding_mode != "zeros":
        raise ValueError(f"{kind.name} pads with zeros only (as PyTorch's), got padding_mode={padding_mode!r}")
    pads, implied = kind.resolve_padding(padding, tuple(weight.shape[2:]), stride, dilation, x.shape[2:],
                                         kind.transposed)
    if kind.transposed:
        given = _ints("output_padding", output_padding, kind.spatial, minimum=0)
        if implied is not None:  # padding="same" fixes the output size, so the output padding too
            if any(given):
                raise ValueError(f"output_padding must be 0 with padding='same' (the output is input·stride), "
                                 f"got {output_padding!r}")
            given = implied
        output_padding = given
    else:
        output_padding = [0] * kind.spatial
    if algorithm == "auto" and _wants_gradient(x, weight, bias):
        algorithm = AUTO_FOR_TRAINING  # (decided where the sizes are known: in the Bound)
    if key is not None:
        params = (stride, pads, output_padding, dilation, groups, algorithm, padding_mode)
        bound = Bound(kind, x, weight, bias, params, unbatched)
        _remember(key, bound)
        y = _run_batched(bound, x, weight, bias)
    else:
        y = OPS[kind.name](x, weight, bias, stride, pads, output_padding, dilation, groups, algorithm, padding_mode)
    return y.squeeze(0) if unbatched else y


__all__ = ["KINDS", "OPS", "Bound", "Kind", "apply", "channels_last", "output_shape", "relay_weight"]
