"""The layers Conv1d, Conv3d, ConvTranspose1d and ConvTranspose3d: torch's positional order, weight
shapes per layout, both passes against torch's modules, unbatched input (every layer), repr, refusals."""

import numpy as np
import pytest

import convgen
from helpers import relative_error

torch = pytest.importorskip("torch")

# (class name, positional arguments as torch takes them, x shape channels-first)
CASES = [
    ("Conv1d", (4, 6, 3, 2, 1, 2, 2, True, "zeros"), (2, 4, 11)),              # ..., dilation 2, groups 2
    ("Conv1d", (4, 6, 4, 1, (2,), 1, 1, True, "reflect"), (1, 4, 9)),
    ("Conv3d", (4, 6, (3, 2, 3), 1, (1, 1, 2), 1, 2, False, "circular"), (2, 4, 4, 5, 5)),
    ("ConvTranspose1d", (4, 6, 3, 2, 1, 1, 2, False, 2, "zeros"), (2, 4, 5)),  # ..., op 1, groups 2, dilation 2
    ("Conv3d", (4, 6, (3, 2, 3), (1, 2, 1), (1, 0, 1), 1, 2), (2, 4, 4, 5, 5)),
    ("ConvTranspose3d", (4, 6, (3, 2, 3), (2, 1, 1), 1, (1, 0, 0), 2, True, (1, 2, 1)), (2, 4, 3, 4, 3)),
]


def _channels_last(a, weight=False):
    r = a.ndim - 2
    return np.ascontiguousarray(a.transpose(*range(2, r + 2), 1, 0) if weight else a.transpose(0, *range(2, r + 2), 1))


@pytest.mark.parametrize("channels_last", [False, True], ids=["channels-first", "channels-last"])
@pytest.mark.parametrize("name, args, x_shape", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_same_positional_call_same_layer_as_torch(name, args, x_shape, channels_last):
    theirs = getattr(torch.nn, name)(*args).double()
    layout = {3: ("NCL", "NLC"), 5: ("NCDHW", "NDHWC")}[len(x_shape)][channels_last]
    ours = getattr(convgen, name)(*args, dtype=np.float64, layout=layout, rng=0)
    weight = theirs.weight.detach().numpy()
    assert ours.weight.shape == (_channels_last(weight, True) if channels_last else weight).shape
    w = ours.weight
    if channels_last:  # (*K, inner, outer) -> (outer, inner, *K)
        r = w.ndim - 2
        w = w.transpose(r + 1, r, *range(r))
    with torch.no_grad():  # the same parameters in both
        theirs.weight.copy_(torch.tensor(np.ascontiguousarray(w)))
        if ours.bias is not None:
            ours.bias[...] = np.arange(ours.out_channels) / 7.0
            theirs.bias.copy_(torch.tensor(ours.bias))
    x = np.random.default_rng(0).standard_normal(x_shape)
    tx = torch.tensor(x, requires_grad=True)
    ty = theirs(tx)
    dy = np.random.default_rng(1).standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    xl, dyl = (_channels_last(x), _channels_last(dy)) if channels_last else (x, dy)
    y = ours(xl)
    dx = ours.backward(dyl)
    if channels_last:
        y, dx = _channels_last_back(y), _channels_last_back(dx)
    assert relative_error(y, ty.detach().numpy()) < 1e-12
    assert relative_error(dx, tx.grad.numpy()) < 1e-12
    dw = ours.dw if not channels_last else ours.dw.transpose(ours.dw.ndim - 1, ours.dw.ndim - 2,
                                                            *range(ours.dw.ndim - 2))
    assert relative_error(dw, theirs.weight.grad.numpy()) < 1e-12
    if ours.bias is not None:
        assert relative_error(ours.db, theirs.bias.grad.numpy()) < 1e-12


def _channels_last_back(a):
    r = a.ndim - 2
    return a.transpose(0, r + 1, *range(1, r + 1))


@pytest.mark.parametrize("name, args, x_shape", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_unbatched_input(name, args, x_shape):
    layer = getattr(convgen, name)(*args, dtype=np.float64, rng=0)
    x = np.random.default_rng(2).standard_normal(x_shape)
    y = layer(x[:1])
    dy = np.ones_like(y)
    dx = layer.backward(dy)
    dw = layer.dw.copy()
    y1 = layer(x[0])
    assert y1.shape == y.shape[1:]
    np.testing.assert_array_equal(y1, y[0])
    dx1 = layer.backward(dy[0])
    np.testing.assert_array_equal(dx1, dx[0])
    np.testing.assert_array_equal(layer.dw, dw)


def test_2d_layers_take_unbatched_input():
    for layer, x in ((convgen.Conv2d(3, 4, 3, padding=1, rng=0), np.ones((3, 6, 5), np.float32)),
                     (convgen.ConvTranspose2d(3, 4, 3, 2, layout="NHWC", rng=0), np.ones((6, 5, 3), np.float32))):
        batched = layer(x[None])[0]
        y = layer(x)
        np.testing.assert_array_equal(y, batched)
        assert layer.backward(np.ones_like(y)).shape == x.shape


def test_weights_and_initialization():
    conv = convgen.Conv3d(8, 16, (3, 1, 5), groups=4, layout="NDHWC", rng=0)
    assert conv.weight.shape == (3, 1, 5, 2, 16) and conv.bias.shape == (16,)
    assert 0.5 < conv.weight.std() / np.sqrt(2 / (2 * 15)) < 1.5
    transposed = convgen.ConvTranspose1d(8, 6, 4, 2, groups=2, rng=0)
    assert transposed.weight.shape == (8, 3, 4)
    assert 0.5 < transposed.weight.std() / np.sqrt(2 / (4 * 4 / 2)) < 1.5
    assert convgen.Conv1d(2, 3, 5, layout="NLC", bias=False, rng=0).weight.shape == (5, 2, 3)


def test_repr():
    assert repr(convgen.Conv1d(3, 8, 9, padding=4, bias=False)) == (
        "Conv1d(3, 8, kernel_size=9, padding=4, bias=False, dtype=float32, layout='NCL', specialize=True)")
    assert repr(convgen.ConvTranspose3d(4, 6, (4, 3, 3), (2, 1, 1), ((1, 0), 1, 1), (1, 0, 0))) == (
        "ConvTranspose3d(4, 6, kernel_size=(4, 3, 3), stride=(2, 1, 1), padding=((1, 0), (1, 1), (1, 1)), "
        "output_padding=(1, 0, 0), dtype=float32, layout='NCDHW', specialize=True)")


@pytest.mark.parametrize("make, exc, match", [
    (lambda: convgen.Conv1d(2, 2, 3, layout="NCHW"), ValueError, "layout must be 'NCL' or 'NLC'"),
    (lambda: convgen.Conv3d(2, 2, (3, 3)), ValueError, "kernel_size must be an int or a sequence of 3 ints"),
    (lambda: convgen.Conv3d(2, 2, 3, stride=(1, 0, 1)), ValueError, r"stride\[1\] must be >= 1"),
    (lambda: convgen.Conv1d(2, 2, 3, padding=(1, 2)), ValueError, r"\(\(before, after\),\)"),
    (lambda: convgen.ConvTranspose3d(2, 2, 3, padding_mode="reflect"), ValueError, "padding_mode must be 'zeros'"),
    (lambda: convgen.ConvTranspose1d(2, 2, 3, 2, 0, 2), ValueError, "output_padding along l must be smaller"),
    (lambda: convgen.Conv1d(2, 2, 3, dtype="float16"), TypeError, "dtype must be float32 or float64"),
    (lambda: convgen.Conv3d(4, 6, 3, groups=4), ValueError, "groups=4 must divide"),
])
def test_bad_hyperparameters_are_refused(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_input_is_refused():
    layer = convgen.Conv3d(3, 4, 3)
    with pytest.raises(ValueError, match="5-D NCDHW batch or one unbatched 4-D CDHW image"):
        layer(np.zeros((3, 4, 4), np.float32))
    with pytest.raises(ValueError, match="in_channels=3"):
        layer(np.zeros((2, 4, 4, 4), np.float32))
