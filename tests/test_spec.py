"""The spec layer: the compact window text, checks on fixed parameters, and padding resolution."""

import pytest

from convgen.planning.spec import MAX_WINDOW_VALUE, ConvSpec, Window


@pytest.mark.parametrize("text, window", [
    ("k3", Window(3, 1, 0)),
    ("k3s2p1", Window(3, 2, 1)),
    ("k7s2p3d1", Window(7, 2, 3, 1)),
    ("k3x5s1p1x2", Window((3, 5), 1, (1, 2))),
    ("k3s1p0_1x0_1d2", Window(3, 1, ((0, 1), (0, 1)), 2)),
    ("k4x2s2x1p1_2x3_4d2x3", Window((4, 2), (2, 1), ((1, 2), (3, 4)), (2, 3))),
])
def test_window_text_reads_and_round_trips(text, window):
    assert Window.parse(text) == window
    assert Window.parse(window.short()) == window


@pytest.mark.parametrize("text", ["", "3", "k", "k3s", "k3q1", "k0", "k3s0", "s2k3", "k3p-1"])
def test_malformed_window_text_is_a_value_error(text):
    with pytest.raises(ValueError):
        Window.parse(text)


def test_generic_spec_text():
    spec = ConvSpec.parse("generic", "float64", "NHWC")
    assert spec.window is None and not spec.specialized and spec.short() == "generic"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kernel=0), ValueError, "kernel_size must be >= 1"),
    (dict(kernel=3, stride=0), ValueError, "stride must be >= 1"),
    (dict(kernel=3, stride=1.0), TypeError, "stride must be an integer"),
    (dict(kernel=3, dilation=True), TypeError, "dilation must be an integer"),
    (dict(kernel=3, padding=-1), ValueError, "padding must be >= 0"),
    (dict(kernel=3, padding="same"), ValueError, "explicit padding"),
    (dict(kernel=3, stride=MAX_WINDOW_VALUE + 1), ValueError, "stride must be at most"),
])
def test_window_checks_its_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        Window(**kwargs)


def test_spec_checks_dtype_and_layout():
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        ConvSpec(None, "int32")
    with pytest.raises(ValueError, match="layout must be"):
        ConvSpec(None, "float32", "CHWN")
    assert ConvSpec(None, "float32", "nhwc").layout == "NHWC"


def test_output_sizes_by_hand():
    # (10 + 1 + 2 - 2·(3 - 1) - 1) // 2 + 1 = 5 rows; (7 + 0 + 0 - 3) // 1 + 1 = 5 columns
    assert Window((3, 3), (2, 1), ((1, 2), (0, 0)), (2, 1)).output_size((10, 7)) == (5, 5)
    # transposed: (4 - 1)·2 - 1 - 1 + (4 - 1) + 1 + 1 = 9
    assert Window(4, 2, 1).transposed_output_size((4, 4), (1, 1)) == (9, 9)
    with pytest.raises(ValueError, match="larger than the padded input"):
        Window(5).output_size((3, 3))


def test_same_padding_follows_tensorflow():
    # input 10, stride 3: output ceil(10/3) = 4, total pad (4-1)·3 + 3 - 10 = 2 -> (1, 1)
    assert Window.resolve(3, 3, "same", 1, (10, 10)).padding == ((1, 1), (1, 1))
    # input 10, stride 2, kernel 4: output 5, total (5-1)·2 + 4 - 10 = 2 -> (1, 1); kernel 2: total 0
    assert Window.resolve(4, 2, "same", 1, (10, 10)).padding == ((1, 1), (1, 1))
    # odd total: the extra row goes to the bottom
    assert Window.resolve(2, 1, "same", 1, (5, 5)).padding == ((0, 1), (0, 1))
    assert Window.resolve(3, 2, "valid", 1, (5, 5)).padding == ((0, 0), (0, 0))
    # transposed "same": output exactly input·stride
    w = Window.resolve(4, 2, "same", 1, (7, 7), transposed=True)
    assert w.transposed_output_size((7, 7), w.implicit_output_padding((7, 7))) == (14, 14)


def test_symbols_are_distinct_per_window_dtype_and_layout():
    specs = [ConvSpec(Window.parse(t), d, l) for t in ("k3s1p1", "k3s2p1", "k3s1p0_1x1_1")
             for d in ("float32", "float64") for l in ("NCHW", "NHWC")]
    assert len({s.symbol("fwd") for s in specs}) == len(specs)
