"""3-D convolution on the 2-D kernels: the depth taps folded into the channels.

A 3-D convolution y[n, f, od] = Σ_kd conv2d(x[n, :, od·sd − pf + kd·dd], w[:, :, kd]) is one 2-D
convolution of a batch of N·Do images, image (n, od) holding as its channels the KD input depth
slices that output depth od reads (`DepthFold.gather`), with the weights (F, C/g, KD, KH, KW) read
as (F, C/g·KD, KH, KW). The depth taps so become part of the GEMM's depth (C/g·KD·KH·KW, as in a
3-D im2col), and the height × width window runs on the specialized 2-D kernels, Winograd
F(m×m, 3×3) included for 3×3 windows at stride 1. The adjoint, `DepthFold.scatter`, adds the
gradient of each gathered slice back into its source depth: dx of conv3d, and the output of
conv_transpose3d, whose kernels are conv_transpose2d's on the folded channels (zero padding only, as
torch's).

Why a fold rather than a depth-tap loop in C: it needs no kernel of its own (every 2-D kernel,
algorithm and ISA computes 3-D convolutions unchanged), and the GEMM gets KD times the depth, which
is what keeps the micro-kernel busy. What it costs is copies made in NumPy, one pass each:

* the gathered input, KD/sd times the input (three times for 3×3×3 at stride 1);
* for the gradients, the gathered gradient of that size, scatter-added back into dx (KD passes);
* in NCDHW only, the batch of N·Do images is (N, Do, C, H, W) where the array is (N, C, Do, H, W):
  the output (forward), dy (backward) or x (transposed) is transposed once more. NDHWC needs no
  such copy: (N, Do, H, W, C) already is a batch of N·Do images.

Channels are ordered group by group, so the groups of the 2-D call are those of the 3-D one:
(c, kd) with kd fastest in NCDHW, where the weights reshape as a view, and (kd, c) per group in
NDHWC, where each gathered slice is a run of whole pixels (those weights are reordered: small).
Depth padding modes other than zeros read the reflected, replicated or wrapped-around slice, and
its gradient is added back into that slice.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..planning.ndspec import DepthWindow


def source_index(s: int, size: int, mode: str) -> int | None:
    """The input position that padded position s (s < 0 or s >= size) reads, or None for a zero."""
    if mode == "zeros":
        return None
    if mode == "replicate":
        return min(max(s, 0), size - 1)
    if mode == "circular":
        return s % size
    return -s if s < 0 else 2 * (size - 1) - s  # reflect (without repeating the edge)


@dataclasses.dataclass(frozen=True)
class DepthFold:
    """The depth taps of a 3-D convolution from depth `size_in` to depth `size_out`, as channels."""

    window: DepthWindow
    size_in: int
    size_out: int

    @property
    def mode(self) -> str:
        return self.window.padding_mode

    def runs(self):
        """(tap, output slice, input slice or None) covering every (output depth, tap) pair once.

        Each tap's outputs whose source lies in the input come as one strided run; the others
        (in the padding) one by one, with the slice they read, or None where they read zeros.
        """
        k, s, (before, _), d = self.window.kernel, self.window.stride, self.window.padding, self.window.dilation
        for tap in range(k):
            offset = tap * d - before  # source of output depth o: o·s + offset
            lo = min(self.size_out, max(0, -(-(-offset) // s)))
            last = self.size_in - 1 - offset
            hi = lo if last < 0 else max(lo, min(self.size_out, last // s + 1))
            if hi > lo:
                first = lo * s + offset
                yield tap, slice(lo, hi), slice(first, first + (hi - lo - 1) * s + 1, s)
            for o in (*range(lo), *range(hi, self.size_out)):
                src = source_index(o * s + offset, self.size_in, self.mode) if self.size_in else None
                yield tap, slice(o, o + 1), None if src is None else slice(src, src + 1)

    # The two layouts' views: source (N, C, D, H·W) / (N, D, H·W, G, C/g) and folded
    # (N, Do, C, KD, H·W) / (N, Do, H·W, G, KD, C/g); folded[tap] and source[slice] then match.
    def _views(self, source, folded, layout, groups):
        k = self.window.kernel
        if layout == "NCDHW":
            n, c, depth, h, w = source.shape
            src = source.reshape(n, c, depth, h * w)
            dst = folded.reshape(n, self.size_out, c, k, h * w)
            return (lambda o, tap: dst[:, o, :, tap]), (lambda s: src[:, :, s].transpose(0, 2, 1, 3))
        n, depth, h, w, c = source.shape
        src = source.reshape(n, depth, h * w, groups, c // groups)
        dst = folded.reshape(n, self.size_out, h * w, groups, k, c // groups)
        return (lambda o, tap: dst[:, o, :, :, tap]), (lambda s: src[:, s])

    def folded_shape(self, shape, layout) -> tuple[int, int, int, int]:
        """The 2-D batch that an array of `shape` (N, C, D, H, W) / (N, D, H, W, C) folds into."""
        k = self.window.kernel
        if layout == "NCDHW":
            n, c, _, h, w = shape
            return (n * self.size_out, c * k, h, w)
        n, _, h, w, c = shape
        return (n * self.size_out, h, w, c * k)

    def gather(self, x: np.ndarray, layout: str, groups: int) -> np.ndarray:
        """x (N, C, size_in, H, W) or (N, size_in, H, W, C) folded into its 2-D batch: a new array."""
        folded = np.empty(self.folded_shape(x.shape, layout), x.dtype)
        dst, src = self._views(x, folded, layout, groups)
        for tap, outputs, inputs in self.runs():
            if inputs is None:
                dst(outputs, tap)[...] = 0
            else:
                dst(outputs, tap)[...] = src(inputs)
        return folded

    def scatter(self, folded: np.ndarray, layout: str, groups: int, out: np.ndarray) -> np.ndarray:
        """The adjoint of `gather`: out (shaped as x) = the sum of each folded slice into its source.

        A source slice's first contribution is copied, later ones added, and slices no output read
        are zeroed: one pass over out per contribution, none to clear it first.
        """
        dst, src = self._views(out, folded, layout, groups)
        written = np.zeros(self.size_in, dtype=bool)
        for tap, outputs, inputs in self.runs():
            if inputs is None:
                continue
            sources = np.arange(self.size_in)[inputs]
            fresh = ~written[sources]
            if fresh.all():
                src(inputs)[...] = dst(outputs, tap)
            elif not fresh.any():
                src(inputs)[...] += dst(outputs, tap)
            else:  # part seen before: slice by slice
                for i, s in enumerate(sources):
                    one = slice(outputs.start + i, outputs.start + i + 1)
                    if fresh[i]:
                        src(slice(s, s + 1))[...] = dst(one, tap)
                    else:
                        src(slice(s, s + 1))[...] += dst(one, tap)
            written[sources] = True
        for s in np.flatnonzero(~written):
            src(slice(s, s + 1))[...] = 0
        return out


def slices_as_batch(a: np.ndarray, layout: str) -> np.ndarray:
    """A 3-D batch (N, C, D, H, W) / (N, D, H, W, C) as the 2-D batch of its N·D depth slices
    (N·D, C, H, W) / (N·D, H, W, C): a transposed copy in NCDHW, a view in NDHWC."""
    if layout == "NCDHW":
        n, c, d, h, w = a.shape
        return np.ascontiguousarray(a.transpose(0, 2, 1, 3, 4)).reshape(n * d, c, h, w)
    n, d, h, w, c = a.shape
    return a.reshape(n * d, h, w, c)


def batch_into_slices(planar: np.ndarray, layout: str, out: np.ndarray) -> np.ndarray:
    """The inverse of `slices_as_batch`, written into `out` (nothing to do when `planar` is out's view)."""
    if layout == "NCDHW":
        n, c, d, h, w = out.shape
        np.copyto(out.reshape(n, c, d, h * w), planar.reshape(n, d, c, h * w).transpose(0, 2, 1, 3))
    elif not np.may_share_memory(planar, out):
        np.copyto(out, planar.reshape(out.shape))
    return out


__all__ = ["DepthFold", "source_index", "slices_as_batch", "batch_into_slices"]
