"""Convolution layers for plain-NumPy training loops: parameters, gradients and the two passes.

A layer owns its weight and bias, calls the ops in `convgen.frontend.ops` for both passes and keeps what the
backward pass needs from the forward one. It does no optimization itself: `parameters()` and
`gradients()` return matching lists that an optimizer updates in place, e.g.

>>> layer = Conv2d(3, 8, 3, padding=1, rng=0)            # doctest: +SKIP
>>> y = layer(x)                                         # doctest: +SKIP
>>> dx = layer.backward(dy)                              # doctest: +SKIP
>>> for p, g in zip(layer.parameters(), layer.gradients()):
...     p -= 0.01 * g                                    # doctest: +SKIP
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..planning import ndspec
from .ndops import (as_output_padding_nd, conv1d, conv1d_backward, conv3d, conv3d_backward, conv_transpose1d,
                    conv_transpose1d_backward, conv_transpose3d, conv_transpose3d_backward)
from .ops import conv2d, conv2d_backward, conv_transpose2d, conv_transpose2d_backward
from ..planning.planner import as_algorithm
from .resolve import as_flag, as_float_dtype, as_layout, as_padding_mode, groups_dividing, as_output_padding
from ..planning.spec import as_int, as_pair, explicit_padding


def _generator(rng) -> np.random.Generator:
    """None (fresh entropy), an int seed or a numpy Generator, as a Generator."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, numbers.Integral) and not isinstance(rng, (bool, np.bool_))):
        if rng is not None and rng < 0:
            raise ValueError(f"rng must be a non-negative seed, got {rng}")
        return np.random.default_rng(rng)
    raise TypeError(f"rng must be None, an int seed or a numpy.random.Generator, got {type(rng).__name__}")


def _pair_text(values) -> str:
    """Per-axis values as an argument: one value when they are all equal, else the tuple."""
    return str(values[0]) if len(set(values)) == 1 else str(tuple(values))


def _padding_text(padding) -> str:
    if isinstance(padding, str):
        return repr(padding)
    if all(before == after for before, after in padding):
        return _pair_text([before for before, _ in padding])
    return str(padding)


class _ConvLayer:
    """What every layer shares: checked hyperparameters, the parameters and their gradients.

    Subclasses say how many spatial axes they have (`_rank`), how the weight is shaped, how many
    products feed one output (for the He initialization) and which ops run the two passes.
    """

    _rank = 2  # spatial axes: 1, 2 or 3

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                 padding_mode, dtype, layout, specialize, algorithm, rng):
        self.in_channels = as_int("in_channels", in_channels)
        self.out_channels = as_int("out_channels", out_channels)
        self.kernel_size = self._per_axis("kernel_size", kernel_size)
        self.stride = self._per_axis("stride", stride)
        self.padding = explicit_padding(padding) if self._rank == 2 else ndspec.explicit_padding(padding, self._rank)
        self.dilation = self._per_axis("dilation", dilation)
        self.groups = groups_dividing(groups, self.in_channels, self.out_channels, "in_channels", "out_channels")
        has_bias = as_flag("bias", bias)
        self.padding_mode = self._checked_padding_mode(padding_mode)
        self.dtype = as_float_dtype(dtype)
        self.layout = as_layout(layout) if self._rank == 2 else ndspec.as_rank_layout(layout, self._rank)
        self.specialize = as_flag("specialize", specialize)
        self.algorithm = as_algorithm(algorithm)
        rng = _generator(rng)

        # He et al. (2015): std sqrt(2 / fan_in) keeps the activations' scale through ReLU layers.
        std = math.sqrt(2.0 / self._fan_in())
        self.weight = (rng.standard_normal(self._weight_shape()) * std).astype(self.dtype)
        self.bias = np.zeros(self.out_channels, dtype=self.dtype) if has_bias else None
        self.dw = None
        self.db = None
        self._x = None

    def _per_axis(self, name, value, minimum=1) -> tuple:
        """An int or one value per spatial axis, as a tuple of `_rank` ints."""
        if self._rank == 2:
            return as_pair(name, value, minimum)
        return ndspec.as_values(name, value, self._rank, minimum)

    @property
    def _channels_last(self) -> bool:
        return self.layout.endswith("C")

    # -- what the subclasses define
    def _checked_padding_mode(self, padding_mode) -> str:
        return as_padding_mode(padding_mode)

    def _weight_shape(self) -> tuple:
        raise NotImplementedError

    def _fan_in(self) -> float:
        raise NotImplementedError

    def _op_kwargs(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups,
                    layout=self.layout, specialize=self.specialize, algorithm=self.algorithm,
                    padding_mode=self.padding_mode)

    # -- the two passes
    def _check_input(self, x):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x must be a NumPy array, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(f"x must have the layer's dtype {self.dtype}, got {x.dtype}")
        if x.ndim not in (self._rank + 1, self._rank + 2):
            raise ValueError(f"x must be a {self._rank + 2}-D {self.layout} batch or one unbatched "
                             f"{self._rank + 1}-D {self.layout[1:]} image, got shape {x.shape}")
        channels = x.shape[-1] if self._channels_last else x.shape[x.ndim - self._rank - 1]
        if channels != self.in_channels:
            raise ValueError(f"x has {channels} channels (shape {x.shape}, {self.layout}), "
                             f"the layer expects in_channels={self.in_channels}")

    def forward(self, x):
        """y for a batch x in the layer's layout and dtype (or one unbatched image, giving an unbatched
        y); x is kept (not copied) for `backward`."""
        self._check_input(x)
        y = self._forward(x)
        self._x = x
        return y

    __call__ = forward

    def backward(self, dy):
        """dx for dy = ∂L/∂y of the last `forward`; stores dw (and db) beside weight (and bias)."""
        if self._x is None:
            raise RuntimeError(f"{type(self).__name__}.backward needs a forward pass first")
        dx, dw, db = self._backward(dy, self._x)
        self.dw = dw
        self.db = db if self.bias is not None else None
        return dx

    def _forward(self, x):
        raise NotImplementedError

    def _backward(self, dy, x):
        raise NotImplementedError

    # -- for an optimizer
    def parameters(self) -> list:
        """[weight, bias] (or [weight] without bias): the arrays an optimizer updates in place."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def gradients(self) -> list:
        """[dw, db] (or [dw]) from the last `backward`, in the order of `parameters()`."""
        if self.dw is None:
            raise RuntimeError(f"{type(self).__name__}.gradients needs a backward pass first")
        return [self.dw] if self.bias is None else [self.dw, self.db]

    def _repr_extra(self) -> str:
        return ""

    def __repr__(self) -> str:
        parts = [str(self.in_channels), str(self.out_channels), f"kernel_size={_pair_text(self.kernel_size)}"]
        if set(self.stride) != {1}:
            parts.append(f"stride={_pair_text(self.stride)}")
        if self.padding != ((0, 0),) * self._rank:
            parts.append(f"padding={_padding_text(self.padding)}")
        parts.append(self._repr_extra())
        if set(self.dilation) != {1}:
            parts.append(f"dilation={_pair_text(self.dilation)}")
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        if self.bias is None:
            parts.append("bias=False")
        if self.padding_mode != "zeros":
            parts.append(f"padding_mode={self.padding_mode!r}")
        parts += [f"dtype={self.dtype.name}", f"layout={self.layout!r}", f"specialize={self.specialize}"]
        if self.algorithm != "auto":
            parts.append(f"algorithm={self.algorithm!r}")
        return f"{type(self).__name__}({', '.join(p for p in parts if p)})"


class _Convolution(_ConvLayer):
    """A convolution layer of any rank: weight (out, in/groups, *kernel) channels-first, (*kernel,
    in/groups, out) channels-last; the ops of its rank run the passes (`_ops`: forward, backward)."""

    _ops = (conv2d, conv2d_backward)

    def _weight_shape(self):
        inner = (self.in_channels // self.groups, self.out_channels)
        return (*self.kernel_size, *inner) if self._channels_last else (*inner[::-1], *self.kernel_size)

    def _fan_in(self):
        return self.in_channels // self.groups * math.prod(self.kernel_size)

    def _forward(self, x):
        return self._ops[0](x, self.weight, self.bias, **self._op_kwargs())

    def _backward(self, dy, x):
        return self._ops[1](dy, x, self.weight, **self._op_kwargs())


class Conv2d(_Convolution):
    """A 2-D convolution layer (as `torch.nn.Conv2d`) on NumPy arrays, with its gradients.

    Weight (out_channels, in_channels/groups, KH, KW) for layout "NCHW", (KH, KW,
    in_channels/groups, out_channels) for "NHWC", drawn from N(0, 2/fan_in) with fan_in =
    in_channels/groups · KH · KW; bias zeros (None with bias=False). padding takes every form
    `convgen.conv2d` does (int, pair, ((top, bottom), (left, right)), "valid", "same").
    The positional arguments are torch's, in torch's order; the rest are keyword-only: `dtype`
    (float32 or float64), `layout` ("NCHW" or "NHWC"), `specialize` and `algorithm` ("auto",
    "direct", "winograd" or "depthwise") as for `convgen.conv2d`, and `rng` (None, an int seed or a
    numpy Generator) for the initial weights. `padding_mode` is torch's: "zeros", "reflect",
    "replicate" or "circular", as for `convgen.conv2d` (reflect pads less than the input, circular
    at most the input: checked on each call, against that input).

    `forward(x)` (also `layer(x)`) returns y and keeps x; `backward(dy)` returns dx and stores
    `.dw` and `.db` (None without bias).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", *, dtype=np.float32, layout="NCHW", specialize=True,
                 algorithm="auto", rng=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype, layout, specialize, algorithm, rng)


class _TransposedConvolution(_ConvLayer):
    """A transposed convolution layer of any rank: weight (in, out/groups, *kernel) channels-first,
    (*kernel, out/groups, in) channels-last; padding_mode "zeros" only, as torch."""

    _ops = (conv_transpose2d, conv_transpose2d_backward)

    def _checked_output_padding(self, output_padding, stride, dilation, padding):
        if self._rank == 2:
            return as_output_padding(output_padding, stride, dilation, padding)
        return as_output_padding_nd(output_padding, self._per_axis("stride", stride),
                                    self._per_axis("dilation", dilation), padding, self._rank)

    def _checked_padding_mode(self, padding_mode):
        if padding_mode != "zeros":  # torch refuses the other modes for transposed convolution too
            raise ValueError(f"padding_mode must be 'zeros' for {type(self).__name__}, got {padding_mode!r}")
        return padding_mode

    def _weight_shape(self):
        inner = (self.out_channels // self.groups, self.in_channels)
        return (*self.kernel_size, *inner) if self._channels_last else (*inner[::-1], *self.kernel_size)

    def _fan_in(self):
        taps = math.prod(self.kernel_size) / math.prod(self.stride)
        return max(self.in_channels // self.groups * taps, 1.0)

    def _op_kwargs(self):
        return dict(super()._op_kwargs(), output_padding=self.output_padding)

    def _repr_extra(self):
        return f"output_padding={_pair_text(self.output_padding)}" if set(self.output_padding) != {0} else ""

    def _forward(self, x):
        return self._ops[0](x, self.weight, self.bias, **self._op_kwargs())

    def _backward(self, dy, x):
        return self._ops[1](dy, x, self.weight, **self._op_kwargs())


class ConvTranspose2d(_TransposedConvolution):
    """A transposed 2-D convolution layer (as `torch.nn.ConvTranspose2d`) on NumPy arrays.

    Weight (in_channels, out_channels/groups, KH, KW) for layout "NCHW" (PyTorch), (KH, KW,
    out_channels/groups, in_channels) for "NHWC" (TensorFlow's conv2d_transpose). Each output value
    sums in_channels/groups · KH·KW / (sh·sw) products on average (a stride spreads the taps over
    that many outputs), so that is the fan_in of the He initialization N(0, 2/fan_in).
    output_padding: 0 <= output_padding < max(stride, dilation) per axis (0 with padding="same").
    Positional arguments in torch's order (in, out, kernel_size, stride, padding, output_padding,
    groups, bias, dilation, padding_mode: dilation comes after bias, as in torch); padding_mode
    "zeros" only, as torch. The keyword-only rest as `Conv2d`.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", *, dtype=np.float32, layout="NCHW", specialize=True,
                 algorithm="auto", rng=None):
        # Checked before the base class draws the weights, so a bad value costs nothing.
        self.output_padding = self._checked_output_padding(output_padding, stride, dilation, padding)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype, layout, specialize, algorithm, rng)


class Conv1d(_Convolution):
    """A 1-D convolution layer (as `torch.nn.Conv1d`): layout "NCL" (x (N, C, L), weight
    (out_channels, in_channels/groups, K)) or "NLC" (x (N, L, C), weight (K, in_channels/groups,
    out_channels)); x may be one unbatched (C, L) / (L, C) sequence. Arguments as `Conv2d`, one
    value per axis (an int or a 1-sequence; padding also ((before, after),)), run by `convgen.conv1d`.
    """

    _rank = 1
    _ops = (conv1d, conv1d_backward)

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", *, dtype=np.float32, layout="NCL", specialize=True,
                 algorithm="auto", rng=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype, layout, specialize, algorithm, rng)


class Conv3d(_Convolution):
    """A 3-D convolution layer (as `torch.nn.Conv3d`): layout "NCDHW" (x (N, C, D, H, W), weight
    (out_channels, in_channels/groups, KD, KH, KW)) or "NDHWC" (x (N, D, H, W, C), weight (KD, KH, KW,
    in_channels/groups, out_channels)); x may be one unbatched (C, D, H, W) / (D, H, W, C) volume.
    Arguments as `Conv2d`, an int or one value per axis (d, h, w), run by `convgen.conv3d`.
    """

    _rank = 3
    _ops = (conv3d, conv3d_backward)

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", *, dtype=np.float32, layout="NCDHW", specialize=True,
                 algorithm="auto", rng=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype, layout, specialize, algorithm, rng)


class ConvTranspose1d(_TransposedConvolution):
    """A transposed 1-D convolution layer (as `torch.nn.ConvTranspose1d`): weight (in_channels,
    out_channels/groups, K) for "NCL", (K, out_channels/groups, in_channels) for "NLC". Arguments as
    `ConvTranspose2d`, in torch's order, run by `convgen.conv_transpose1d`.
    """

    _rank = 1
    _ops = (conv_transpose1d, conv_transpose1d_backward)

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", *, dtype=np.float32, layout="NCL", specialize=True,
                 algorithm="auto", rng=None):
        self.output_padding = self._checked_output_padding(output_padding, stride, dilation, padding)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype, layout, specialize, algorithm, rng)


class ConvTranspose3d(_TransposedConvolution):
    """A transposed 3-D convolution layer (as `torch.nn.ConvTranspose3d`): weight (in_channels,
    out_channels/groups, KD, KH, KW) for "NCDHW", (KD, KH, KW, out_channels/groups, in_channels) for
    "NDHWC". Arguments as `ConvTranspose2d`, in torch's order, run by `convgen.conv_transpose3d`.
    """

    _rank = 3
    _ops = (conv_transpose3d, conv_transpose3d_backward)

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", *, dtype=np.float32, layout="NCDHW",
                 specialize=True, algorithm="auto", rng=None):
        self.output_padding = self._checked_output_padding(output_padding, stride, dilation, padding)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype, layout, specialize, algorithm, rng)


__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]
