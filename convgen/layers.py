"""Convolution layers for plain-NumPy training loops: parameters, gradients and the two passes.

A layer owns its weight and bias, calls the ops in `convgen.ops` for both passes and keeps what the
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

from .ops import conv2d, conv2d_backward, conv_transpose2d, conv_transpose2d_backward
from .problem import weight_shape
from .planner import as_algorithm
from .resolve import as_flag, as_float_dtype, as_layout, groups_dividing, as_output_padding
from .spec import as_int, as_pair, explicit_padding

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")  # torch's names


def _generator(rng) -> np.random.Generator:
    """None (fresh entropy), an int seed or a numpy Generator, as a Generator."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, numbers.Integral) and not isinstance(rng, (bool, np.bool_))):
        if rng is not None and rng < 0:
            raise ValueError(f"rng must be a non-negative seed, got {rng}")
        return np.random.default_rng(rng)
    raise TypeError(f"rng must be None, an int seed or a numpy.random.Generator, got {type(rng).__name__}")


def _pair_text(pair) -> str:
    return str(pair[0]) if pair[0] == pair[1] else str(tuple(pair))


def _padding_text(padding) -> str:
    if isinstance(padding, str):
        return repr(padding)
    (top, bottom), (left, right) = padding
    if top == bottom and left == right:
        return _pair_text((top, left))
    return str(padding)


class _ConvLayer:
    """What both layers share: checked hyperparameters, the parameters and their gradients.

    Subclasses say how the weight is shaped, how many products feed one output (for the He
    initialization) and which ops run the two passes.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                 padding_mode, dtype, layout, specialize, algorithm, rng):
        self.in_channels = as_int("in_channels", in_channels)
        self.out_channels = as_int("out_channels", out_channels)
        self.kernel_size = as_pair("kernel_size", kernel_size)
        self.stride = as_pair("stride", stride)
        self.padding = explicit_padding(padding)
        self.dilation = as_pair("dilation", dilation)
        self.groups = groups_dividing(groups, self.in_channels, self.out_channels, "in_channels", "out_channels")
        has_bias = as_flag("bias", bias)
        self.padding_mode = self._checked_padding_mode(padding_mode)
        self.dtype = as_float_dtype(dtype)
        self.layout = as_layout(layout)
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

    # -- what the subclasses define
    def _checked_padding_mode(self, padding_mode) -> str:
        if not isinstance(padding_mode, str) or padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {', '.join(map(repr, PADDING_MODES))}, got {padding_mode!r}")
        if padding_mode != "zeros":
            raise ValueError(f"padding_mode={padding_mode!r} is not available yet; convgen pads with zeros")
        return padding_mode

    def _weight_shape(self) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def _fan_in(self) -> float:
        raise NotImplementedError

    def _op_kwargs(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups,
                    layout=self.layout, specialize=self.specialize, algorithm=self.algorithm)

    # -- the two passes
    def _check_input(self, x):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x must be a NumPy array, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(f"x must have the layer's dtype {self.dtype}, got {x.dtype}")
        if x.ndim != 4:
            raise ValueError(f"x must be a 4-D {self.layout} batch, got shape {x.shape}")
        channels = x.shape[1] if self.layout == "NCHW" else x.shape[3]
        if channels != self.in_channels:
            raise ValueError(f"x has {channels} channels (shape {x.shape}, {self.layout}), "
                             f"the layer expects in_channels={self.in_channels}")

    def forward(self, x):
        """y for a batch x in the layer's layout and dtype; x is kept (not copied) for `backward`."""
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
        if self.stride != (1, 1):
            parts.append(f"stride={_pair_text(self.stride)}")
        if self.padding != ((0, 0), (0, 0)):
            parts.append(f"padding={_padding_text(self.padding)}")
        parts.append(self._repr_extra())
        if self.dilation != (1, 1):
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


class Conv2d(_ConvLayer):
    """A 2-D convolution layer (as `torch.nn.Conv2d`) on NumPy arrays, with its gradients.

    Weight (out_channels, in_channels/groups, KH, KW) for layout "NCHW", (KH, KW,
    in_channels/groups, out_channels) for "NHWC", drawn from N(0, 2/fan_in) with fan_in =
    in_channels/groups · KH · KW; bias zeros (None with bias=False). padding takes every form
    `convgen.conv2d` does (int, pair, ((top, bottom), (left, right)), "valid", "same").
    The positional arguments are torch's, in torch's order; the rest are keyword-only: `dtype`
    (float32 or float64), `layout` ("NCHW" or "NHWC"), `specialize` and `algorithm` ("auto",
    "direct", "winograd" or "depthwise") as for `convgen.conv2d`, and `rng` (None, an int seed or a numpy
    Generator) for the initial weights. `padding_mode` is torch's; convgen pads with zeros only.

    `forward(x)` (also `layer(x)`) returns y and keeps x; `backward(dy)` returns dx and stores
    `.dw` and `.db` (None without bias).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", *, dtype=np.float32, layout="NCHW", specialize=True,
                 algorithm="auto", rng=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype, layout, specialize, algorithm, rng)

    def _weight_shape(self):
        return weight_shape(self.out_channels, self.in_channels // self.groups, self.kernel_size, self.layout)

    def _fan_in(self):
        return self.in_channels // self.groups * self.kernel_size[0] * self.kernel_size[1]

    def _forward(self, x):
        return conv2d(x, self.weight, self.bias, **self._op_kwargs())

    def _backward(self, dy, x):
        return conv2d_backward(dy, x, self.weight, **self._op_kwargs())


class ConvTranspose2d(_ConvLayer):
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
        self.output_padding = as_output_padding(output_padding, stride, dilation, padding)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, dtype, layout, specialize, algorithm, rng)

    def _checked_padding_mode(self, padding_mode):
        if padding_mode != "zeros":  # torch refuses the other modes for transposed convolution too
            raise ValueError(f"padding_mode must be 'zeros' for {type(self).__name__}, got {padding_mode!r}")
        return padding_mode

    def _weight_shape(self):
        return weight_shape(self.in_channels, self.out_channels // self.groups, self.kernel_size, self.layout)

    def _fan_in(self):
        taps = self.kernel_size[0] * self.kernel_size[1] / (self.stride[0] * self.stride[1])
        return max(self.in_channels // self.groups * taps, 1.0)

    def _op_kwargs(self):
        return dict(super()._op_kwargs(), output_padding=self.output_padding)

    def _repr_extra(self):
        return f"output_padding={_pair_text(self.output_padding)}" if self.output_padding != (0, 0) else ""

    def _forward(self, x):
        return conv_transpose2d(x, self.weight, self.bias, **self._op_kwargs())

    def _backward(self, dy, x):
        return conv_transpose2d_backward(dy, x, self.weight, **self._op_kwargs())


__all__ = ["Conv2d", "ConvTranspose2d"]
