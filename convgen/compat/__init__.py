"""Drop-in replacements for other projects' convolution APIs, computed by convgen's kernels.

- `convgen.compat.cs231n`: CS231n's fast convolution layers, `conv_forward_fast` and
  `conv_backward_fast`.
"""
