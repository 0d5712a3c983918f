"""`Problem`: the resolved geometry of one convolution call, as a named, frozen record.

A problem is what the parameter resolver (`convgen.frontend.resolve`) makes of a call's arrays and
arguments, and what the planner and the kernels read: sizes, window, groups, layout and dtype.
A transposed convolution is the input gradient of the convolution with its input and output
exchanged; `Problem.transposed()` is that exchange, and `Problem.conv()` is the convolution the
kernels run for either direction.
"""

from __future__ import annotations

import dataclasses

from .epilogue import NO_EPILOGUE, Epilogue
from .spec import Window, cached_hash, state_without_hash


def image_shape(n: int, c: int, h: int, w: int, layout: str) -> tuple[int, int, int, int]:
    """The shape of an image batch in `layout`: (N, C, H, W) or (N, H, W, C)."""
    return (n, c, h, w) if layout == "NCHW" else (n, h, w, c)


def weight_shape(outer: int, inner: int, kernel: tuple[int, int], layout: str) -> tuple[int, int, int, int]:
    """The shape of a weight tensor in `layout`: (outer, inner, KH, KW) or (KH, KW, inner, outer).

    conv2d's weights have outer = F and inner = C/groups; a transposed convolution's C_in and C_out/groups.
    """
    kh, kw = kernel
    return (outer, inner, kh, kw) if layout == "NCHW" else (kh, kw, inner, outer)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One convolution call: input (n, c, h, w) to output (n, f, ho, wo) through `window`.

    For a transposed convolution (`transpose` True) the sizes are those of the call too: its input
    has c channels of h × w and its output f channels of ho × wo; the kernels run `conv()`, the
    convolution from that output back to that input.
    """

    n: int
    c: int
    h: int
    w: int
    f: int
    ho: int
    wo: int
    groups: int
    window: Window
    dtype: str = "float32"
    layout: str = "NCHW"
    transpose: bool = False
    epilogue: Epilogue = NO_EPILOGUE  # what the forward pass does to each output value after the bias

    __hash__ = cached_hash  # problems key the kernels' argument cache on every call
    __getstate__ = state_without_hash

    def transposed(self) -> "Problem":
        """The same window and weights with input and output exchanged (and the direction flipped)."""
        return dataclasses.replace(self, c=self.f, h=self.ho, w=self.wo, f=self.c, ho=self.h, wo=self.w,
                                   transpose=not self.transpose, epilogue=NO_EPILOGUE)

    def conv(self) -> "Problem":
        """The forward convolution whose kernels compute this call (itself unless transposed)."""
        return self.transposed() if self.transpose else self

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return image_shape(self.n, self.c, self.h, self.w, self.layout)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return image_shape(self.n, self.f, self.ho, self.wo, self.layout)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """(F, C/groups, KH, KW) in NCHW, (KH, KW, C/groups, F) in NHWC, of the convolution `conv()`.

        For a transposed call that is (C_in, C_out/groups, KH, KW) and (KH, KW, C_out/groups, C_in).
        """
        conv = self.conv()
        return weight_shape(conv.f, conv.c // conv.groups, self.window.kernel, self.layout)

    @property
    def flops(self) -> int:
        """Multiply-adds × 2 of the convolution (also of each of its two gradients)."""
        conv = self.conv()
        kh, kw = self.window.kernel
        return 2 * conv.n * conv.f * (conv.c // conv.groups) * kh * kw * conv.ho * conv.wo

    @property
    def empty(self) -> bool:
        """Whether the kernels have nothing to multiply (no input values or no output values)."""
        return 0 in (self.n, self.c, self.h, self.w, self.f, self.ho, self.wo)


__all__ = ["Problem", "image_shape", "weight_shape"]
