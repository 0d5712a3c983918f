"""convgen inside PyTorch: custom ops with autograd, `torch.nn` modules, and `convert(model)`.

    import convgen.torch as cgt
    y = cgt.conv2d(x, weight, bias, stride=1, padding=1)    # as torch.nn.functional.conv2d
    layer = cgt.Conv2d(16, 32, 3, padding=1)                # as torch.nn.Conv2d
    report = cgt.convert(model)                             # swap a model's convolutions in place
    fast = cgt.fuse(model.eval()).model                     # inference: conv+BN+activation+add fused

The ops are registered as ``torch.ops.convgen.conv2d`` and ``torch.ops.convgen.conv_transpose2d``
(with their gradients ``..._backward``): autograd, `torch.compile` and `torch.export` treat them as
PyTorch's own. float32 and float64 CPU tensors; contiguous tensors are computed in convgen's NCHW
layout, channels_last ones in NHWC, both without copying the input. A weight called twice with the same
values (inference) is laid out for the kernels once and kept until PyTorch's version counter says it
changed; after writes that counter cannot see (`.data`, NumPy views), call `forget_laid_out_weights()`.

Importable only where PyTorch (2.4 or newer: `torch.library.custom_op`) is installed; convgen itself
does not need it.
"""

try:
    import torch
except ImportError as exc:  # convgen's core does not depend on PyTorch; this module does
    raise ImportError("convgen.torch needs PyTorch, which is not installed: pip install torch "
                      "(convgen is tested with torch==2.13.0, the CPU build)") from exc

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"convgen.torch needs PyTorch 2.4 or newer (torch.library.custom_op); found {torch.__version__}")

from .convert import ConvertReport, convert  # noqa: E402
from .functional import conv2d, conv_transpose2d  # noqa: E402
from .fuse import FusedConv2d, FuseReport, fuse  # noqa: E402
from .library import forget_laid_out_weights  # noqa: E402
from .modules import Conv2d, ConvTranspose2d  # noqa: E402

__all__ = ["conv2d", "conv_transpose2d", "Conv2d", "ConvTranspose2d", "convert", "ConvertReport",
           "forget_laid_out_weights", "fuse", "FuseReport", "FusedConv2d"]
