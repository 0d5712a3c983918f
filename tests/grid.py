"""The windows and cases the tests sweep, known up front so conftest can compile them all in parallel."""

import dataclasses

from convgen.planning import planner
from convgen.planning.epilogue import ACTIVATIONS, Epilogue
from convgen.planning.spec import ConvSpec, Window
from convgen.runtime.kernels import settings
from helpers import to_layout

# Kernel sizes 1-7 (odd and even, square and rectangular), strides 1-3, paddings 0-3.
FORWARD_WINDOWS = [
    Window((1, 1), 1, 0), Window((1, 1), 2, 1), Window((2, 2), 1, 0), Window((2, 2), 2, 1),
    Window((3, 3), 1, 1), Window((3, 3), 2, 1), Window((3, 3), 3, 2), Window((3, 3), 1, 3),
    Window((4, 4), 2, 1), Window((4, 4), 3, 0), Window((5, 5), 1, 2), Window((5, 5), 2, 3),
    Window((6, 6), 1, 2), Window((6, 6), 3, 3), Window((7, 7), 2, 3), Window((7, 7), 1, 0),
    Window((1, 3), 1, (0, 1)), Window((3, 1), (2, 1), (1, 0)), Window((2, 5), (1, 3), (1, 2)),
    Window((7, 4), (3, 2), (3, 1)), Window((3, 5), (2, 2), (0, 2)),
]

# Dilation 1-3, asymmetric padding, and the windows of the transposed-convolution tests.
GRADIENT_WINDOWS = [
    Window((3, 3), 1, 1, 2), Window((3, 3), 2, 2, 3), Window((2, 3), (1, 2), ((0, 1), (1, 0)), (2, 1)),
    Window((4, 4), 2, 1), Window((5, 3), (3, 1), ((2, 1), (0, 2)), (1, 3)), Window((1, 1), 1, 0),
    Window((3, 3), 2, 0), Window((3, 3), 1, ((1, 1), (1, 1)), 1), Window((4, 2), (2, 3), ((1, 2), (0, 1)), 1),
    # test_gradients.py: pair padding with dilation, "valid" with dilation, and what "same" resolves to there
    Window((3, 5), (2, 1), (1, 2), (1, 2)), Window((3, 3), 1, 0, 2), Window((4, 2), 1, ((1, 2), (0, 1))),
    Window((3, 3), 2, ((1, 1), (0, 1))), Window((3, 3), 3, ((2, 2), (1, 2)), 2),
    Window((2, 3), (2, 1), ((0, 1), (2, 2)), (1, 2)), Window((4, 3), 2, ((1, 1), (0, 1))), Window((3, 3), 3, 1, 2),
    Window((3, 3), 1, ((0, 1), (2, 1))),  # the 3x3 stride-1 case, which Winograd computes too
]

LAYOUTS = ("NCHW", "NHWC")
DTYPES = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class Case:
    """One convolution: x is (n, c, h, w) in NCHW terms; f output channels.

    For conv2d the weight is (f, c/groups, KH, KW); for conv_transpose2d c is C_in, f is C_out and
    the weight is (c, f/groups, KH, KW), both moved to the layout's conventions by `arrays`.
    """

    name: str
    n: int
    c: int
    h: int
    w: int
    f: int
    kernel: tuple
    stride: object = 1
    padding: object = 0
    dilation: object = 1
    groups: int = 1
    output_padding: object = 0  # conv_transpose2d only
    padding_mode: str = "zeros"  # conv2d only

    def kwargs(self, transposed=False):
        kw = dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)
        if transposed:
            kw["output_padding"] = self.output_padding
        if self.padding_mode != "zeros":
            kw["padding_mode"] = self.padding_mode
        return kw

    def window(self, transposed=False) -> Window:
        """The explicit window "same"/"valid" resolve to for this input size (what gets compiled)."""
        return Window.resolve(self.kernel, self.stride, self.padding, self.dilation, (self.h, self.w), transposed,
                              self.padding_mode)

    def arrays(self, rng, layout, dtype, transposed=False):
        weight_shape = ((self.c, self.f // self.groups) if transposed else (self.f, self.c // self.groups))
        x, weight = to_layout(rng.standard_normal((self.n, self.c, self.h, self.w)),
                              rng.standard_normal(weight_shape + tuple(self.kernel)), layout)
        return x.astype(dtype), weight.astype(dtype), rng.standard_normal(self.f).astype(dtype)

    def flops(self):
        """2 × the multiply-adds of the convolution (the same for each of its gradients)."""
        (ho, wo), (kh, kw) = self.window().output_size((self.h, self.w)), self.kernel
        return 2 * self.n * self.f * (self.c // self.groups) * kh * kw * ho * wo

    def __str__(self):
        return self.name


# The gradient grid: test_gradients.py runs every case on the default schedule (both layouts, both
# dtypes, specialized and generic), test_isa.py on every instruction set the machine runs.
# The resolved windows of every case are in GRADIENT_WINDOWS (see test_every_window_is_prebuilt).
CONV_CASES = [
    Case("d2-pad1", 2, 3, 9, 8, 4, (3, 3), 1, 1, 2),
    Case("d3-s2-pad2-g2", 2, 4, 11, 10, 6, (3, 3), 2, 2, 3, 2),
    Case("sides-rect-d2x1", 1, 2, 7, 9, 3, (2, 3), (1, 2), ((0, 1), (1, 0)), (2, 1)),
    Case("sides-s3x1-d1x3", 2, 3, 10, 12, 2, (5, 3), (3, 1), ((2, 1), (0, 2)), (1, 3)),
    Case("pair-pad-depthwise", 2, 4, 9, 10, 4, (3, 5), (2, 1), (1, 2), (1, 2), 4),
    Case("depthwise-x2-d2", 1, 3, 8, 8, 6, (3, 3), 1, 1, 2, 3),
    Case("valid-k4-s3", 2, 3, 11, 10, 4, (4, 4), 3, "valid"),
    Case("valid-d2-g2", 1, 4, 9, 9, 4, (3, 3), 1, "valid", 2, 2),
    Case("same-odd-total-s1", 2, 3, 9, 7, 4, (4, 2), 1, "same"),
    Case("same-s2-odd-total", 2, 3, 9, 8, 5, (3, 3), 2, "same"),
    Case("same-s3-d2-g2", 1, 4, 10, 8, 2, (3, 3), 3, "same", 2, 2),
    Case("same-s2x1-d1x2-depthwise", 2, 3, 7, 6, 3, (2, 3), (2, 1), "same", (1, 2), 3),
    Case("1x1-g2", 2, 4, 5, 5, 6, (1, 1), 1, 0, 1, 2),
    Case("1x1-s2-pad1-unreached", 1, 2, 6, 7, 3, (1, 1), 2, 1),
    Case("3x3-s1-sides-g2", 2, 4, 9, 11, 6, (3, 3), 1, ((0, 1), (2, 1)), 1, 2),  # Winograd computes it too
]

TRANSPOSE_CASES = [
    Case("k4-s2-pad1", 2, 3, 4, 5, 2, (4, 4), 2, 1),
    Case("s2-op1", 2, 2, 3, 4, 3, (3, 3), 2, 0, output_padding=1),
    Case("s1-d2-op1", 1, 2, 4, 5, 4, (3, 3), 1, 1, 2, output_padding=1),          # op >= stride: d > s
    Case("s2-d3-op2-g2", 2, 4, 4, 3, 2, (3, 3), 2, 2, 3, 2, output_padding=2),    # op >= stride: d > s
    Case("sides-s3x1-d1x3-op2", 1, 2, 3, 4, 3, (5, 3), (3, 1), ((2, 1), (0, 2)), (1, 3), output_padding=2),
    Case("sides-rect-g2-op1", 2, 4, 4, 3, 2, (2, 3), (1, 2), ((0, 1), (1, 0)), (2, 1), 2, output_padding=1),
    Case("sides-depthwise-op1x2", 1, 4, 3, 4, 4, (4, 2), (2, 3), ((1, 2), (0, 1)), 1, 4,
         output_padding=(1, 2)),
    Case("pair-pad-depthwise-x2", 2, 3, 4, 5, 6, (3, 5), (2, 1), (1, 2), (1, 2), 3, output_padding=1),
    Case("valid-k4-s3-op2x1", 1, 3, 3, 4, 2, (4, 4), 3, "valid", output_padding=(2, 1)),
    Case("same-s2-odd-total", 2, 3, 3, 4, 2, (4, 3), 2, "same"),
    Case("same-s1-odd-total-g2", 1, 4, 5, 6, 2, (4, 2), 1, "same", 1, 2),
    Case("same-s3-d2-depthwise", 1, 3, 3, 4, 3, (3, 3), 3, "same", 2, 3),
    Case("3x3-s1-same", 2, 6, 7, 5, 4, (3, 3), 1, "same"),                      # Winograd computes it too
]


# The padding modes (test_padding_modes.py): every mode with strides 1-3, dilation, groups 1/2/depthwise,
# every padding form, each run in both layouts, dtypes and builds. Their windows are prebuilt.
PADDING_MODE_CASES = [
    Case("reflect-k3-pad1", 2, 3, 6, 7, 4, (3, 3), 1, 1, padding_mode="reflect"),
    # top padding 2 of a 3-row image: the most reflect allows
    Case("reflect-sides-s2x1-d1x2-g2", 2, 4, 3, 7, 6, (3, 2), (2, 1), ((2, 1), (0, 1)), (1, 2), 2,
         padding_mode="reflect"),
    Case("replicate-same-k4x3-s1x2", 1, 3, 7, 6, 4, (4, 3), (1, 2), "same", padding_mode="replicate"),
    # padding wider than the image and than the dilated kernel reaches: rows read only the edge
    Case("replicate-s3-d2-pad6x4-depthwise", 2, 3, 5, 6, 3, (3, 3), 3, (6, 4), 2, 3, padding_mode="replicate"),
    Case("circular-pair-k5x3-s2-g2", 2, 4, 8, 5, 2, (5, 3), 2, (2, 1), 1, 2, padding_mode="circular"),
    # left and right padding 2 of a 2-column image: circular wraps the whole width once
    Case("circular-whole-width-d2x1", 1, 2, 4, 2, 3, (2, 3), 1, ((0, 1), (2, 2)), (2, 1), padding_mode="circular"),
    # no padding: every mode is the zeros kernel
    Case("reflect-valid", 2, 2, 5, 5, 3, (2, 2), 1, "valid", padding_mode="reflect"),
]
PADDING_MODE_WINDOWS = list(dict.fromkeys(case.window() for case in PADDING_MODE_CASES))

# The windows the gradient grid compiles, in order of first use.
GRID_WINDOWS = list(dict.fromkeys([case.window() for case in CONV_CASES]
                                  + [case.window(True) for case in TRANSPOSE_CASES]))


def grid_dtype(window, layout):
    """The one dtype each (window, layout) of the gradient grid runs on the extra instruction sets:
    alternating, so both dtypes meet both layouts, at half the compiles of every combination."""
    return DTYPES[(GRID_WINDOWS.index(window) + LAYOUTS.index(layout)) % 2]


def isa_grid_specs():
    """The specialized specs the gradient grid needs under one forced instruction set."""
    return [ConvSpec(window, grid_dtype(window, layout), layout) for window in GRID_WINDOWS for layout in LAYOUTS]


# Production-sized convolutions (test_production.py): each over 100 MFLOP, so the kernels plan several
# threads; every one runs all four ops, the transposed pair as the adjoint of the convolution (input
# shaped like its output), whose kernels see the same sizes. Between them they reach what the small
# grids cannot: more than KC = 256 filters per group (dx blocks over filters), more than 1024
# (channel, tap) rows (forward K blocks on AVX-512; 256 on AVX2), windows of 64 and 81 taps (the
# looped micro-kernel, and packing loops above 64 taps), few images (threads share one image's pixel
# blocks) and many (each thread takes whole images), NHWC and groups.
@dataclasses.dataclass(frozen=True)
class Production:
    case: Case
    layout: str
    dtype: str

    def spec(self, specialize=True):
        return ConvSpec(self.case.window() if specialize else None, self.dtype, self.layout)

    def __str__(self):
        return f"{self.case.name}-{self.layout}-{self.dtype}"


PRODUCTION_CASES = [
    # 81 taps, 32 × 81 = 2592 forward rows; 4 images: each thread takes whole images.
    Production(Case("k9-rows2592-n4", 4, 32, 16, 16, 48, (9, 9), 1, 4), "NHWC", "float64"),
    # 64 taps, 320 filters (dx: a 256-filter block and a 64-filter one), 1536 rows; 2 images share threads.
    Production(Case("k8s2-f320-rows1536-n2", 2, 24, 24, 24, 320, (8, 8), 2, 3), "NCHW", "float32"),
    # 2 groups of 160 channels: 1440 rows per group; one image, so every thread works on it.
    Production(Case("k3-g2-rows1440-n1", 1, 320, 20, 20, 128, (3, 3), 1, 1, 1, 2), "NCHW", "float64"),
    # dilation 2, stride 2, 288 filters: dx blocks over filters in NHWC.
    Production(Case("k5s2d2-f288-n3", 3, 40, 28, 28, 288, (5, 5), 2, 4, 2), "NHWC", "float32"),
]


# The depthwise family (groups == input channels), which tests/test_depthwise.py runs on every op:
# MobileNet's 3×3 and 5×5 windows at stride 1 and 2 in every layout and dtype (kernels.toml
# prebuilds them too), and more windows (1×1, 7×7, dilation, per-side and asymmetric padding,
# rectangular) in one dtype per layout, alternating. The property tests draw their depthwise calls
# from all of them.
DEPTHWISE_WINDOWS = [Window(3, 1, 1), Window(3, 2, 1), Window(5, 1, 2), Window(5, 2, 2)]
DEPTHWISE_MORE_WINDOWS = [
    Window(1, 1, 0), Window(7, 2, 3), Window(3, 1, 2, 2), Window(3, 2, ((0, 1), (1, 0))),
    Window((2, 5), (1, 3), ((1, 0), (2, 1)), (2, 1)), Window(3, 3, 1),
]


def depthwise_dtypes(window, layout):
    """The dtypes the depthwise tests run `window` in, in `layout`."""
    if window in DEPTHWISE_WINDOWS:
        return DTYPES
    return (DTYPES[(DEPTHWISE_MORE_WINDOWS.index(window) + LAYOUTS.index(layout)) % 2],)


def depthwise_specs():
    specs = [ConvSpec(window, dtype, layout, "depthwise") for window in DEPTHWISE_WINDOWS + DEPTHWISE_MORE_WINDOWS
             for layout in LAYOUTS for dtype in depthwise_dtypes(window, layout)]
    return specs + [ConvSpec(None, dtype, layout, "depthwise") for layout in LAYOUTS for dtype in DTYPES]


# Fused epilogues (tests/test_epilogue.py). Every activation, specialized (each with its residual added
# before it; relu also without one and after it; a residual alone), on one window, the layouts taking
# turns; and every family's store sites in both layouts and dtypes under three kinds (the residual
# before, after and absent), the dtypes taking turns.
EPILOGUE_WINDOW = Window(3, 1, 1)
EPILOGUE_ACTIVATIONS = ([(activation, "before") for activation in ACTIVATIONS if activation != "none"]
                        + [("relu", "none"), ("relu", "after"), ("none", "before")])
EPILOGUE_FAMILY_KINDS = [(family, layout, DTYPES[(k + l) % 2], kind)
                         for family in ("direct", "winograd", "depthwise") for l, layout in enumerate(LAYOUTS)
                         for k, kind in enumerate(("addrelu", "hardswishadd", "clamp"))]


def epilogue_specs():
    specs = [ConvSpec(EPILOGUE_WINDOW, "float32", LAYOUTS[i % 2], epilogue=Epilogue(activation, position))
             for i, (activation, position) in enumerate(EPILOGUE_ACTIVATIONS)]
    for family, layout, dtype, kind in EPILOGUE_FAMILY_KINDS:
        tile = planner.winograd_tile(dtype, settings().schedule()) if family == "winograd" else 0
        specs.append(ConvSpec(EPILOGUE_WINDOW, dtype, layout, family, tile, Epilogue.parse(kind)))
    return specs


def all_specs():
    specs = []
    for window in FORWARD_WINDOWS + GRADIENT_WINDOWS + PADDING_MODE_WINDOWS:
        for layout in LAYOUTS:
            for dtype in DTYPES:
                specs.append(ConvSpec(window, dtype, layout))
    for layout in LAYOUTS:
        for dtype in DTYPES:
            specs.append(ConvSpec(None, dtype, layout))
    specs += [production.spec() for production in PRODUCTION_CASES]
    specs += depthwise_specs()
    specs += epilogue_specs()
    return list(dict.fromkeys(specs))

