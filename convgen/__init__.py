"""convgen: a compiler for convolution kernels (1-D, 2-D and 3-D, on generated 2-D kernels).

A convolution's fixed parameters (kernel size, stride, padding, dilation, dtype, layout) are rendered
into C from Jinja templates, built with cffi, cached on disk and exposed as functions on NumPy arrays.
Every kernel exists specialized (parameters are compile-time constants) and generic (the same template
with the parameters as run-time arguments).
"""

from ._version import __version__

from .runtime.cache import CacheError, cache_clear, cache_info
from .runtime.build import BuildError
from .runtime.kernels import configure, get_kernels, build_all, num_threads, set_num_threads
from .frontend.ops import conv2d, conv2d_backward, conv_transpose2d, conv_transpose2d_backward
from .frontend.prepared import PreparedConv, prepare_conv2d, prepare_conv_transpose2d
from .frontend.ndops import (conv1d, conv1d_backward, conv_transpose1d, conv_transpose1d_backward, conv3d,
                             conv3d_backward, conv_transpose3d, conv_transpose3d_backward)
from .frontend.layers import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .planning.spec import ConvSpec, Window
from . import reference

__all__ = [
    "conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward", "Conv2d", "ConvTranspose2d",
    "prepare_conv2d", "prepare_conv_transpose2d", "PreparedConv",
    "conv1d", "conv1d_backward", "conv_transpose1d", "conv_transpose1d_backward",
    "conv3d", "conv3d_backward", "conv_transpose3d", "conv_transpose3d_backward",
    "Conv1d", "Conv3d", "ConvTranspose1d", "ConvTranspose3d",
    "ConvSpec", "Window", "get_kernels", "build_all", "configure", "num_threads", "set_num_threads",
    "cache_info", "cache_clear", "CacheError", "BuildError", "reference",
]
