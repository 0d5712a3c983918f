"""Fused epilogues: conv2d's activation, residual add and per-channel scale, applied in the kernels'
store, against convgen.reference (which applies them in float64 after its own convolution).

The epilogue is one piece of C (templates/common/epilogue.c.j2: each activation's expression, the
residual before or after it) called from each family's store sites. So the tests cross the two
factors: every activation and residual position through the generic build (one module per family,
the kind chosen at run time) in every family, layout and dtype, and through specialized builds of one
window (the kind generated in); and every family's store sites (every path: direct phase planes and
pixel rows, bands and staged tiles; Winograd's output transform; depthwise NCHW planes, NHWC rows
made directly, pixel-major, from tiles and streamed) in both layouts and dtypes through specialized
builds of three kinds. Also: NaN and inf as PyTorch propagates them, the oracle against PyTorch's own
activations, a residual that is the output, the caller's arrays untouched, the spec's text form,
symbols and errors.
"""

import dataclasses

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.planning.epilogue import ACTIVATIONS, Epilogue, as_epilogue
from convgen.planning.spec import ConvSpec, Window
from grid import DTYPES, EPILOGUE_ACTIVATIONS, EPILOGUE_FAMILY_KINDS, LAYOUTS
from helpers import TOLERANCE, kernels_for, seeded_rng, to_layout
from convgen.frontend.resolve import conv_problem

# Every activation as the ops take it, with parameters away from the defaults where it has some.
ACTIVATION_ARGUMENTS = {"none": None, "relu": "relu", "clamp": ("clamp", -0.5, 1.25),
                        "leaky_relu": ("leaky_relu", 0.2), "silu": "silu", "hardswish": "hardswish",
                        "gelu": "gelu", "gelu_tanh": "gelu_tanh", "sigmoid": "sigmoid"}
assert set(ACTIVATION_ARGUMENTS) == set(ACTIVATIONS)

# Shapes (n, c, h, w, f, groups) that reach each family's store sites, per layout, for the window k3s1p1.
FAMILY_CASES = {
    "direct": {
        "NCHW": [(2, 32, 7, 7, 48, 1),     # pixel rows, tiles staged (a vector of filters or more)
                 (2, 16, 7, 7, 8, 1),      # pixel rows, tiles stored straight to y
                 (1, 8, 30, 30, 24, 1),    # phase planes
                 (2, 8, 9, 9, 12, 4)],     # phase planes, groups
        "NHWC": [(2, 32, 7, 7, 48, 1),     # pixel rows, pointers into x
                 (1, 3, 20, 20, 20, 1),    # pixel rows through padded bands (few channels)
                 (1, 8, 17, 17, 16, 4)],   # phase planes (groups of 2 channels)
    },
    "winograd": {layout: [(2, 16, 12, 12, 20, 1), (1, 32, 9, 10, 32, 1)] for layout in LAYOUTS},
    "depthwise": {
        "NCHW": [(2, 16, 12, 12, 16, 16), (1, 8, 9, 21, 16, 8)],
        "NHWC": [(1, 136, 10, 30, 136, 136),  # rows made directly, rows first (> 512 bytes a pixel: every ISA)
                 (2, 40, 9, 11, 40, 40),   # directly, block after block
                 (1, 20, 8, 8, 20, 20),    # pixel-major or from tiles
                 (2, 16, 12, 12, 32, 16)], # two filters per channel
    },
}
WINDOW = Window(3, 1, 1)


def _arrays(rng, n, c, h, w, f, groups, layout, dtype, window=WINDOW):
    """x, weight, bias and a residual of the output's shape, in `layout`."""
    x, weight = to_layout(rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c // groups, *window.kernel)),
                          layout)
    ho, wo = window.output_size((h, w))
    residual = rng.standard_normal((n, f, ho, wo))
    residual = residual if layout == "NCHW" else residual.transpose(0, 2, 3, 1)
    return [np.ascontiguousarray(a, dtype=dtype) for a in (x, weight, rng.standard_normal(f), residual)]


def _check(case, layout, dtype, activation, position, specialize, algorithm, window=WINDOW, seed=()):
    """conv2d with the epilogue against the reference's, relative to the largest convolution output
    (an activation that squashes the values must not loosen the check). Returns the spec that ran."""
    n, c, h, w, f, groups = case
    rng = seeded_rng("epilogue", case, layout, dtype, activation, position, *seed)
    x, weight, bias, residual = _arrays(rng, n, c, h, w, f, groups, layout, dtype, window)
    kw = dict(stride=window.stride, padding=window.padding, groups=groups, layout=layout)
    given = [a.copy() for a in (x, weight, bias, residual)]
    residual = None if position == "none" else residual
    y = convgen.conv2d(x, weight, bias, activation=activation, residual=residual,
                       residual_position="before" if position == "none" else position, specialize=specialize,
                       algorithm=algorithm, **kw)
    expected = reference.conv2d(x, weight, bias, activation=activation, residual=residual,
                                residual_position="before" if position == "none" else position, **kw)
    scale = float(np.abs(reference.conv2d(x, weight, bias, **kw)).max())
    err = float(np.abs(y.astype(np.float64) - expected).max()) / scale
    assert err <= TOLERANCE[np.dtype(dtype).type], f"{case} {layout}: relative error {err:.3g}"
    for before, after in zip(given, (x, weight, bias, given[3] if residual is None else residual)):
        np.testing.assert_array_equal(before, after)  # the caller's arrays are untouched
    problem = conv_problem(x.shape, weight.shape, x.dtype, window.stride, window.padding, (1, 1), groups, layout)
    epilogue = as_epilogue(activation, residual is not None, "before" if position == "none" else position)
    return kernels_for(dataclasses.replace(problem, epilogue=epilogue), specialize, algorithm).spec


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["direct", "depthwise"])
@pytest.mark.parametrize("position", ["none", "before", "after"])
def test_generic_build_every_activation_in_every_family(family, layout, dtype, position):
    """The generic build reads the epilogue's kind at run time: every activation, every residual
    position, on every store site of its family (Winograd has no generic build)."""
    for activation, argument in ACTIVATION_ARGUMENTS.items():
        if activation == "none" and position == "none":
            continue
        for case in FAMILY_CASES[family][layout]:
            spec = _check(case, layout, dtype, argument, position, False, family)
            assert not spec.specialized and spec.family == family


@pytest.mark.parametrize("activation, position", EPILOGUE_ACTIVATIONS)
def test_specialized_build_of_every_activation(activation, position):
    """Each activation (and residual position) generated into a specialized module as straight-line
    code (the layouts taking turns); its spec's name says which."""
    layout = LAYOUTS[EPILOGUE_ACTIVATIONS.index((activation, position)) % 2]  # (taking turns)
    for case in FAMILY_CASES["direct"][layout][:2]:
        spec = _check(case, layout, "float32", ACTIVATION_ARGUMENTS[activation], position, True, "direct")
        assert spec.epilogue == Epilogue(activation, position).kind()
        assert f"_{spec.epilogue.text()}_" in spec.name


@pytest.mark.parametrize("family, layout, dtype, kind", EPILOGUE_FAMILY_KINDS)
def test_specialized_build_in_every_family(family, layout, dtype, kind):
    """Every store site of every family, specialized for the kind (three kinds: each site's residual
    before, after and absent), in both layouts and dtypes."""
    epilogue = Epilogue.parse(kind)
    for case in FAMILY_CASES[family][layout]:
        spec = _check(case, layout, dtype, ACTIVATION_ARGUMENTS[epilogue.activation], epilogue.residual, True, family)
        assert spec.family == family and spec.epilogue == epilogue


def test_depthwise_rows_streamed_past_the_caches(threads):
    """An NHWC depthwise output past depthwise_stream_bytes: each row is made in a buffer, its
    epilogue applied there (the residual read at the row's place in y), then streamed to y."""
    with convgen.configure(depthwise_stream_bytes=1 << 12, depthwise_pixel_major_bytes=0):  # (block-major)
        for count in (1, 2):
            threads(count)
            _check((1, 40, 20, 23, 40, 40), "NHWC", "float32", "relu", "before", True, "depthwise")
            _check((1, 40, 20, 23, 40, 40), "NHWC", "float32", "relu", "before", False, "depthwise")


@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
def test_nan_and_inf_propagate_as_pytorch(specialize):
    """NaN stays NaN through every activation (relu, clamp and leaky_relu included: PyTorch's do
    not turn it into a bound), inf goes where PyTorch's functions send it. The reference, which
    test_reference_activations_are_pytorchs checks against PyTorch, is the oracle."""
    rng = seeded_rng("epilogue-nan")
    x, weight, bias, residual = _arrays(rng, 1, 8, 6, 6, 16, 1, "NCHW", "float32")
    residual[0, :, 0, 0] = np.nan
    residual[0, :, 1, 1] = np.inf
    residual[0, :, 2, 2] = -np.inf
    for activation, argument in ACTIVATION_ARGUMENTS.items():
        for position in ("before", "after"):
            y = convgen.conv2d(x, weight, bias, padding=1, activation=argument, residual=residual,
                               residual_position=position, specialize=specialize, algorithm="direct")
            with np.errstate(invalid="ignore"):
                expected = reference.conv2d(x, weight, bias, padding=1, activation=argument, residual=residual,
                                            residual_position=position)
            for at in ((0, 0), (1, 1), (2, 2)):
                np.testing.assert_array_equal(y[0, :, at[0], at[1]], expected[0, :, at[0], at[1]].astype(np.float32),
                                              err_msg=f"{activation} {position} at {at}")


def test_reference_activations_are_pytorchs():
    """The oracle's activations against PyTorch's functions, on ordinary values, NaN and ±inf."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    v = np.array([np.nan, np.inf, -np.inf, -7.5, -3.0, -1.0, -0.25, 0.0, 0.5, 2.0, 3.0, 6.5, 40.0, -40.0])
    t = torch.from_numpy(v)
    expected = {"relu": F.relu(t), "clamp": F.hardtanh(t, -0.5, 1.25), "leaky_relu": F.leaky_relu(t, 0.2),
                "silu": F.silu(t), "hardswish": F.hardswish(t), "gelu": F.gelu(t),
                "gelu_tanh": F.gelu(t, approximate="tanh"), "sigmoid": torch.sigmoid(t), "none": t}
    for activation, argument in ACTIVATION_ARGUMENTS.items():
        np.testing.assert_allclose(reference.epilogue(v, argument), expected[activation].numpy(), rtol=1e-12,
                                   atol=1e-15, err_msg=activation)
    np.testing.assert_allclose(reference.epilogue(v, "relu6"), F.relu6(t).numpy())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_residual_may_be_the_output(layout):
    """out and residual one array (y += conv, in place, then the activation): the residual is read
    as it was, not as the kernels have overwritten it."""
    rng = seeded_rng("epilogue-alias", layout)
    x, weight, bias, residual = _arrays(rng, 2, 16, 7, 7, 16, 1, layout, "float64")
    expected = reference.conv2d(x, weight, bias, padding=1, layout=layout, activation="relu", residual=residual)
    out = residual.copy()
    y = convgen.conv2d(x, weight, bias, padding=1, layout=layout, activation="relu", residual=out, out=out)
    assert y is out
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-10 * np.abs(expected).max())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("algorithm", ["direct", "winograd"])
def test_scale_is_a_per_channel_affine(layout, algorithm):
    """scale (F,) multiplies each output channel's sum before the bias: a frozen BatchNorm."""
    rng = seeded_rng("epilogue-scale", layout)
    x, weight, bias, _ = _arrays(rng, 2, 16, 9, 9, 24, 1, layout, "float32")
    scale = rng.uniform(-3, 3, 24).astype(np.float32)
    y = convgen.conv2d(x, weight, bias, padding=1, layout=layout, scale=scale, activation="relu6", algorithm=algorithm)
    expected = reference.conv2d(x, weight, bias, padding=1, layout=layout, scale=scale, activation="relu6")
    plain = reference.conv2d(x, weight, bias, padding=1, layout=layout, scale=scale)
    assert float(np.abs(y - expected).max()) <= 1e-4 * float(np.abs(plain).max())


def test_empty_input_gives_the_epilogue_of_the_bias():
    """No input channels: every output is the bias alone, then the activation and the residual."""
    x = np.zeros((2, 0, 5, 5), np.float32)
    weight = np.zeros((4, 0, 3, 3), np.float32)
    bias = np.array([-1.0, 0.5, 2.0, 7.0], np.float32)
    residual = np.full((2, 4, 3, 3), 0.25, np.float32)
    y = convgen.conv2d(x, weight, bias, activation="relu6", residual=residual, residual_position="after")
    expected = reference.conv2d(x, weight, bias, activation="relu6", residual=residual, residual_position="after")
    np.testing.assert_allclose(y, expected)
    assert y[0, 0, 0, 0] == 0.25 and y[0, 3, 0, 0] == 6.25


def test_text_form_symbols_and_cache_keys():
    """The kind is in the spec's name and C symbols (read back by from_symbol), and a different
    kind is a different module; its numeric parameters are not (run-time arguments)."""
    for activation in ACTIVATIONS:
        for residual in ("none", "before", "after"):
            epilogue = Epilogue(activation, residual)
            assert Epilogue.parse(epilogue.text()) == epilogue
            spec = ConvSpec(Window(3, 1, 1), "float32", "NHWC", epilogue=epilogue)
            assert ConvSpec.from_symbol(spec.symbol("fwd")) == spec
            assert ConvSpec.parse(spec.short(), layout="NHWC") == spec
    assert ConvSpec.parse("k3s1p1_addrelu").name == "k3s1p1_addrelu_nchw_float32"
    assert ConvSpec.parse("k3s1p0_1x0_1_reluadd").window.padding == ((0, 1), (0, 1))
    assert ConvSpec.parse("k3s1p0_1x0_1").epilogue == Epilogue()
    assert (ConvSpec(WINDOW, epilogue=as_epilogue(("leaky_relu", 0.1)))
            == ConvSpec(WINDOW, epilogue=as_epilogue(("leaky_relu", 0.3))))
    assert ConvSpec(WINDOW, epilogue=as_epilogue("relu")) != ConvSpec(WINDOW)
    assert as_epilogue("relu6") == Epilogue("clamp", "none", 0.0, 6.0)
    assert as_epilogue(None, residual=True, residual_position="after") == Epilogue("none", "before")
    with pytest.raises(ValueError, match="generic build"):
        ConvSpec(None, epilogue=Epilogue("relu"))


@pytest.mark.parametrize("arguments, error, match", [
    (dict(activation="tanh"), ValueError, "activation must be one of"),
    (dict(activation=3), TypeError, "activation must be None"),
    (dict(activation=("leaky_relu", 0.1, 2.0)), ValueError, "takes 1 parameter"),
    (dict(activation=("relu", 1.0)), ValueError, "takes no parameters"),
    (dict(activation=("relu6", 1.0)), ValueError, "takes no parameters"),
    (dict(activation=("clamp", 2.0, 1.0)), ValueError, "min <= max"),
    (dict(activation=("clamp", float("nan"), 1.0)), ValueError, "NaN"),
    (dict(activation=("leaky_relu", "0.1")), TypeError, "real number"),
    (dict(activation="relu", residual_position="middle"), ValueError, "residual_position"),
    (dict(residual=np.zeros((1, 4, 4, 4), np.float32)), ValueError, "residual must have the output's shape"),
    (dict(residual=np.zeros((1, 4, 3, 3, 1), np.float32)), ValueError, "residual"),
    (dict(residual="no"), TypeError, "residual"),
    (dict(scale=np.ones(3, np.float32)), ValueError, r"scale must have shape \(4,\)"),
])
def test_bad_arguments_are_refused_by_name(arguments, error, match):
    x, weight = np.ones((1, 2, 5, 5), np.float32), np.ones((4, 2, 3, 3), np.float32)
    with pytest.raises(error, match=match):
        convgen.conv2d(x, weight, **arguments)


def test_other_ops_take_no_epilogue():
    from convgen.frontend import ops
    x, weight = np.ones((1, 2, 5, 5), np.float32), np.ones((2, 4, 3, 3), np.float32)
    with pytest.raises(ValueError, match="only conv2d's forward pass"):
        ops._prepare("conv_transpose2d", (x, weight, None), True, "auto", 1, 0, 1, 1, "NCHW",
                     epilogue=Epilogue("relu"))
    with pytest.raises(TypeError):
        convgen.conv_transpose2d(x, weight, activation="relu")


@pytest.mark.parametrize("layout", ["NCL", "NLC"])
def test_conv1d_takes_the_epilogue(layout):
    rng = seeded_rng("epilogue-1d", layout)
    x, w = rng.standard_normal((2, 8, 30)), rng.standard_normal((12, 8, 5))
    bias, scale = rng.standard_normal(12), rng.uniform(0.5, 2, 12)
    y_shape = (2, 12, 30)
    residual = rng.standard_normal(y_shape)
    expected = reference.conv2d(x[:, :, None], w[:, :, None], bias, padding=(0, 2), scale=scale,
                                activation=("leaky_relu", 0.3), residual=residual[:, :, None])[:, :, 0]
    if layout == "NLC":
        x, w, residual, expected = x.transpose(0, 2, 1), w.transpose(2, 1, 0), residual.transpose(0, 2, 1), \
            expected.transpose(0, 2, 1)
    x, w, residual = (np.ascontiguousarray(a) for a in (x, w, residual))
    y = convgen.conv1d(x, w, bias, padding=2, layout=layout, scale=scale, activation=("leaky_relu", 0.3),
                       residual=residual)
    np.testing.assert_allclose(y, expected, rtol=1e-10, atol=1e-10)
    # unbatched: the residual without its batch axis too
    y0 = convgen.conv1d(x[0], w, bias, padding=2, layout=layout, scale=scale, activation=("leaky_relu", 0.3),
                        residual=residual[0])
    np.testing.assert_allclose(y0, expected[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="residual must be unbatched like x"):
        convgen.conv1d(x[0], w, bias, padding=2, layout=layout, activation="relu", residual=residual)


@pytest.mark.parametrize("layout", ["NCDHW", "NDHWC"])
def test_conv3d_takes_the_epilogue(layout):
    """The depth taps fold into the channels: the residual is taken as the output's depth slices."""
    rng = seeded_rng("epilogue-3d", layout)
    x, w = rng.standard_normal((2, 4, 5, 6, 7)), rng.standard_normal((6, 4, 3, 3, 3))
    bias, residual = rng.standard_normal(6), rng.standard_normal((2, 6, 5, 6, 7))
    last = layout == "NDHWC"
    if last:
        x, w, residual = x.transpose(0, 2, 3, 4, 1), w.transpose(2, 3, 4, 1, 0), residual.transpose(0, 2, 3, 4, 1)
    x, w, residual = (np.ascontiguousarray(a) for a in (x, w, residual))
    y = convgen.conv3d(x, w, bias, padding=1, layout=layout, activation="silu", residual=residual,
                       residual_position="after")
    plain = reference.conv3d(x, w, bias, padding=1, layout=layout)
    expected = reference.epilogue(plain, "silu") + residual
    np.testing.assert_allclose(y, expected, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        convgen.conv3d(x, w, bias, padding=1, layout=layout, activation="relu", residual=residual[:, :4])


def test_prepared_conv2d_takes_the_epilogue():
    """prepare_conv2d fixes the epilogue when it is made: the scale folded into the laid-out weights
    (again after update), a residual passed by every call when made with residual=True."""
    rng = seeded_rng("epilogue-prepared")
    x, weight, bias, residual = _arrays(rng, 2, 16, 9, 9, 24, 1, "NHWC", "float32")
    scale = rng.uniform(-2, 2, 24).astype(np.float32)
    kw = dict(padding=1, layout="NHWC", scale=scale, activation="relu6")
    conv = convgen.prepare_conv2d(weight, bias, input_shape=x.shape, residual=True, **kw)
    np.testing.assert_array_equal(conv(x, residual=residual), convgen.conv2d(x, weight, bias, residual=residual, **kw))
    conv.update(2 * weight)
    np.testing.assert_array_equal(conv(x, residual=residual),
                                  convgen.conv2d(x, 2 * weight, bias, residual=residual, **kw))
    with pytest.raises(ValueError, match="residual must be given"):
        conv(x)
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        conv(x, residual=residual[:1])
    plain = convgen.prepare_conv2d(weight, bias, input_shape=x.shape, **kw)
    with pytest.raises(ValueError, match="residual must be None"):
        plain(x, residual=residual)
    with pytest.raises(ValueError, match=r"scale must have shape \(24,\)"):
        convgen.prepare_conv2d(weight, bias, input_shape=x.shape, padding=1, layout="NHWC", scale=scale[:3])
