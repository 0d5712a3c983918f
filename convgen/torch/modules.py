"""`torch.nn` convolution modules computed by convgen.

`Conv2d` and `ConvTranspose2d` subclass PyTorch's own modules: the constructor, the parameters, their
initialization, `state_dict` keys and `repr` are PyTorch's; only the forward pass runs convgen's
kernels, through the path `convgen.torch.functional` takes (`convgen.torch.library.apply`). Each also
takes a keyword-only `algorithm` ("auto", "direct", "winograd"), as convgen's own ops and layers do.
`Conv2d` computes every padding_mode PyTorch's does, without padding a copy of the input.

Weights prepared once: the kernels read a channels_last input's weights in convgen's (kh, kw, in, out)
memory order. `convert` lays a channels_last model's weights out so; an eager call that finds its
module's weight Parameter in another order than its input's layout reads re-lays the Parameter's
memory in place, once (its shape, values and identity stay, as after `Module.to(memory_format=...)`),
instead of reordering a copy on every call. Not in a process of torch.distributed, whose
DistributedDataParallel keeps the strides the weights had when it was built.
"""

from __future__ import annotations

import torch

from ..planning.planner import as_algorithm
from .library import apply


class Conv2d(torch.nn.Conv2d):
    """`torch.nn.Conv2d` whose forward pass runs convgen's kernels.

    Same constructor (and positional order) as `torch.nn.Conv2d`, plus the keyword-only `algorithm`;
    every padding_mode ("zeros", "reflect", "replicate", "circular"). Inputs: float32 or float64 CPU
    tensors, contiguous or channels_last.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 padding_mode="zeros", device=None, dtype=None, *, algorithm="auto"):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                         device, dtype)
        self.algorithm = as_algorithm(algorithm)

    kind_name = "conv2d"  # (convgen.torch.library.KINDS)

    def _conv_forward(self, input, weight, bias):
        return apply(self.kind_name, input, weight, bias, self.stride, self.padding, 0, self.dilation, self.groups,
                     self.algorithm, self.padding_mode, module_weight=weight is self.weight)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text if self.algorithm == "auto" else f"{text}, algorithm={self.algorithm!r}"


class ConvTranspose2d(torch.nn.ConvTranspose2d):
    """`torch.nn.ConvTranspose2d` whose forward pass runs convgen's kernels.

    Same constructor (and positional order) as `torch.nn.ConvTranspose2d`, plus the keyword-only
    `algorithm`; `forward(input, output_size=None)` as PyTorch's.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0, groups=1,
                 bias=True, dilation=1, padding_mode="zeros", device=None, dtype=None, *, algorithm="auto"):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias,
                         dilation, padding_mode, device, dtype)
        self.algorithm = as_algorithm(algorithm)

    kind_name = "conv_transpose2d"

    def forward(self, input, output_size=None):
        if self.padding_mode != "zeros":  # PyTorch's own check, which its constructor also makes
            raise ValueError(f"Only 'zeros' padding mode is supported for ConvTranspose2d, got {self.padding_mode!r}")
        output_padding = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size,
                                              len(self.kernel_size), self.dilation)
        return apply(self.kind_name, input, self.weight, self.bias, self.stride, self.padding, output_padding,
                     self.dilation, self.groups, self.algorithm, module_weight=True)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text if self.algorithm == "auto" else f"{text}, algorithm={self.algorithm!r}"


# PyTorch's module -> its convgen twin; `convert` swaps exactly these types.
TWINS = {torch.nn.Conv2d: Conv2d, torch.nn.ConvTranspose2d: ConvTranspose2d}

__all__ = ["Conv2d", "ConvTranspose2d", "TWINS"]
