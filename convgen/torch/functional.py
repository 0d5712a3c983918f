"""The public functions, as `torch.nn.functional`'s: same positional order, same defaults.

Both accept batched (N, C, H, W) and unbatched (C, H, W) input, contiguous or channels_last, float32
or float64 on the CPU, and run convgen's kernels through the custom ops of `convgen.torch.library`
(so they work under autograd, `torch.compile` and `torch.export`).
"""

from __future__ import annotations

from .library import apply


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, algorithm="auto",
           padding_mode="zeros"):
    """2-D convolution, as `torch.nn.functional.conv2d`, computed by convgen.

    input : (N, C, H, W) or (C, H, W); weight : (F, C/groups, KH, KW); bias : (F,) or None.
    stride, dilation : int or (h, w). padding : int, (h, w), ((top, bottom), (left, right)), "valid"
        or "same" (for stride 1 PyTorch's rule; for larger strides convgen's, TensorFlow's: output
        ceil(H / stride)).
    algorithm : "auto", "direct" or "winograd", as for `convgen.conv2d`. Where a gradient is wanted,
        "auto" runs as "auto-training" (Winograd only at its most accurate tile, F(2×2)).
    padding_mode : "zeros" (default), "reflect", "replicate" or "circular", as `torch.nn.Conv2d`'s
        (which `torch.nn.functional.conv2d` lacks): the kernels read the padding from the image, with
        no padded copy, and the backward pass adds its gradient back into the pixels it copied.

    A channels_last input is computed in NHWC without a copy and gives a channels_last output.
    """
    return apply("conv2d", input, weight, bias, stride, padding, 0, dilation, groups, algorithm, padding_mode)


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *,
                     algorithm="auto"):
    """Transposed 2-D convolution, as `torch.nn.functional.conv_transpose2d` (note its order: groups
    before dilation), computed by convgen.

    input : (N, C_in, H, W) or (C_in, H, W); weight : (C_in, C_out/groups, KH, KW); bias : (C_out,).
    output_padding : int or (h, w), smaller than max(stride, dilation). padding : as `conv2d`; "same"
        gives an output of exactly input·stride (TensorFlow's conv2d_transpose).
    """
    return apply("conv_transpose2d", input, weight, bias, stride, padding, output_padding, dilation, groups,
                 algorithm)


__all__ = ["conv2d", "conv_transpose2d"]
