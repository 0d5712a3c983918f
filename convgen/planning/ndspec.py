"""1-D and 3-D windows: their values, text form and shape arithmetic, and the 2-D kernels that run them.

convgen's kernels are 2-D. A 1-D convolution runs on them with a unit height axis; a 3-D one folds
its depth taps into the channels and runs its height × width window on them (`convgen.frontend.depthfold`).
So a 1-D or 3-D window is *specialized* through the 2-D window it lowers to: `NdWindow.lower()`
says which, and `lowered_spec` names the kernel module that computes a 1-D or 3-D spec.

The text form generalizes the 2-D one (`Window.parse`) to any rank: each part takes one value for
every axis or one per axis, joined by "x":

    k9s2p4          1-D (layout NCL or NLC): kernel 9, stride 2, padding 4; p3_4 pads 3 before, 4 after
    k3x3x3s1p1      3-D: 3×3×3, stride 1, padding 1 on every side; k3s1p1 with a 3-D layout is the same
    k3x5x5s1x2x2p1x2x2d2x1x1   depth, height, width values in that order
    k9s1p4reflect   a padding mode other than zeros at the end, as in 2-D (k3s1p1reflect)

The rank comes from the layout (NCL/NLC 1-D, NCHW/NHWC 2-D, NCDHW/NDHWC 3-D); a text with three
values is 3-D whatever the layout's default.
"""

from __future__ import annotations

import dataclasses
import re

from .spec import PADDING_MODES, ConvSpec, Window, same_pads, as_int, cached_hash, state_without_hash

# Layouts by spatial rank, channels-first then channels-last, and the 2-D layout each runs on.
LAYOUTS = {1: ("NCL", "NLC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}
PLANAR_LAYOUT = {"NCL": "NCHW", "NLC": "NHWC", "NCHW": "NCHW", "NHWC": "NHWC", "NCDHW": "NCHW", "NDHWC": "NHWC"}
RANK_OF_LAYOUT = {layout: rank for rank, layouts in LAYOUTS.items() for layout in layouts}
AXES = {1: ("l",), 2: ("h", "w"), 3: ("d", "h", "w")}  # axis names in messages


def as_rank_layout(value, rank: int) -> str:
    """The layout name for an op of spatial rank `rank` (any case), or a ValueError listing the choices."""
    choices = LAYOUTS[rank]
    if isinstance(value, str) and value.upper() in choices:
        return value.upper()
    raise ValueError(f"layout must be {' or '.join(repr(c) for c in choices)}, got {value!r}")


def as_values(name: str, value, rank: int, minimum: int = 1) -> tuple[int, ...]:
    """An int, or a sequence of one int (expanded, as PyTorch does) or of one per axis, as `rank` ints."""
    if isinstance(value, (tuple, list)):
        if len(value) == 1:
            return (as_int(f"{name}[0]", value[0], minimum),) * rank
        if len(value) != rank:
            raise ValueError(f"{name} must be an int or a sequence of {rank} ints (one per axis: "
                             f"{', '.join(AXES[rank])}), got {value!r}")
        return tuple(as_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value))
    return (as_int(name, value, minimum),) * rank


def _side_pair(name: str, item) -> tuple[int, int]:
    if isinstance(item, (tuple, list)):
        if len(item) != 2:
            raise ValueError(f"{name} must be an int or a (before, after) pair; got {item!r}")
        return (as_int(f"{name}[0]", item[0], 0), as_int(f"{name}[1]", item[1], 0))
    v = as_int(name, item, 0)
    return (v, v)


def explicit_padding(padding, rank: int):
    """Normalize the padding forms that do not depend on the input size, for `rank` axes.

    Returns one (before, after) pair per axis, or the string "same"/"valid" unchanged. Accepted: an
    int; a sequence of one item (expanded) or one per axis, each an int or a (before, after) pair;
    "same"; "valid".
    """
    if isinstance(padding, str):
        if padding.lower() in ("same", "valid"):
            return padding.lower()
        raise ValueError(f"padding must be an int, a sequence, 'same' or 'valid'; got {padding!r}")
    if isinstance(padding, (tuple, list)):
        if len(padding) == 1:
            return (_side_pair("padding[0]", padding[0]),) * rank
        if len(padding) != rank:
            hint = (" (per-side padding of a 1-D convolution is ((before, after),))"
                    if rank == 1 and len(padding) == 2 else "")
            raise ValueError(f"padding must be an int, a sequence of {rank} (one per axis: {', '.join(AXES[rank])}; "
                             f"each an int or a (before, after) pair), 'same' or 'valid'; got {padding!r}{hint}")
        return tuple(_side_pair(f"padding[{i}]", item) for i, item in enumerate(padding))
    v = as_int("padding", padding, 0)
    return ((v, v),) * rank


@dataclasses.dataclass(frozen=True)
class DepthWindow:
    """The depth axis of a 3-D window, which the 2-D kernels do not see: it is folded into the channels."""

    kernel: int
    stride: int
    padding: tuple[int, int]
    dilation: int
    padding_mode: str = "zeros"


@dataclasses.dataclass(frozen=True)
class NdWindow:
    """Geometry of a 1-D, 2-D or 3-D sliding window: one value per axis (depth, height, width order).

    kernel, stride and dilation are tuples of positive ints; padding one (before, after) pair of
    non-negative ints per axis; padding_mode what the padding holds on every axis (one of
    PADDING_MODES; "zeros" without padding, as `Window`).
    """

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    padding_mode: str = "zeros"

    __hash__ = cached_hash
    __getstate__ = state_without_hash

    def __post_init__(self):
        rank = len(self.kernel) if isinstance(self.kernel, (tuple, list)) else 0
        if rank not in AXES:
            raise ValueError(f"kernel_size must have 1, 2 or 3 values, got {self.kernel!r}")
        object.__setattr__(self, "kernel", as_values("kernel_size", self.kernel, rank))
        object.__setattr__(self, "stride", as_values("stride", self.stride, rank))
        object.__setattr__(self, "dilation", as_values("dilation", self.dilation, rank))
        padding = explicit_padding(self.padding, rank)
        if isinstance(padding, str):
            raise ValueError("an NdWindow needs explicit padding; resolve 'same'/'valid' with NdWindow.resolve")
        object.__setattr__(self, "padding", padding)
        if not isinstance(self.padding_mode, str) or self.padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {', '.join(map(repr, PADDING_MODES))}, "
                             f"got {self.padding_mode!r}")
        if padding == ((0, 0),) * rank:
            object.__setattr__(self, "padding_mode", "zeros")

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @classmethod
    def resolve(cls, kernel, stride, padding, dilation, sizes, transposed=False, padding_mode="zeros") -> "NdWindow":
        """Build a window, turning "same"/"valid" into explicit pads for an input of `sizes`.

        Transposed "same" means an output of exactly input·stride, as in 2-D (`Window.resolve`).
        """
        rank = len(kernel)
        stride, dilation = as_values("stride", stride, rank), as_values("dilation", dilation, rank)
        pads = explicit_padding(padding, rank)
        if pads == "valid":
            pads = ((0, 0),) * rank
        elif pads == "same":
            targets = [n * s for n, s in zip(sizes, stride)] if transposed else sizes
            pads = tuple(same_pads(n, k, s, d) for n, k, s, d in zip(targets, kernel, stride, dilation))
        return cls(tuple(kernel), stride, pads, dilation, padding_mode)

    @property
    def effective_kernel(self) -> tuple[int, ...]:
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation))

    def output_size(self, sizes) -> tuple[int, ...]:
        """Convolution output size per axis, (n + before + after − d·(k − 1) − 1) // s + 1, or a
        ValueError naming the axis whose dilated kernel is larger than its padded input."""
        out = []
        for axis, n, (before, after), ek, s in zip(AXES[self.rank], sizes, self.padding, self.effective_kernel,
                                                     self.stride):
            padded = n + before + after
            if padded < ek:
                raise ValueError(f"kernel extent {ek} along {axis} (kernel_size and dilation) is larger than the "
                                 f"padded input {padded} (input {n} + padding {before}+{after})")
            out.append((padded - ek) // s + 1)
        return tuple(out)

    def transposed_output_size(self, sizes, output_padding) -> tuple[int, ...]:
        """Transposed-convolution output size per axis: (n − 1)·s − before − after + d·(k − 1) + op + 1."""
        out = []
        for axis, n, (before, after), ek, s, op in zip(AXES[self.rank], sizes, self.padding, self.effective_kernel,
                                                         self.stride, output_padding):
            size = (n - 1) * s - before - after + ek + op
            if size < 1:
                raise ValueError(f"transposed convolution output along {axis} would be {size}: padding too large")
            out.append(size)
        return tuple(out)

    def implicit_output_padding(self, sizes) -> tuple[int, ...]:
        """For transposed "same": the extra positions that make the output exactly input·stride."""
        natural = self.transposed_output_size(sizes, (0,) * self.rank)
        return tuple(n * s - size for n, s, size in zip(sizes, self.stride, natural))

    # ---------------------------------------------------------------------------------- text form
    def short(self) -> str:
        """The compact text form that `NdWindow.parse` reads back, e.g. k9s2p4, k3x3x3s1p1, k3x3x3s1p0_1x1x1,
        k9s1p4reflect.

        A 3-D kernel is always written with its three sizes, so the text alone says it is 3-D.
        """
        def joined(values):
            return str(values[0]) if len(set(values)) == 1 else "x".join(str(v) for v in values)
        sides = [str(b) if b == a else f"{b}_{a}" for b, a in self.padding]
        kernel = "x".join(str(k) for k in self.kernel) if self.rank == 3 else joined(self.kernel)
        text = f"k{kernel}s{joined(self.stride)}p{joined(sides)}"
        text = text if set(self.dilation) == {1} else f"{text}d{joined(self.dilation)}"
        return text if self.padding_mode == "zeros" else f"{text}{self.padding_mode}"

    @classmethod
    def parse(cls, text: str, rank: int | None = None) -> "NdWindow":
        """Read the compact form for `rank` axes (None: 3 if any part has three values, else an error).

        Each part holds one value (for every axis) or one per axis joined by "x"; a padding value is
        n or before_after; a padding mode may end the text. Omitted parts are stride 1, padding 0,
        dilation 1, zero padding.
        """
        match = _TEXT.fullmatch(text.strip().lower()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"cannot read {text!r} as a window: expected e.g. k9s2p4 (1-D), k3x3x3s1p1 (3-D)")
        groups = match.groupdict()
        mode = groups.pop("mode") or "zeros"
        parts = {name: value.split("x") if value else None for name, value in groups.items()}
        counts = {len(v) for v in parts.values() if v is not None}
        if rank is None:
            if 3 not in counts:
                raise ValueError(f"{text!r} does not say its rank: give the layout (NCL/NLC for 1-D, NCDHW/NDHWC "
                                 f"for 3-D) or three values, e.g. k3x3x3s1p1")
            rank = 3
        if counts - {1, rank}:
            raise ValueError(f"{text!r} is not a {rank}-D window: each part needs "
                             f"{'one value' if rank == 1 else f'1 or {rank} values, separated by x'}")

        def values(name, default, parse=int):
            found = parts[name]
            if found is None:
                return (default,) * rank
            return tuple(parse(v) for v in found) * (rank if len(found) == 1 else 1)

        def sides(value):
            before, _, after = value.partition("_")
            return (int(before), int(after or before))

        return cls(values("k", 1), values("s", 1), values("p", (0, 0), sides), values("d", 1), mode)

    # ------------------------------------------------------------------------------------ lowering
    def lower(self) -> tuple[DepthWindow | None, Window]:
        """(the depth window or None, the 2-D window whose kernels compute this one).

        1-D: the 2-D window of one row (kernel 1 × k). 2-D: itself. 3-D: the height × width window,
        with the depth window the fold handles (`convgen.frontend.depthfold`). The padding mode goes to both
        (a window without padding drops it).
        """
        mode = self.padding_mode
        if self.rank == 1:
            return None, Window((1, self.kernel[0]), (1, self.stride[0]), ((0, 0), self.padding[0]),
                                (1, self.dilation[0]), mode)
        depth = None
        if self.rank == 3:
            depth = DepthWindow(self.kernel[0], self.stride[0], self.padding[0], self.dilation[0],
                                mode if self.padding[0] != (0, 0) else "zeros")
        return depth, Window(self.kernel[-2:], self.stride[-2:], self.padding[-2:], self.dilation[-2:], mode)


_VALUES = r"\d+(?:x\d+)*"
_TEXT = re.compile(rf"k(?P<k>{_VALUES})(?:s(?P<s>{_VALUES}))?(?:p(?P<p>\d+(?:_\d+)?(?:x\d+(?:_\d+)?)*))?"
                   rf"(?:d(?P<d>{_VALUES}))?(?P<mode>{'|'.join(PADDING_MODES)})?")


def window_rank(text: str) -> int | None:
    """3 when a window text has three values in a part (it can only be 3-D), else None (the layout says)."""
    match = _TEXT.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if match is None:
        return None
    return 3 if any(v and v.count("x") == 2 for name, v in match.groupdict().items() if name != "mode") else None


def lowered_spec(text: str, dtype: str = "float32", layout: str = "NCHW", family: str = "direct",
                 tile: int = 0) -> ConvSpec:
    """The 2-D kernel module that computes the window `text` ("generic" for the generic build) in `layout`.

    `layout` sets the rank: NCL/NLC 1-D, NCHW/NHWC 2-D, NCDHW/NDHWC 3-D.
    """
    if not isinstance(layout, str) or layout.upper() not in RANK_OF_LAYOUT:
        raise ValueError(f"layout must be one of {', '.join(RANK_OF_LAYOUT)}, got {layout!r}")
    layout = layout.upper()
    rank, planar = RANK_OF_LAYOUT[layout], PLANAR_LAYOUT[layout]
    if isinstance(text, str) and text.strip().lower() == "generic":
        return ConvSpec(None, dtype, planar, family, tile)
    if rank == 2:
        if window_rank(text) == 3:
            raise ValueError(f"{text!r} is a 3-D window; layout {layout} is 2-D (give NCDHW or NDHWC)")
        return ConvSpec.parse(text, dtype, planar, family, tile)
    return ConvSpec(NdWindow.parse(text, rank).lower()[1], dtype, planar, family, tile)


__all__ = ["LAYOUTS", "PLANAR_LAYOUT", "RANK_OF_LAYOUT", "AXES", "DepthWindow", "NdWindow", "as_rank_layout",
           "as_values", "explicit_padding", "window_rank", "lowered_spec"]
