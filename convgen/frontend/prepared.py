"""Convolutions whose weights are laid out once: the NumPy API's prepared form.

`conv2d` lays its weights out for the kernels on every call: packed into the micro-kernel's panels,
or, for Winograd, transformed. For a deep layer of a small image that costs as much as the
multiplies (512 × 512 × 3 × 3 weights are 9 MB, read and written again per call). FFTW's plans and
oneDNN's primitives with reordered weights settle it the same way: the caller holds an object made
once for one problem, which keeps the weights in the kernels' own layout.

    conv = convgen.prepare_conv2d(w, bias, input_shape=x.shape, padding=1)
    y = conv(x)              # as convgen.conv2d(x, w, bias, padding=1), without re-laying w
    conv.update(w2)          # the weights changed: lay them out again

A prepared conv2d takes conv2d's fused epilogue too, fixed when it is made (a frozen BatchNorm's
`scale` folded into the laid-out weights once); with `residual=True` every call passes the array:

    block = convgen.prepare_conv2d(w, shift, input_shape=x.shape, padding=1, scale=gamma_over_sigma,
                                   activation="relu", residual=True)
    y = block(x, residual=skip)   # relu(conv(x, w) * scale + shift + skip), one pass

The object keeps the weights' values as they were when laid out (a later change to `w` does not reach
it until `update`), and it runs the kernels it was prepared with, whatever `configure` block a later
call sits in: its layout is theirs.
"""

from __future__ import annotations

import numpy as np

from ..planning.epilogue import NO_EPILOGUE
from .ops import (_BIAS_SHAPE, _epilogue_arguments, _numpy_epilogue, _prepare, adjoint_weights, check_residual,
                  scaled_weights)
from .resolve import result_array


class PreparedConv:
    """A conv2d or conv_transpose2d of one input shape, its weights laid out once for its kernels.

    Made by `prepare_conv2d` or `prepare_conv_transpose2d`; call it on x of `input_shape`. Its
    results are those of the op with the same arguments (the same kernels, the same rounding).
    """

    __slots__ = ("op", "input_shape", "output_shape", "dtype", "problem", "_kernels", "_entry", "_empty",
                 "_weight_shape", "_prepared", "_weight", "_bias", "_kwargs", "_call", "_run", "_scale")

    def __init__(self, op: str, w, bias, input_shape, kwargs: dict, epilogue_kwargs=None):
        if not isinstance(input_shape, (tuple, list)) or len(input_shape) != 4 or not all(
                isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in input_shape):
            raise ValueError(f"input_shape must be the 4-D shape of the batched input (ints), got {input_shape!r}")
        if not isinstance(w, np.ndarray):
            raise TypeError(f"w must be a NumPy array, got {type(w).__name__}")
        self.op, self.input_shape, self._kwargs = op, tuple(int(n) for n in input_shape), kwargs
        # The op's own checks, on a stand-in x of the input shape (never touched: no pages are written).
        placeholder = np.empty(self.input_shape, w.dtype)
        fused = epilogue_kwargs or {}
        epilogue = (NO_EPILOGUE if not fused else
                    _epilogue_arguments(fused["activation"], placeholder if fused["residual"] else None,
                                        fused["residual_position"]))
        (_, w_checked, bias_checked), call = _prepare(op, (placeholder, w, bias), epilogue=epilogue, **kwargs)
        self._call, self._scale = call, fused.get("scale")
        self.problem, self.dtype = call.problem, call.resolved.dtype
        self.output_shape = tuple(call.resolved.result_shapes[0])
        # a transposed call whose output the adjoint forward convolution computes runs its kernels
        self._run = call.adjoint or call
        self._kernels = self._run.kernels()
        self._entry = "bwd_data" if self._run.problem.transpose else "fwd"
        self._empty = call.empty
        self._weight_shape = w_checked.shape
        self._prepared = self._weight = None
        self._lay_out(w_checked)
        self._bias = None if bias_checked is None else bias_checked.copy()

    def _lay_out(self, w) -> None:
        w = scaled_weights(w, self._scale, self._call)  # (a frozen BatchNorm's scale, folded into the weights)
        if self._run is not self._call:
            w = adjoint_weights(w, self.problem.groups, self.problem.layout)
        prepared = None if self._empty else self._kernels.prepare_weights(self._entry, self._run.problem, w)
        # Kernels with nothing to lay out (depthwise) read the weights as they are: keep a copy, so
        # that the values are the ones given, as for the laid-out form.
        self._prepared, self._weight = prepared, (w.copy() if prepared is None else None)

    def update(self, w, bias=False) -> None:
        """Lay out new weights (w of the shape and dtype prepared for); `bias`: a new bias (None: none),
        or False (default) to keep the one given before."""
        if not isinstance(w, np.ndarray):
            raise TypeError(f"w must be a NumPy array, got {type(w).__name__}")
        if w.shape != self._weight_shape or w.dtype != self.dtype:
            raise ValueError(f"w must have shape {self._weight_shape} and dtype {self.dtype} (what this was "
                             f"prepared for), got {w.shape} {w.dtype}")
        if bias is not False:
            channels = self.output_shape[1 if self.problem.layout == "NCHW" else 3]
            if bias is not None and (not isinstance(bias, np.ndarray) or bias.shape != (channels,)
                                     or bias.dtype != self.dtype):
                raise ValueError(f"bias must be None, False or a ({channels},) array of dtype {self.dtype}, "
                                 f"got {bias!r:.80}")
            self._bias = None if bias is None else bias.copy()
        self._lay_out(np.ascontiguousarray(w))

    def __call__(self, x, out=None, residual=None):
        """y for x of `input_shape` (the prepared dtype; copied first if not C-contiguous); `out`: an
        optional preallocated C-contiguous result of `output_shape`; `residual`: the array the
        epilogue adds, shaped as y, when prepared with residual=True (and only then)."""
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x must be a NumPy array, got {type(x).__name__}")
        if x.shape != self.input_shape or x.dtype != self.dtype:
            raise ValueError(f"x must have shape {self.input_shape} and dtype {self.dtype} (what this was "
                             f"prepared for), got {x.shape} {x.dtype}")
        adds = self.problem.epilogue.residual != "none"
        if (residual is not None) != adds:
            raise ValueError("residual must be given: this conv was prepared with residual=True" if adds else
                             "residual must be None: this conv was prepared without one (residual=True adds it)")
        x = np.ascontiguousarray(x)
        y = result_array("out", out, self.output_shape, self.dtype, (x,))
        if residual is not None:
            residual = check_residual(residual, self.dtype, self.output_shape)
            residual = residual.copy() if np.may_share_memory(residual, y) else residual
        bias = self._bias
        if self._empty:
            y[...] = 0 if bias is None else bias.reshape(_BIAS_SHAPE[self.problem.layout])
            _numpy_epilogue(y, self.problem.epilogue, residual)
        elif self._entry == "fwd":
            self._kernels.call("fwd", self._run.problem, (x, self._weight, self._prepared, bias, residual, y))
        else:
            self._kernels.call("bwd_data", self.problem, (x, self._weight, self._prepared, y))
            if bias is not None:
                y += bias.reshape(_BIAS_SHAPE[self.problem.layout])
        return y

    def __repr__(self) -> str:
        laid_out = "weights laid out" if self._prepared is not None else "weights as given"
        # output_padding is conv_transpose2d's alone: conv2d's repr does not show it
        arguments = ", ".join(f"{key}={value!r}" for key, value in self._kwargs.items()
                              if key != "output_padding" or self.op == "conv_transpose2d")
        return f"PreparedConv({self.op}, input_shape={self.input_shape}, {arguments}; {laid_out})"


def _options(stride, padding, dilation, groups, layout, specialize, algorithm, padding_mode, output_padding=0):
    return dict(specialize=specialize, algorithm=algorithm, stride=stride, padding=padding, dilation=dilation,
                groups=groups, layout=layout, output_padding=output_padding, padding_mode=padding_mode)


def prepare_conv2d(w, bias=None, *, input_shape, stride=1, padding=0, dilation=1, groups=1, layout="NCHW",
                   specialize=True, algorithm="auto", padding_mode="zeros", scale=None, activation=None,
                   residual=False, residual_position="before") -> PreparedConv:
    """`conv2d` with weights `w` (and `bias`) laid out once for inputs of `input_shape` (the batched
    4-D shape of x): returns a callable `PreparedConv`, conv(x) giving conv2d(x, w, bias, ...).
    The keyword arguments are conv2d's, and so are the errors; its epilogue is fixed here: `scale`
    is folded into the laid-out weights, and with `residual=True` every call passes the array added
    (conv(x, residual=r)) before or after the activation, as `residual_position` says."""
    epilogue = None
    if scale is not None or activation is not None or residual is not False:
        if not isinstance(residual, bool):
            raise TypeError(f"residual must be True or False (whether calls pass one), got {residual!r}")
        epilogue = dict(scale=scale, activation=activation, residual=residual, residual_position=residual_position)
    return PreparedConv("conv2d", w, bias, input_shape,
                        _options(stride, padding, dilation, groups, layout, specialize, algorithm, padding_mode),
                        epilogue)


def prepare_conv_transpose2d(w, bias=None, *, input_shape, stride=1, padding=0, output_padding=0, dilation=1,
                             groups=1, layout="NCHW", specialize=True, algorithm="auto",
                             padding_mode="zeros") -> PreparedConv:
    """`conv_transpose2d` with weights `w` (and `bias`) laid out once for inputs of `input_shape`: as
    `prepare_conv2d`."""
    return PreparedConv("conv_transpose2d", w, bias, input_shape,
                        _options(stride, padding, dilation, groups, layout, specialize, algorithm, padding_mode,
                                 output_padding))


__all__ = ["PreparedConv", "prepare_conv2d", "prepare_conv_transpose2d"]
