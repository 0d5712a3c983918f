"""conv2d against the NumPy reference over kernel × stride × padding × batch × layout × dtype × variant."""

import numpy as np
import pytest

import convgen
from convgen import reference
from grid import DTYPES, FORWARD_WINDOWS, LAYOUTS
from helpers import assert_close, seeded_rng, to_layout


def _window_kwargs(window):
    return dict(stride=window.stride, padding=window.padding, dilation=window.dilation)


@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", FORWARD_WINDOWS, ids=lambda w: w.short())
def test_forward_matches_reference(window, layout, dtype, specialize):
    rng = seeded_rng(window.short(), layout, dtype)
    kh, kw = window.kernel
    for n, c, f, h, w in ((1, 3, 5, 9, 8), (3, 4, 9, 12, 11)):
        x, weight = to_layout(rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c, kh, kw)), layout)
        x, weight = x.astype(dtype), weight.astype(dtype)
        bias = rng.standard_normal(f).astype(dtype)
        y = convgen.conv2d(x, weight, bias, layout=layout, specialize=specialize, **_window_kwargs(window))
        expected = reference.conv2d(x, weight, bias, layout=layout, **_window_kwargs(window))
        assert_close(y, expected, dtype, f"conv2d n={n}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", [FORWARD_WINDOWS[4], FORWARD_WINDOWS[14]], ids=lambda w: w.short())
def test_forward_large_enough_for_every_block(window, layout):
    """More (channel, tap) rows than one forward K block (7x7: 40 × 49 = 1960, past AVX-512's 1024;
    3x3: 360, past AVX2's 256) and more pixels than one work item."""
    rng = np.random.default_rng(7)
    x, weight = to_layout(rng.standard_normal((2, 40, 50, 47)), rng.standard_normal((19, 40, *window.kernel)), layout)
    for specialize in (True, False):
        y = convgen.conv2d(x, weight, layout=layout, specialize=specialize, **_window_kwargs(window))
        assert_close(y, reference.conv2d(x, weight, layout=layout, **_window_kwargs(window)), np.float64)


# NHWC through phase planes (under 128 channel-filter products a group keep them, not the pixel rows):
# x is split into planes 16 channels of a pixel at a time, transposed in registers where a plane row
# holds 16 pixels or more; groups of fewer channels are split all at once, by the threads of one
# image together (batch 1 and 2 on 2 threads) or by a thread per image (batch 4).
@pytest.mark.parametrize("n, c, h, w, f, window, groups", [
    (1, 32, 20, 23, 2, FORWARD_WINDOWS[4], 1),   # two runs of 16 channels, rows of 23 pixels
    (2, 40, 19, 35, 3, FORWARD_WINDOWS[5], 1),   # stride 2: plane rows of 18 pixels; a last run of 8 channels
    (1, 64, 18, 21, 64, FORWARD_WINDOWS[4], 32),  # 32 groups of 2 channels, one image
    (4, 64, 9, 17, 64, FORWARD_WINDOWS[5], 32),   # ... four images
], ids=["c32", "c40-s2", "g32-n1", "g32-n4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nhwc_phase_planes_split_in_registers(n, c, h, w, f, window, groups, dtype, threads):
    threads(2)
    rng = seeded_rng("nhwc-split", n, c, groups, dtype)
    x, weight = to_layout(rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c // groups, 3, 3)), "NHWC")
    x, weight = x.astype(dtype), weight.astype(dtype)
    expected = reference.conv2d(x, weight, layout="NHWC", groups=groups, **_window_kwargs(window))
    for specialize in (True, False):
        y = convgen.conv2d(x, weight, layout="NHWC", groups=groups, specialize=specialize, **_window_kwargs(window))
        assert_close(y, expected, dtype, f"specialize={specialize}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_specialized_and_generic_agree(dtype):
    rng = np.random.default_rng(3)
    for window in FORWARD_WINDOWS:
        x = rng.standard_normal((2, 6, 13, 10)).astype(dtype)
        weight = rng.standard_normal((8, 6, *window.kernel)).astype(dtype)
        a = convgen.conv2d(x, weight, specialize=True, **_window_kwargs(window))
        b = convgen.conv2d(x, weight, specialize=False, **_window_kwargs(window))
        assert_close(a, b.astype(np.float64).astype(dtype), dtype, window.short())


def test_hand_checked_values():
    """x = 1..9 (3×3), w = [[1, 2], [3, 4]]: every value below worked out by hand."""
    x = np.arange(1, 10, dtype=np.float64).reshape(1, 1, 3, 3)
    w = np.array([[1.0, 2.0], [3.0, 4.0]]).reshape(1, 1, 2, 2)
    for specialize in (True, False):
        assert convgen.conv2d(x, w, specialize=specialize).tolist() == [[[[37, 47], [67, 77]]]]
        assert convgen.conv2d(x, w, padding=1, specialize=specialize).tolist() == [[[
            [4, 11, 18, 9], [18, 37, 47, 21], [36, 67, 77, 33], [14, 23, 26, 9]]]]
        # stride 2 with padding 1 keeps rows/cols 0 and 2 of the padded result
        assert convgen.conv2d(x, w, padding=1, stride=2, specialize=specialize).tolist() == [[[[4, 18], [36, 77]]]]
        # a bias of 0.5 on every output
        b = np.array([0.5])
        assert convgen.conv2d(x, w, b, specialize=specialize).tolist() == [[[[37.5, 47.5], [67.5, 77.5]]]]


def test_output_shape_and_dtype_follow_pytorch_convention():
    x = np.zeros((2, 3, 17, 12), np.float32)
    w = np.zeros((4, 3, 5, 2), np.float32)
    y = convgen.conv2d(x, w, stride=(3, 2), padding=(2, 1), dilation=(1, 2))
    # Ho = (17 + 4 - 4 - 1)//3 + 1 = 6, Wo = (12 + 2 - 2 - 1)//2 + 1 = 6
    assert y.shape == (2, 4, 6, 6) and y.dtype == np.float32
    y = convgen.conv2d(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), stride=(3, 2), padding=(2, 1),
                       dilation=(1, 2), layout="NHWC")
    assert y.shape == (2, 6, 6, 4)
