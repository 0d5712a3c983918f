"""The windows the tests sweep, known up front so conftest can compile them all in parallel."""

from convgen.spec import ConvSpec, Window

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
]

LAYOUTS = ("NCHW", "NHWC")
DTYPES = ("float32", "float64")


def all_specs():
    specs = []
    for window in FORWARD_WINDOWS + GRADIENT_WINDOWS:
        for layout in LAYOUTS:
            for dtype in DTYPES:
                specs.append(ConvSpec(window, dtype, layout))
    for layout in LAYOUTS:
        for dtype in DTYPES:
            specs.append(ConvSpec(None, dtype, layout))
    return specs
