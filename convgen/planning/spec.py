"""What a kernel is specialized for: the convolution's fixed parameters, checked once.

A `Window` holds the geometry of the sliding window (kernel size, stride, padding, dilation). A
`ConvSpec` pairs a window with a dtype and a layout; its window is None for the *generic* build,
whose single module serves every window at run time. Everything here is frozen and hashable, so a
spec can key caches, and every value that reaches the C source passes through `as_int` or one of the
fixed name tables below.

This module also owns the shape arithmetic of the fast path (`Window.output_size`,
`Window.transposed_output_size`) and the resolution of the padding forms ("same", "valid",
symmetric and per-side pairs) into explicit per-side pads.
"""

from __future__ import annotations

import dataclasses
import numbers
import re

import numpy as np

from .epilogue import NO_EPILOGUE, TEXT_PATTERN, Epilogue

DTYPES = {"float32": "float", "float64": "double"}
DTYPE_SUFFIX = {"float32": "f32", "float64": "f64"}
LAYOUTS = ("NCHW", "NHWC")
# What the padding holds (PyTorch's padding_mode): zeros; the image mirrored at its edge, the edge not
# repeated (numpy's "reflect"); the edge repeated ("edge"); the image wrapped around ("wrap").
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
# Algorithm families: each has its templates in templates/<family>/ and an entry in the planner.
FAMILIES = ("direct", "winograd", "depthwise")
# Winograd output tiles m of F(m×m, r×r) that can be built, and the windows r × r they take.
WINOGRAD_TILES = (2, 4, 6)
WINOGRAD_WINDOWS = (3,)
# Window values become C literals and int64 factors of sizes: bounded, they cannot overflow.
MAX_WINDOW_VALUE = 2 ** 31 - 1


def as_int(name: str, value, minimum: int = 1) -> int:
    """`value` as a Python int in [minimum, MAX_WINDOW_VALUE], or a ValueError/TypeError naming `name`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > MAX_WINDOW_VALUE:
        raise ValueError(f"{name} must be at most {MAX_WINDOW_VALUE}, got {value}")
    return value


# Arguments whose 1-sequence stands for both axes, as in torch (stride=(2,) is stride 2); a kernel_size is not.
_ONE_FOR_BOTH = ("stride", "dilation", "output_padding")


def as_pair(name: str, value, minimum: int = 1) -> tuple[int, int]:
    """An int or an (h, w) pair (for a stride, dilation or output_padding also a 1-sequence, as torch
    takes it), as a pair of ints >= minimum."""
    if isinstance(value, (tuple, list)):
        if len(value) == 1 and name in _ONE_FOR_BOTH:
            value = (value[0], value[0])
        if len(value) != 2:
            raise ValueError(f"{name} must be an int or an (h, w) pair, got {value!r}")
        return (as_int(f"{name}[0]", value[0], minimum), as_int(f"{name}[1]", value[1], minimum))
    v = as_int(name, value, minimum)
    return (v, v)


def explicit_padding(padding) -> tuple[tuple[int, int], tuple[int, int]] | str:
    """Normalize the padding forms that do not depend on the input size.

    Returns ((top, bottom), (left, right)), or the string "same"/"valid" unchanged.
    Accepted: an int, an (h, w) pair, a ((top, bottom), (left, right)) pair of pairs, "same", "valid",
    and (as torch) a 1-sequence (p,) for p on every side.
    """
    if isinstance(padding, str):
        if padding.lower() in ("same", "valid"):
            return padding.lower()
        raise ValueError(f"padding must be an int, a pair, a pair of pairs, 'same' or 'valid'; got {padding!r}")
    if isinstance(padding, (tuple, list)):
        if len(padding) == 1 and not isinstance(padding[0], (tuple, list)):
            padding = (padding[0], padding[0])
        if len(padding) != 2:
            raise ValueError(f"padding must be an int, (h, w) or ((top, bottom), (left, right)); got {padding!r}")
        sides = []
        for axis, item in zip(("h", "w"), padding):
            if isinstance(item, (tuple, list)):
                if len(item) != 2:
                    raise ValueError(f"padding for {axis} must be an int or a (before, after) pair; got {item!r}")
                sides.append((as_int(f"padding[{axis}][0]", item[0], 0),
                              as_int(f"padding[{axis}][1]", item[1], 0)))
            else:
                v = as_int(f"padding[{axis}]", item, 0)
                sides.append((v, v))
        return (sides[0], sides[1])
    v = as_int("padding", padding, 0)
    return ((v, v), (v, v))


def same_pads(size: int, k: int, s: int, d: int) -> tuple[int, int]:
    """TensorFlow's "same": output ceil(size / s); the odd extra pad goes after (bottom/right)."""
    out = -(-size // s)
    total = max((out - 1) * s + d * (k - 1) + 1 - size, 0)
    return (total // 2, total - total // 2)


def cached_hash(self) -> int:
    """`__hash__` of a frozen dataclass that keys hot dictionaries: the fields' hash, computed once.

    A class opts in with `__hash__ = cached_hash` and `__getstate__ = state_without_hash` in its body
    (a pickled hash would be wrong in another process, where strings hash differently).
    """
    try:
        return self.__dict__["_hash"]
    except KeyError:
        value = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        return value


def state_without_hash(self) -> dict:
    return {name: value for name, value in self.__dict__.items() if name != "_hash"}


_WINDOW_TEXT = re.compile(
    r"k(?P<kh>\d+)(?:x(?P<kw>\d+))?"
    r"(?:s(?P<sh>\d+)(?:x(?P<sw>\d+))?)?"
    r"(?:p(?P<pt>\d+)(?:_(?P<pb>\d+))?(?:x(?P<pl>\d+)(?:_(?P<pr>\d+))?)?)?"
    r"(?:d(?P<dh>\d+)(?:x(?P<dw>\d+))?)?"
    r"(?P<mode>zeros|reflect|replicate|circular)?")


@dataclasses.dataclass(frozen=True)
class Window:
    """Geometry of the sliding window: all the values a specialized kernel fixes at compile time.

    kernel, stride and dilation are (h, w) pairs of positive ints; padding is
    ((top, bottom), (left, right)) of non-negative ints; padding_mode is what the padding holds, one
    of PADDING_MODES. Without padding every mode is "zeros" (the same kernel).
    """

    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))
    dilation: tuple[int, int] = (1, 1)
    padding_mode: str = "zeros"

    __hash__ = cached_hash
    __getstate__ = state_without_hash

    def __post_init__(self):
        object.__setattr__(self, "kernel", as_pair("kernel_size", self.kernel))
        object.__setattr__(self, "stride", as_pair("stride", self.stride))
        object.__setattr__(self, "dilation", as_pair("dilation", self.dilation))
        padding = explicit_padding(self.padding)
        if isinstance(padding, str):
            raise ValueError("a Window needs explicit padding; resolve 'same'/'valid' with Window.resolve")
        object.__setattr__(self, "padding", padding)
        if not isinstance(self.padding_mode, str) or self.padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {', '.join(map(repr, PADDING_MODES))}, "
                             f"got {self.padding_mode!r}")
        if padding == ((0, 0), (0, 0)):
            object.__setattr__(self, "padding_mode", "zeros")

    @classmethod
    def resolve(cls, kernel, stride, padding, dilation, input_hw, transposed=False,
                padding_mode="zeros") -> "Window":
        """Build a window, turning "same"/"valid" into explicit pads for an input of size input_hw.

        For a transposed convolution, "same" means an output of exactly input·stride (TensorFlow's
        conv2d_transpose); the pads are those of the forward convolution from that output back to
        the input, and the rows that no window reaches come from `implicit_output_padding`.
        """
        kernel = as_pair("kernel_size", kernel)
        stride = as_pair("stride", stride)
        dilation = as_pair("dilation", dilation)
        pads = explicit_padding(padding)
        if pads == "valid":
            pads = ((0, 0), (0, 0))
        elif pads == "same":
            sizes = [n * s for n, s in zip(input_hw, stride)] if transposed else input_hw
            pads = tuple(same_pads(n, k, s, d) for n, k, s, d in zip(sizes, kernel, stride, dilation))
        return cls(kernel, stride, pads, dilation, padding_mode)

    @property
    def effective_kernel(self) -> tuple[int, int]:
        """Extent of the dilated kernel: d·(k − 1) + 1."""
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation))

    def output_size(self, input_hw) -> tuple[int, int]:
        """Convolution output size (PyTorch): (H + top + bottom − d·(K − 1) − 1) // s + 1.

        Raises ValueError when the dilated kernel is larger than the padded input.
        """
        out = []
        for axis, n, (before, after), ek, s in zip("hw", input_hw, self.padding, self.effective_kernel, self.stride):
            padded = n + before + after
            if padded < ek:
                raise ValueError(
                    f"kernel extent {ek} along {axis} (kernel_size and dilation) is larger than the padded "
                    f"input {padded} (input {n} + padding {before}+{after})")
            out.append((padded - ek) // s + 1)
        return tuple(out)

    def transposed_output_size(self, input_hw, output_padding=(0, 0)) -> tuple[int, int]:
        """Transposed-convolution output size: (H − 1)·s − top − bottom + d·(K − 1) + op + 1."""
        out = []
        for axis, n, (before, after), ek, s, op in zip(
                "hw", input_hw, self.padding, self.effective_kernel, self.stride, output_padding):
            size = (n - 1) * s - before - after + ek + op
            if size < 1:
                raise ValueError(f"transposed convolution output along {axis} would be {size}: padding too large")
            out.append(size)
        return tuple(out)

    def implicit_output_padding(self, input_hw) -> tuple[int, int]:
        """For transposed "same": the extra rows/cols that make the output exactly input·stride."""
        sizes = self.transposed_output_size(input_hw)
        return tuple(n * s - size for n, s, size in zip(input_hw, self.stride, sizes))

    def short(self) -> str:
        """The compact text form that `Window.parse` reads back, e.g. k3s2p1, k3x5s1p1x2, k3s1p0_1x0_1d2,
        and with a padding mode other than zeros its name at the end: k3s1p1reflect, k5s2p2d2circular."""
        def pair(values):
            return str(values[0]) if values[0] == values[1] else f"{values[0]}x{values[1]}"
        (pt, pb), (pl, pr) = self.padding
        pad = pair((pt, pl)) if (pt, pl) == (pb, pr) else f"{pt}_{pb}x{pl}_{pr}"
        text = f"k{pair(self.kernel)}s{pair(self.stride)}p{pad}"
        text = text if self.dilation == (1, 1) else f"{text}d{pair(self.dilation)}"
        return text if self.padding_mode == "zeros" else f"{text}{self.padding_mode}"

    @classmethod
    def parse(cls, text: str) -> "Window":
        """Read the compact form: k<KH>[x<KW>] [s<SH>[x<SW>]] [p<PH>[x<PW>] | p<T>_<B>x<L>_<R>] [d<DH>[x<DW>]]
        [reflect | replicate | circular | zeros].

        Omitted parts default to stride 1, padding 0, dilation 1, zero padding: "k3" is a 3×3 valid
        convolution, "k3s1p1reflect" pads by one row and column mirrored from the image.
        """
        match = _WINDOW_TEXT.fullmatch(text.strip().lower()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"cannot read {text!r} as a window: expected e.g. k3s2p1, k7s2p3d1, k3x5s1p1x2, "
                             f"k3s1p1reflect")
        g = match.groupdict()

        def pair(first, second, default):
            if first is None:
                return (default, default)
            return (int(first), int(second if second is not None else first))

        pt, pb = int(g["pt"] or 0), int(g["pb"] if g["pb"] is not None else g["pt"] or 0)
        pl = int(g["pl"] if g["pl"] is not None else pt)
        pr = int(g["pr"] if g["pr"] is not None else (g["pl"] if g["pl"] is not None else pb))
        return cls(pair(g["kh"], g["kw"], 1), pair(g["sh"], g["sw"], 1), ((pt, pb), (pl, pr)),
                   pair(g["dh"], g["dw"], 1), g["mode"] or "zeros")


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """One kernel module: a window (None for the generic build), a dtype, a layout, the
    algorithm family whose templates (templates/<family>/) it is rendered from and, specialized, the
    kind of epilogue its forward pass applies (`Epilogue.kind()`: the generic build takes it at run
    time)."""

    window: Window | None
    dtype: str = "float32"
    layout: str = "NCHW"
    family: str = "direct"
    tile: int = 0  # winograd: the output tile m of F(m×m, r×r); 0 for the other families
    # (depthwise: groups == input channels, any window; specialized or generic like direct)
    epilogue: Epilogue = NO_EPILOGUE

    __hash__ = cached_hash
    __getstate__ = state_without_hash

    def __post_init__(self):
        if self.window is not None and not isinstance(self.window, Window):
            raise TypeError(f"window must be a Window or None, got {type(self.window).__name__}")
        dtype = np.dtype(self.dtype).name if not isinstance(self.dtype, str) else self.dtype
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be float32 or float64, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        layout = self.layout.upper() if isinstance(self.layout, str) else self.layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {self.layout!r}")
        object.__setattr__(self, "layout", layout)
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.family == "winograd":
            self._check_winograd()
        elif self.tile != 0:
            raise ValueError(f"tile is a Winograd parameter; the {self.family} family takes none, got {self.tile!r}")
        if not isinstance(self.epilogue, Epilogue):
            raise TypeError(f"epilogue must be an Epilogue, got {type(self.epilogue).__name__}")
        object.__setattr__(self, "epilogue", self.epilogue.kind())
        if self.window is None and self.epilogue.active:
            raise ValueError("the generic build takes its epilogue at run time: a generic spec has none")

    def _check_winograd(self):
        """Winograd F(m×m, r×r) computes a stride-1, undilated r × r correlation, specialized."""
        if self.tile not in WINOGRAD_TILES:
            raise ValueError(f"tile must be one of {WINOGRAD_TILES} for the winograd family, got {self.tile!r}")
        if self.window is None:
            raise ValueError("the winograd family is specialized for a window: the generic build is direct")
        if not winograd_computes(self.window):
            raise ValueError(f"the winograd family takes {WINOGRAD_WINDOW_TEXT}, got {self.window.short()}")

    @classmethod
    def parse(cls, text: str, dtype: str = "float32", layout: str = "NCHW", family: str = "direct",
              tile: int = 0) -> "ConvSpec":
        """A spec from the compact window text ("k3s2p1"), with its epilogue after an underscore
        ("k3s1p1_addrelu"), or "generic" for the generic build."""
        if isinstance(text, str) and text.strip().lower() == "generic":
            return cls(None, dtype, layout, family, tile)
        window, _, epilogue = text.strip().lower().rpartition("_") if isinstance(text, str) else ("", "", "")
        if not window or not re.fullmatch(TEXT_PATTERN, epilogue):
            # Not an epilogue: per-side padding (k3s1p0_1x0_1) has underscores of its own.
            window, epilogue = text, ""
        return cls(Window.parse(window), dtype, layout, family, tile, Epilogue.parse(epilogue))

    def short(self) -> str:
        """The compact form: the window text ("k3s2p1") or "generic", then any epilogue ("k3s1p1_relu")."""
        if self.window is None:
            return "generic"
        return self.window.short() + (f"_{self.epilogue.text()}" if self.epilogue.active else "")

    @property
    def specialized(self) -> bool:
        return self.window is not None

    @property
    def c_type(self) -> str:
        return DTYPES[self.dtype]

    def generic(self) -> "ConvSpec":
        """The generic spec of the same dtype, layout and family where the family has one: Winograd
        needs a known window, so its generic twin is direct; depthwise is chosen by the groups, not
        the window, and has a generic build of its own."""
        return ConvSpec(None, self.dtype, self.layout, "depthwise" if self.family == "depthwise" else "direct")

    @property
    def name(self) -> str:
        """The spec's one text form, also a C identifier: window text (or "generic"), family, epilogue,
        layout, dtype, e.g. k3s2p1_nchw_float32, k3s1p1_winograd4_addrelu_nchw_float32. Symbols, file
        names and messages all use it."""
        window = self.window.short() if self.window is not None else "generic"
        epilogue = f"_{self.epilogue.text()}" if self.epilogue.active else ""
        return f"{window}{self.algorithm_suffix}{epilogue}_{self.layout.lower()}_{self.dtype}"

    @property
    def algorithm_suffix(self) -> str:
        """The family in the text form: "" for direct, "_winograd4" for Winograd F(4×4, r×r), "_depthwise"."""
        return "" if self.family == "direct" else f"_{self.family}{self.tile or ''}"

    def symbol(self, entry: str) -> str:
        """The C symbol of one entry point of this spec's module, e.g. cg_conv2d_fwd_k3s1p1_nchw_float32."""
        return f"cg_conv2d_{entry}_{self.name}"

    @classmethod
    def from_symbol(cls, symbol: str) -> "ConvSpec":
        """The spec whose module exports `symbol` (the inverse of `symbol`); ValueError if none does."""
        match = _SYMBOL.fullmatch(symbol) if isinstance(symbol, str) else None
        if match is None:
            raise ValueError(f"{symbol!r} is not the symbol of a convgen entry point")
        family, tile = match.group("family") or "direct", int(match.group("tile") or 0)
        spec = cls.parse(match.group("window"), match.group("dtype"), match.group("layout").upper(), family, tile)
        epilogue = match.group("epilogue")
        return dataclasses.replace(spec, epilogue=Epilogue.parse(epilogue)) if epilogue else spec

    def __str__(self) -> str:
        return self.name


_SYMBOL = re.compile(r"cg_conv2d_[a-z]+(?:_[a-z]+)*?_(?P<window>generic|k[0-9x_spd]+?(?:reflect|replicate|circular)?)"
                     rf"(?:_(?P<family>{'|'.join(f for f in FAMILIES if f != 'direct')})(?P<tile>[0-9]*))?"
                     rf"(?:_(?P<epilogue>{TEXT_PATTERN}))?_(?P<layout>nchw|nhwc)_(?P<dtype>float32|float64)")


WINOGRAD_WINDOW_TEXT = (f"{' or '.join(f'{r}x{r}' for r in WINOGRAD_WINDOWS)} windows at stride 1 without dilation, "
                        f"zero-padded")


def winograd_computes(window: Window) -> bool:
    """Whether Winograd F(m×m, r×r) computes convolutions with this window (its input transform
    pads with zeros, so only padding_mode "zeros")."""
    return (window.kernel[0] == window.kernel[1] and window.kernel[0] in WINOGRAD_WINDOWS
            and window.stride == (1, 1) and window.dilation == (1, 1) and window.padding_mode == "zeros")


def conv_flops(n: int, f: int, c_per_group: int, kernel: tuple[int, int], out_hw: tuple[int, int]) -> int:
    """Multiply-adds × 2 of one forward convolution (also the FLOPs of each of dx and dw)."""
    return 2 * n * f * c_per_group * kernel[0] * kernel[1] * out_hw[0] * out_hw[1]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["Window", "ConvSpec", "DTYPES", "LAYOUTS", "PADDING_MODES", "FAMILIES", "WINOGRAD_TILES", "WINOGRAD_WINDOWS",
           "winograd_computes", "as_int", "as_pair", "explicit_padding",
           "conv_flops", "ceil_div"]
