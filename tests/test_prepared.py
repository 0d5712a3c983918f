"""Weights laid out once: the kernels' `prepare` entry point and the NumPy API's PreparedConv.

A call given prepared weights must compute exactly what the call that lays them out itself computes
(the same panels, the same arithmetic: equal to the last bit), on every family and path; the results
are checked against the reference too, and the prepared form must never be read stale.
"""

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.frontend import ops
from helpers import seeded_rng, to_layout

# (n, c, h, f, kernel, stride, padding, groups, algorithm): the pixel rows (small images, many channels:
# with the column tiles split among the threads), the phase planes (large NCHW images; few channels),
# Winograd and the depthwise family. Windows the test grid builds anyway (tests/grid.py).
CASES = [
    (1, 64, 7, 200, 3, 1, 1, 1, "direct"),
    (2, 32, 12, 40, 3, 2, 1, 2, "direct"),
    (1, 8, 40, 12, 3, 1, 1, 1, "direct"),
    (2, 3, 30, 16, 5, 1, 2, 1, "direct"),
    (2, 16, 9, 24, 3, 1, 1, 1, "winograd"),
    (2, 16, 8, 16, 3, 1, 1, 16, "depthwise"),
    (2, 32, 9, 32, 3, 2, 1, 16, "direct"),   # groups of 2 channels: the forward pass by diagonals in NHWC
]


def _arrays(case, dtype, layout):
    n, c, h, f, k, s, p, g, algorithm = case
    rng = seeded_rng("prepared", case, dtype, layout)
    x = rng.standard_normal((n, c, h, h)).astype(dtype)
    w = rng.standard_normal((f, c // g, k, k)).astype(dtype)
    bias = rng.standard_normal(f).astype(dtype)
    x, w = to_layout(x, w, layout)
    return x, w, bias, dict(stride=s, padding=p, groups=g, layout=layout, algorithm=algorithm)


# Winograd is specialized only, and the depthwise family has nothing to prepare: generic builds of the direct cases
BUILDS = [(case, True) for case in CASES] + [(case, False) for case in CASES if case[-1] == "direct"]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case, specialize", BUILDS, ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_prepared_weights_give_the_same_bits_as_weights_laid_out_per_call(case, specialize, dtype, layout):
    x, w, bias, kwargs = _arrays(case, dtype, layout)
    kwargs["specialize"] = specialize
    y = convgen.conv2d(x, w, bias, **kwargs)
    dy = seeded_rng("dy", case).standard_normal(y.shape).astype(dtype)
    dx, _, _ = convgen.conv2d_backward(dy, x, w, **kwargs)
    for op, entry, arrays, want in (("conv2d", "fwd", (x, w, bias), y), ("conv2d_backward", "bwd_data", (dy, x, w), dx)):
        call = ops.prepare(op, arrays, **kwargs)
        kernels, problem = call.kernels(), call.problem
        prepared = kernels.prepare_weights(entry, problem, w)
        if case[-1] == "depthwise":  # reads the weights as they are: nothing to prepare
            assert prepared is None and kernels.prepared_size(entry, problem) == 0
            continue
        assert prepared.ctypes.data % 64 == 0 and prepared.size == kernels.prepared_size(entry, problem)
        got = np.full_like(want, np.nan)
        # the weights' own argument is NULL: only the prepared form is read
        args = (x, None, prepared, bias, None, got) if entry == "fwd" else (dy, None, prepared, got)
        kernels.call(entry, problem, args)
        np.testing.assert_array_equal(got, want, err_msg=entry)


def test_the_input_gradient_of_non_finite_weights_is_prepared_for_the_kernel_that_propagates_them():
    # The pixel rows read zeros past dy, and 0 * inf is NaN where the scatter adds nothing: weights
    # holding inf are laid out for the scatter, which `prepare` decides once, as a call decides it.
    rng = seeded_rng("non-finite")
    x = rng.standard_normal((1, 64, 6, 6)).astype(np.float32)
    w = rng.standard_normal((96, 64, 3, 3)).astype(np.float32)
    w[3, 5, 0, 0] = np.inf
    dy = rng.standard_normal((1, 96, 6, 6)).astype(np.float32)
    kwargs = dict(padding=1, algorithm="direct")
    want = convgen.conv2d_backward(dy, x, w, **kwargs)[0]
    call = ops.prepare("conv2d_backward", (dy, x, w), **kwargs)
    prepared = call.kernels().prepare_weights("bwd_data", call.problem, w)
    got = np.empty_like(want)
    call.kernels().call("bwd_data", call.problem, (dy, None, prepared, got))
    np.testing.assert_array_equal(got, want)
    ref = reference.conv2d_backward(dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64), padding=1)[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))


# ------------------------------------------------------------------------------------- PreparedConv
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_prepared_conv2d_computes_conv2d(case):
    x, w, bias, kwargs = _arrays(case, np.float32, "NCHW")
    conv = convgen.prepare_conv2d(w, bias, input_shape=x.shape, **kwargs)
    np.testing.assert_array_equal(conv(x), convgen.conv2d(x, w, bias, **kwargs))
    ref = reference.conv2d(x.astype(np.float64), w.astype(np.float64), bias.astype(np.float64), stride=kwargs["stride"],
                           padding=kwargs["padding"], groups=kwargs["groups"])
    assert np.abs(conv(x) - ref).max() <= 1e-4 * np.abs(ref).max()
    out = np.empty(conv.output_shape, np.float32)
    assert conv(x, out=out) is out


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_prepared_conv_transpose2d_computes_conv_transpose2d(layout):
    rng = seeded_rng("transposed", layout)
    x = rng.standard_normal((2, 24, 7, 7)).astype(np.float64)
    w = rng.standard_normal((24, 10, 4, 4)).astype(np.float64)
    bias = rng.standard_normal(10)
    x, w = to_layout(x, w, layout, transposed=True)
    kwargs = dict(stride=2, padding=1, output_padding=1, layout=layout)
    conv = convgen.prepare_conv_transpose2d(w, bias, input_shape=x.shape, **kwargs)
    np.testing.assert_array_equal(conv(x), convgen.conv_transpose2d(x, w, bias, **kwargs))


def test_a_prepared_conv_keeps_the_values_it_was_given_until_updated():
    rng = seeded_rng("update")
    x = rng.standard_normal((1, 32, 6, 6)).astype(np.float32)
    w = rng.standard_normal((48, 32, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(48).astype(np.float32)
    bias_given = bias.copy()
    before = convgen.conv2d(x, w, bias, padding=1)
    conv = convgen.prepare_conv2d(w, bias, input_shape=x.shape, padding=1)
    w *= 2  # the caller's arrays change in place: the prepared form holds the values given
    bias[:] = 0
    np.testing.assert_array_equal(conv(x), before)
    conv.update(w)  # new weights, the bias given before kept
    np.testing.assert_array_equal(conv(x), convgen.conv2d(x, w, bias_given, padding=1))
    conv.update(w, bias=None)
    np.testing.assert_array_equal(conv(x), convgen.conv2d(x, w, padding=1))


def test_a_prepared_conv_refuses_what_it_was_not_prepared_for():
    rng = seeded_rng("refuse")
    x = rng.standard_normal((1, 8, 6, 6)).astype(np.float32)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    conv = convgen.prepare_conv2d(w, input_shape=x.shape, padding=1)
    with pytest.raises(ValueError, match="x must have shape"):
        conv(x[:, :, :5])
    with pytest.raises(ValueError, match="x must have shape"):
        conv(x.astype(np.float64))
    with pytest.raises(TypeError, match="x must be a NumPy array"):
        conv(x.tolist())
    with pytest.raises(ValueError, match="out must have shape"):
        conv(x, out=np.empty((1, 16, 5, 5), np.float32))
    with pytest.raises(ValueError, match="w must have shape"):
        conv.update(w[:8])
    with pytest.raises(ValueError, match="bias must be"):
        conv.update(w, bias=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="input_shape"):
        convgen.prepare_conv2d(w, input_shape=(8, 6, 6))
    with pytest.raises(ValueError, match="x expects|w expects|channels"):  # conv2d's own checks
        convgen.prepare_conv2d(w, input_shape=(1, 3, 6, 6))
    x_strided = np.asfortranarray(x)  # any memory order: copied first, as conv2d does
    np.testing.assert_array_equal(conv(x_strided), conv(x))


def test_a_prepared_conv_says_what_it_computes():
    w = np.zeros((4, 2, 3, 3), np.float32)
    text = repr(convgen.prepare_conv2d(w, input_shape=(1, 2, 5, 5), padding=1))
    assert text.startswith("PreparedConv(conv2d, input_shape=(1, 2, 5, 5)") and "padding=1" in text
    assert "output_padding" not in text and "weights laid out" in text
    transposed = repr(convgen.prepare_conv_transpose2d(np.zeros((2, 4, 3, 3), np.float32), input_shape=(1, 2, 5, 5),
                                                       stride=2, output_padding=1))
    assert "conv_transpose2d" in transposed and "output_padding=1" in transposed
