"""The training layers convgen.Conv2d and convgen.ConvTranspose2d: shapes, initialization, both
passes against the functional ops and the reference, a few SGD steps, argument checks."""

import numpy as np
import pytest

import convgen
from convgen import reference
from grid import DTYPES, LAYOUTS
from helpers import assert_close

VARIANTS = pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])

# Layer settings whose windows are in tests/grid.py, with an input size (H, W) each.
CONV_LAYERS = [
    (dict(in_channels=6, out_channels=8, kernel_size=3, stride=2, padding=1, groups=2), (9, 10)),
    (dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, dilation=2, groups=4), (8, 7)),
    (dict(in_channels=3, out_channels=5, kernel_size=3, padding="same"), (6, 6)),
]
TRANSPOSE_LAYERS = [
    (dict(in_channels=4, out_channels=6, kernel_size=4, stride=2, padding=1, groups=2), (5, 4)),
    (dict(in_channels=3, out_channels=3, kernel_size=3, stride=2, output_padding=1), (4, 5)),
    (dict(in_channels=2, out_channels=4, kernel_size=4, stride=2, padding="same"), (5, 5)),
]


def _input(rng, n, channels, hw, layout, dtype):
    shape = (n, channels, *hw) if layout == "NCHW" else (n, *hw, channels)
    return rng.standard_normal(shape).astype(dtype)


def _kwargs(layer):
    kw = dict(stride=layer.stride, padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
              layout=layer.layout)
    if isinstance(layer, convgen.ConvTranspose2d):
        kw["output_padding"] = layer.output_padding
    else:
        kw["padding_mode"] = layer.padding_mode
    return kw


# ------------------------------------------------------------------------------- shapes and init
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_and_bias_shapes(layout):
    conv = convgen.Conv2d(6, 8, (3, 5), groups=2, layout=layout, rng=0)
    assert conv.weight.shape == ((8, 3, 3, 5) if layout == "NCHW" else (3, 5, 3, 8))
    assert conv.weight.dtype == np.float32 and conv.bias.dtype == np.float32
    assert conv.bias.shape == (8,) and not conv.bias.any()
    transposed = convgen.ConvTranspose2d(6, 8, (3, 5), groups=2, layout=layout, dtype=np.float64, bias=False, rng=0)
    assert transposed.weight.shape == ((6, 4, 3, 5) if layout == "NCHW" else (3, 5, 4, 6))
    assert transposed.weight.dtype == np.float64 and transposed.bias is None
    assert len(conv.parameters()) == 2 and len(transposed.parameters()) == 1
    assert conv.parameters()[0] is conv.weight and conv.parameters()[1] is conv.bias


@pytest.mark.parametrize("layer, fan_in", [
    (convgen.Conv2d(32, 64, 3, rng=1), 32 * 9),
    (convgen.Conv2d(32, 64, (3, 5), groups=4, layout="NHWC", rng=2), 8 * 15),
    # each output of a stride-2 transposed conv sums in_channels · KH·KW / 4 products on average
    (convgen.ConvTranspose2d(32, 16, 4, stride=2, rng=3), 32 * 16 / 4),
    (convgen.ConvTranspose2d(16, 32, 3, rng=4), 16 * 9),
])
def test_he_initialization(layer, fan_in):
    """Weights ~ N(0, 2 / fan_in): sample std within 5% and mean within 4 standard errors of 0."""
    expected_std = np.sqrt(2.0 / fan_in)
    w = layer.weight.astype(np.float64)
    assert abs(w.std() / expected_std - 1) < 0.05
    assert abs(w.mean()) < 4 * expected_std / np.sqrt(w.size)


def test_rng_makes_initialization_reproducible():
    a, b, c = (convgen.Conv2d(3, 4, 3, rng=seed) for seed in (7, 7, 8))
    np.testing.assert_array_equal(a.weight, b.weight)
    assert not np.array_equal(a.weight, c.weight)
    generator = np.random.default_rng(7)
    np.testing.assert_array_equal(convgen.Conv2d(3, 4, 3, rng=generator).weight, a.weight)


# ------------------------------------------------------------------------------------ the passes
def _check_passes(layer, hw, specialize, dtype, transposed):
    rng = np.random.default_rng(11)
    layer.bias[...] = rng.standard_normal(layer.bias.shape)  # a non-zero bias exercises its path
    x = _input(rng, 2, layer.in_channels, hw, layer.layout, dtype)
    op, op_backward, ref, ref_backward = (
        (convgen.conv_transpose2d, convgen.conv_transpose2d_backward, reference.conv_transpose2d,
         reference.conv_transpose2d_backward) if transposed else
        (convgen.conv2d, convgen.conv2d_backward, reference.conv2d, reference.conv2d_backward))
    kw = _kwargs(layer)

    y = layer(x)
    np.testing.assert_array_equal(y, op(x, layer.weight, layer.bias, specialize=specialize, **kw))
    assert_close(y, ref(x, layer.weight, layer.bias, **kw), dtype, "y")

    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = layer.backward(dy)
    ex, ew, eb = op_backward(dy, x, layer.weight, specialize=specialize, **kw)
    np.testing.assert_array_equal(dx, ex)
    np.testing.assert_array_equal(layer.dw, ew)
    np.testing.assert_array_equal(layer.db, eb)
    rx, rw, rb = ref_backward(dy, x, layer.weight, **kw)
    assert_close(dx, rx, dtype, "dx")
    assert_close(layer.dw, rw, dtype, "dw")
    assert_close(layer.db, rb, dtype, "db")
    assert layer.gradients()[0] is layer.dw and layer.gradients()[1] is layer.db


@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("settings, hw", CONV_LAYERS, ids=["s2-g2", "d2-depthwise", "same"])
def test_conv2d_layer_passes(settings, hw, layout, dtype, specialize):
    layer = convgen.Conv2d(**settings, dtype=dtype, layout=layout, specialize=specialize, rng=5)
    _check_passes(layer, hw, specialize, dtype, transposed=False)


@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("settings, hw", TRANSPOSE_LAYERS, ids=["s2-g2", "op1", "same"])
def test_conv_transpose2d_layer_passes(settings, hw, layout, dtype, specialize):
    layer = convgen.ConvTranspose2d(**settings, dtype=dtype, layout=layout, specialize=specialize, rng=5)
    _check_passes(layer, hw, specialize, dtype, transposed=True)


# One layer per padding mode, with windows of tests/grid.py's PADDING_MODE_CASES.
MODE_LAYERS = [
    (dict(in_channels=3, out_channels=4, kernel_size=3, padding=1, padding_mode="reflect"), (6, 7)),
    (dict(in_channels=3, out_channels=4, kernel_size=(4, 3), stride=(1, 2), padding="same",
          padding_mode="replicate"), (7, 6)),
    (dict(in_channels=4, out_channels=2, kernel_size=(5, 3), stride=2, padding=(2, 1), groups=2,
          padding_mode="circular"), (8, 5)),
]


@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("settings, hw", MODE_LAYERS, ids=["reflect", "replicate", "circular"])
def test_conv2d_layer_padding_modes(settings, hw, layout, specialize):
    layer = convgen.Conv2d(**settings, dtype=np.float64, layout=layout, specialize=specialize, rng=5)
    assert layer.padding_mode == settings["padding_mode"]
    _check_passes(layer, hw, specialize, np.float64, transposed=False)


# torch refuses padding="same" with a stride: its replicate layer is another of the grid's windows.
TORCH_MODE_LAYERS = [MODE_LAYERS[0], MODE_LAYERS[2], (dict(
    in_channels=3, out_channels=3, kernel_size=3, stride=3, padding=(6, 4), dilation=2, groups=3,
    padding_mode="replicate"), (5, 6))]


@pytest.mark.parametrize("settings, hw", TORCH_MODE_LAYERS, ids=["reflect", "circular", "replicate"])
def test_conv2d_layer_padding_modes_match_torch(settings, hw):
    """The same positional call as torch.nn.Conv2d, padding_mode last: the same outputs and gradients."""
    torch = pytest.importorskip("torch")
    args = [settings.get(name, default) for name, default in (
        ("in_channels", None), ("out_channels", None), ("kernel_size", None), ("stride", 1), ("padding", 0),
        ("dilation", 1), ("groups", 1), ("bias", True), ("padding_mode", "zeros"))]
    theirs = torch.nn.Conv2d(*args).double()
    ours = convgen.Conv2d(*args, dtype=np.float64)
    ours.weight[...] = theirs.weight.detach().numpy()
    ours.bias[...] = theirs.bias.detach().numpy()
    rng = np.random.default_rng(3)
    x = _input(rng, 2, ours.in_channels, hw, "NCHW", np.float64)
    tx = torch.tensor(x, requires_grad=True)
    ty = theirs(tx)
    dy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(ours(x), ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours.backward(dy), tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours.dw, theirs.weight.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours.db, theirs.bias.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_padding_mode_sizes_are_checked_on_each_input():
    layer = convgen.Conv2d(2, 2, 3, padding=2, padding_mode="reflect")
    assert layer(np.zeros((1, 2, 3, 3), np.float32)).shape == (1, 2, 5, 5)
    with pytest.raises(ValueError, match="padding_mode='reflect' needs padding smaller than the input"):
        layer(np.zeros((1, 2, 2, 3), np.float32))


def test_output_sizes():
    x = np.zeros((1, 4, 5, 5), np.float32)
    assert convgen.ConvTranspose2d(4, 2, 4, stride=2, padding=1)(x).shape == (1, 2, 10, 10)
    assert convgen.ConvTranspose2d(4, 2, 4, stride=2, padding="same")(x).shape == (1, 2, 10, 10)
    assert convgen.Conv2d(4, 2, 3, stride=2, padding=1, layout="NHWC")(np.zeros((1, 5, 5, 4), np.float32)).shape \
        == (1, 3, 3, 2)


def test_without_bias():
    layer = convgen.Conv2d(3, 4, 3, padding=1, bias=False, dtype=np.float64, rng=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6))
    y = layer(x)
    np.testing.assert_array_equal(y, convgen.conv2d(x, layer.weight, padding=1))
    layer.backward(np.ones_like(y))
    assert layer.db is None and layer.gradients() == [layer.dw]


@pytest.mark.parametrize("make, hw", [
    (lambda: convgen.Conv2d(3, 4, 3, padding=1, dtype=np.float64, rng=0), (6, 6)),
    (lambda: convgen.ConvTranspose2d(3, 4, 4, stride=2, padding=1, dtype=np.float64, layout="NHWC", rng=0), (4, 4)),
], ids=["Conv2d", "ConvTranspose2d-NHWC"])
def test_sgd_steps_reduce_a_regression_loss(make, hw):
    """Fitting a layer to a teacher of the same shape: 50 SGD steps (step size 1) cut the squared error 10-fold."""
    rng = np.random.default_rng(3)
    student, teacher = make(), make()
    teacher.weight[...] = rng.standard_normal(teacher.weight.shape) * 0.5
    teacher.bias[...] = rng.standard_normal(teacher.bias.shape)
    x = _input(rng, 8, student.in_channels, hw, student.layout, np.float64)
    target = teacher(x)

    def step():
        diff = student(x) - target
        loss = 0.5 * float(np.mean(diff ** 2))
        student.backward(diff / diff.size)
        for p, g in zip(student.parameters(), student.gradients()):
            p -= 1.0 * g
        return loss

    losses = [step() for _ in range(50)]
    assert losses[-1] < 0.1 * losses[0], f"loss went from {losses[0]:.4g} to {losses[-1]:.4g}"
    assert all(b <= a for a, b in zip(losses, losses[1:])), "plain SGD on a convex loss with a small step must not rise"


# ------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, error, name", [
    (dict(in_channels=0), ValueError, "in_channels"),
    (dict(in_channels=2.0), TypeError, "in_channels"),
    (dict(out_channels=True), TypeError, "out_channels"),
    (dict(kernel_size=(3, 0)), ValueError, "kernel_size"),
    (dict(kernel_size=(3, 3, 3)), ValueError, "kernel_size"),
    (dict(stride=0), ValueError, "stride"),
    (dict(padding=-1), ValueError, "padding"),
    (dict(padding="full"), ValueError, "padding"),
    (dict(dilation="2"), TypeError, "dilation"),
    (dict(groups=4), ValueError, "groups"),
    (dict(groups=0), ValueError, "groups"),
    (dict(bias=1), TypeError, "bias"),
    (dict(dtype=np.int32), TypeError, "dtype"),
    (dict(dtype="float16"), TypeError, "dtype"),
    (dict(dtype="banana"), TypeError, "dtype"),
    (dict(dtype=None), TypeError, "dtype"),
    (dict(padding_mode="mirror"), ValueError, "padding_mode"),
    (dict(layout="NWHC"), ValueError, "layout"),
    (dict(specialize="yes"), TypeError, "specialize"),
    (dict(rng="seed"), TypeError, "rng"),
])
@pytest.mark.parametrize("cls", [convgen.Conv2d, convgen.ConvTranspose2d])
def test_bad_arguments_are_named(cls, kwargs, error, name):
    args = dict(in_channels=6, out_channels=4, kernel_size=3)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        cls(**args)


@pytest.mark.parametrize("cls", ["Conv2d", "ConvTranspose2d"])
def test_positional_arguments_are_torchs(cls):
    """The same positional call means the same layer in convgen and in torch, and everything after
    torch's positional arguments is keyword-only."""
    torch = pytest.importorskip("torch")
    import inspect

    def positional(function):
        return [p.name for p in inspect.signature(function).parameters.values()
                if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name != "self"]

    ours = positional(getattr(convgen, cls).__init__)
    theirs = positional(getattr(torch.nn, cls).__init__)
    # torch's factory arguments (device, dtype) close its list; convgen's dtype is keyword-only.
    assert ours == theirs[:theirs.index("device")]


def test_transposed_positional_call_matches_torch():
    """ConvTranspose2d(2, 4, (2, 3), 1, 0, 0, 2): the 7th positional argument is groups, as in torch."""
    torch = pytest.importorskip("torch")
    theirs = torch.nn.ConvTranspose2d(2, 4, (2, 3), 1, 0, 0, 2, True, 1).double()
    ours = convgen.ConvTranspose2d(2, 4, (2, 3), 1, 0, 0, 2, True, 1, dtype=np.float64)
    assert ours.groups == 2 and ours.dilation == (1, 1)
    ours.weight[...] = theirs.weight.detach().numpy()
    ours.bias[...] = theirs.bias.detach().numpy()
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 5))
    expected = theirs(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(ours(x), expected, rtol=1e-12, atol=1e-12)


def test_keyword_only_after_torchs_arguments():
    with pytest.raises(TypeError):
        convgen.Conv2d(2, 3, 3, 1, 0, 1, 1, True, "zeros", np.float64)
    with pytest.raises(TypeError):
        convgen.ConvTranspose2d(2, 3, 3, 1, 0, 0, 1, True, 1, "zeros", np.float64)


def test_torch_dtypes_are_read():
    torch = pytest.importorskip("torch")
    assert convgen.Conv2d(2, 3, 3, dtype=torch.float64).dtype == np.float64
    with pytest.raises(TypeError, match="dtype"):
        convgen.Conv2d(2, 3, 3, dtype=torch.float16)


def test_transposed_padding_mode_is_zeros_only():
    with pytest.raises(ValueError, match="padding_mode must be 'zeros'"):
        convgen.ConvTranspose2d(2, 2, 3, padding_mode="reflect")


@pytest.mark.parametrize("kwargs", [
    dict(stride=2, output_padding=2),
    dict(stride=1, dilation=2, output_padding=(0, 2)),
    dict(stride=2, padding="same", output_padding=1),
    dict(output_padding=-1),
])
def test_bad_output_padding(kwargs):
    with pytest.raises(ValueError, match="output_padding"):
        convgen.ConvTranspose2d(2, 2, 3, **kwargs)


def test_output_padding_up_to_the_dilation():
    layer = convgen.ConvTranspose2d(2, 2, 3, dilation=3, stride=2, padding=2, output_padding=2)
    assert layer.output_padding == (2, 2)


def test_bad_inputs_and_call_order():
    layer = convgen.Conv2d(3, 4, 3, padding=1)
    with pytest.raises(RuntimeError, match="forward"):
        layer.backward(np.zeros((1, 4, 5, 5), np.float32))
    with pytest.raises(RuntimeError, match="backward"):
        layer.gradients()
    with pytest.raises(ValueError, match="in_channels=3"):
        layer(np.zeros((1, 5, 6, 6), np.float32))
    with pytest.raises(TypeError, match="float32"):
        layer(np.zeros((1, 3, 6, 6), np.float64))
    with pytest.raises(ValueError, match="4-D NCHW batch or one unbatched 3-D CHW image"):
        layer(np.zeros((6, 6), np.float32))
    with pytest.raises(TypeError, match="NumPy array"):
        layer([[[[0.0]]]])


def test_repr():
    assert repr(convgen.Conv2d(3, 8, 3, stride=2, padding="same", bias=False)) == (
        "Conv2d(3, 8, kernel_size=3, stride=2, padding='same', bias=False, dtype=float32, layout='NCHW', "
        "specialize=True)")
    assert repr(convgen.ConvTranspose2d(4, 6, (4, 3), stride=2, padding=((1, 0), (1, 1)), output_padding=1,
                                        groups=2, dtype=np.float64, layout="nhwc", specialize=False)) == (
        "ConvTranspose2d(4, 6, kernel_size=(4, 3), stride=2, padding=((1, 0), (1, 1)), output_padding=1, "
        "groups=2, dtype=float64, layout='NHWC', specialize=False)")
    assert repr(convgen.Conv2d(2, 2, 3, padding=(1, 2), dilation=(1, 2))) == (
        "Conv2d(2, 2, kernel_size=3, padding=(1, 2), dilation=(1, 2), dtype=float32, layout='NCHW', specialize=True)")
    assert repr(convgen.Conv2d(2, 2, 3, 1, 1, padding_mode="circular")) == (
        "Conv2d(2, 2, kernel_size=3, padding=1, padding_mode='circular', dtype=float32, layout='NCHW', "
        "specialize=True)")
