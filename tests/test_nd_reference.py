"""The 1-D and 3-D reference (convgen.reference) against PyTorch, numerical gradients and adjoint identities.

The reference is the oracle of the fast 1-D and 3-D ops (tests/test_nd_ops.py), so it is checked here
on its own: its forward results and gradients against torch's conv1d / conv3d (a padding mode as torch's
modules apply it: F.pad, then an unpadded convolution) and conv_transpose1d / conv_transpose3d, its
backward ops against central differences of its forward ops, and each transposed op as the adjoint of
its convolution, padding modes included (that is what a transposed convolution with a padding mode is).
"""

import numpy as np
import pytest

from convgen import reference
from helpers import relative_error, seeded_rng

torch = pytest.importorskip("torch")
F = torch.nn.functional

MODES = ("zeros", "reflect", "replicate", "circular")

# (name, rank, x shape (channels-first), F, kernel, keywords): small, every padding form.
CONV_CASES = [
    ("1d-k3-s2-p2-g2", 1, (2, 4, 9), 6, (3,), dict(stride=2, padding=2, groups=2)),
    ("1d-k4-d2-sides", 1, (2, 3, 11), 2, (4,), dict(padding=((1, 3),), dilation=(2,))),
    ("1d-same-k3-d2", 1, (1, 2, 7), 3, (3,), dict(padding="same", dilation=2)),
    ("1d-valid-s3", 1, (2, 2, 10), 2, (2,), dict(stride=(3,), padding="valid")),
    ("3d-k3-p1", 3, (2, 3, 4, 5, 4), 2, (3, 3, 3), dict(padding=1)),
    ("3d-rect-s-d-g2", 3, (2, 4, 5, 4, 6), 4, (2, 3, 2), dict(stride=(1, 2, 1), padding=(1, (1, 0), 1),
                                                                  dilation=(2, 1, 2), groups=2)),
    ("3d-same-s2", 3, (1, 2, 5, 4, 3), 3, (3, 2, 3), dict(stride=2, padding="same")),
]

TRANSPOSE_CASES = [
    ("1d-k4-s2-p1", 1, (2, 3, 5), 2, (4,), dict(stride=2, padding=1)),
    ("1d-k3-s3-d2-op2-g2", 1, (1, 4, 4), 6, (3,), dict(stride=3, padding=(1,), dilation=2, groups=2,
                                                        output_padding=2)),
    ("1d-same-s2", 1, (2, 2, 5), 3, (3,), dict(stride=2, padding="same")),
    ("3d-k3-s1-p1", 3, (1, 3, 3, 4, 3), 2, (3, 3, 3), dict(padding=1)),
    ("3d-s-op-d-g2", 3, (2, 4, 3, 2, 3), 6, (3, 2, 3), dict(stride=(2, 1, 2), padding=(1, 0, 1),
                                                             output_padding=(1, 0, 1), dilation=(1, 2, 1), groups=2)),
]


def _cases(cases, same):
    """pytest parameters of the cases with (or without) padding='same', named."""
    return [pytest.param(*case, id=case[0]) for case in cases if ("same" in case[0]) == same]


def _torch_pad(rank, padding):
    """F.pad's list (last axis first) of the explicit pads the reference resolves `padding` to."""
    items = padding if isinstance(padding, (tuple, list)) else (padding,)
    items = items * (rank if len(items) == 1 else 1)
    pairs = [item if isinstance(item, (tuple, list)) else (item, item) for item in items]
    return [v for pair in reversed(pairs) for v in pair]


def _arrays(rng, x_shape, f, kernel, groups, transposed):
    c = x_shape[1]
    w_shape = ((c, f // groups) if transposed else (f, c // groups)) + tuple(kernel)
    return rng.standard_normal(x_shape), rng.standard_normal(w_shape), rng.standard_normal(f)


def _check(got, expected, what):
    for name, a, b in zip(("y", "dx", "dw", "db"), got, expected):
        assert a.shape == b.shape, f"{what} {name}: shape {a.shape} != {b.shape}"
        assert relative_error(a, b) < 1e-12, f"{what} {name}: relative error {relative_error(a, b):.2e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, rank, x_shape, f, kernel, kw", _cases(CONV_CASES, same=False))
def test_conv_matches_torch(name, rank, x_shape, f, kernel, kw, mode):
    rng = seeded_rng(name, mode)
    x, w, b = _arrays(rng, x_shape, f, kernel, kw.get("groups", 1), False)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    padding = kw.get("padding", 0)
    torch_kw = {k: v for k, v in kw.items() if k != "padding"}
    if padding == "valid":
        padding = 0
    padded = F.pad(tx, _torch_pad(rank, padding), mode="constant" if mode == "zeros" else mode)
    ty = (F.conv1d if rank == 1 else F.conv3d)(padded, tw, tb, **torch_kw)
    dy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    ops = (reference.conv1d, reference.conv1d_backward) if rank == 1 else (reference.conv3d, reference.conv3d_backward)
    y = ops[0](x, w, b, padding_mode=mode, **kw)
    grads = ops[1](dy, x, w, padding_mode=mode, **kw)
    _check((y, *grads), (ty.detach().numpy(), tx.grad.numpy(), tw.grad.numpy(), tb.grad.numpy()), name)


@pytest.mark.parametrize("name, rank, x_shape, f, kernel, kw", _cases(CONV_CASES, same=True))
def test_same_padding_matches_torch_at_stride_1_and_tensorflow_beyond(name, rank, x_shape, f, kernel, kw):
    """torch takes padding='same' at stride 1 only; at stride 2 the output is ceil(n / 2), TensorFlow's rule."""
    rng = seeded_rng(name)
    x, w, b = _arrays(rng, x_shape, f, kernel, 1, False)
    conv = reference.conv1d if rank == 1 else reference.conv3d
    y = conv(x, w, b, **kw)
    stride = kw.get("stride", 1)
    assert y.shape[2:] == tuple(-(-n // stride) for n in x_shape[2:])
    if stride == 1:
        expected = (F.conv1d if rank == 1 else F.conv3d)(torch.tensor(x), torch.tensor(w), torch.tensor(b),
                                                          **kw).numpy()
        assert relative_error(y, expected) < 1e-12


@pytest.mark.parametrize("name, rank, x_shape, f, kernel, kw", _cases(TRANSPOSE_CASES, same=False))
def test_conv_transpose_matches_torch(name, rank, x_shape, f, kernel, kw):
    rng = seeded_rng(name)
    x, w, b = _arrays(rng, x_shape, f, kernel, kw.get("groups", 1), True)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    ty = (F.conv_transpose1d if rank == 1 else F.conv_transpose3d)(tx, tw, tb, **kw)
    dy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    ops = ((reference.conv_transpose1d, reference.conv_transpose1d_backward) if rank == 1 else
           (reference.conv_transpose3d, reference.conv_transpose3d_backward))
    _check((ops[0](x, w, b, **kw), *ops[1](dy, x, w, **kw)),
           (ty.detach().numpy(), tx.grad.numpy(), tw.grad.numpy(), tb.grad.numpy()), name)


def test_transposed_same_gives_input_times_stride():
    rng = seeded_rng("transposed-same")
    for name, rank, x_shape, f, kernel, kw in TRANSPOSE_CASES:
        if "same" in name:
            x, w, b = _arrays(rng, x_shape, f, kernel, 1, True)
            y = (reference.conv_transpose1d if rank == 1 else reference.conv_transpose3d)(x, w, b, **kw)
            assert y.shape[2:] == tuple(n * kw["stride"] for n in x_shape[2:])


def _ops(rank, transposed):
    prefix = "conv_transpose" if transposed else "conv"
    return getattr(reference, f"{prefix}{rank}d"), getattr(reference, f"{prefix}{rank}d_backward")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("rank", [1, 3])
def test_backward_is_the_numerical_gradient(rank, transposed, mode):
    """dx, dw, db of sum(op(x, w, b) * dy) against central differences, channels-last layout."""
    rng = seeded_rng("numeric", rank, transposed, mode)
    layout = "NLC" if rank == 1 else "NDHWC"
    if rank == 1:
        x_shape, kernel, kw = (2, 5, 4), (3,), dict(stride=2, padding=((2, 1),), dilation=1, groups=2)
    else:
        x_shape, kernel, kw = (1, 3, 4, 5, 2), (2, 2, 3), dict(stride=(1, 2, 1), padding=(1, (0, 1), 2), groups=2)
    if transposed:
        kw["output_padding"] = 1 if rank == 1 else (0, 1, 0)
        if mode in ("reflect", "circular"):  # the border of a transposed op lies around its (longer) output
            kw["padding"] = 1
    c, f = x_shape[-1], 4
    w_shape = kernel + ((f // 2, c) if transposed else (c // 2, f))
    x, w, b = rng.standard_normal(x_shape), rng.standard_normal(w_shape), rng.standard_normal(f)
    forward, backward = _ops(rank, transposed)
    y = forward(x, w, b, layout=layout, padding_mode=mode, **kw)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = backward(dy, x, w, layout=layout, padding_mode=mode, **kw)

    def numeric(array):
        grad = np.zeros_like(array)
        for i in np.ndindex(array.shape):
            saved = array[i]
            losses = []
            for h in (1e-6, -1e-6):
                array[i] = saved + h
                losses.append(float(np.sum(forward(x, w, b, layout=layout, padding_mode=mode, **kw) * dy)))
            array[i] = saved
            grad[i] = (losses[0] - losses[1]) / 2e-6
        return grad

    for name, analytic, array in (("dx", dx, x), ("dw", dw, w), ("db", db, b)):
        assert relative_error(analytic, numeric(array)) < 1e-7, name


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rank", [1, 3])
def test_transposed_is_the_adjoint_of_the_convolution(rank, mode):
    """<conv(y), x> = <y, conv_transpose(x)> with the same window, weights and padding mode."""
    rng = seeded_rng("adjoint", rank, mode)
    if rank == 1:  # explicit per-side pads, so that the output padding below is plain arithmetic
        y_shape, kernel, stride, pads, dilation = (2, 6, 11), (3,), (2,), ((2, 1),), (2,)
    else:
        y_shape, kernel, stride, pads, dilation = (2, 4, 5, 4, 6), (3, 2, 3), (2, 1, 2), ((1, 1), (1, 0), (2, 2)), \
            (1, 1, 1)
    kw = dict(stride=stride, padding=pads, dilation=dilation, groups=2, padding_mode=mode)
    w = rng.standard_normal((4, y_shape[1] // 2) + kernel)       # conv: y_shape's channels -> 4
    conv, conv_t = _ops(rank, False)[0], _ops(rank, True)[0]
    y = rng.standard_normal(y_shape)
    x = rng.standard_normal(conv(y, w, **kw).shape)
    # The rows of y that no window reaches come back as output padding of the transposed op.
    out_pad = tuple(n - ((m - 1) * s - sum(p) + d * (k - 1) + 1)
                    for n, m, s, p, d, k in zip(y_shape[2:], x.shape[2:], stride, pads, dilation, kernel))
    lhs = np.sum(conv(y, w, **kw) * x)
    rhs = np.sum(y * conv_t(x, w, output_padding=out_pad, **kw))
    assert abs(lhs - rhs) <= 1e-10 * max(abs(lhs), 1.0)


def test_padding_modes_read_what_torch_pads():
    """The padded input the reference builds is torch's F.pad, mode by mode, on every side of a 3-D input."""
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(1, 2, 3, 4, 5)
    pads = ((2, 1), (0, 3), (4, 1))
    for mode in ("reflect", "replicate", "circular"):
        if mode == "reflect":
            pads = ((2, 1), (0, 3), (3, 1))
        ours = reference._pad_nd(x, pads, mode)
        theirs = F.pad(torch.tensor(x), [v for pair in reversed(pads) for v in pair], mode=mode).numpy()
        np.testing.assert_array_equal(ours, theirs, err_msg=mode)


@pytest.mark.parametrize("op, kw, match", [
    ("conv1d", dict(padding_mode="mirror"), "padding_mode"),
    ("conv1d", dict(padding=3, padding_mode="reflect"), "too large"),
    ("conv1d", dict(layout="NCHW"), "layout"),
    ("conv3d", dict(stride=(1, 2)), "stride"),
    ("conv3d", dict(padding=((1, 2), 1)), "padding"),
])
def test_reference_refuses_bad_arguments(op, kw, match):
    x = np.zeros((1, 2, 3) if op == "conv1d" else (1, 2, 3, 3, 3))
    w = np.zeros((2, 2, 1) if op == "conv1d" else (2, 2, 1, 1, 1))
    with pytest.raises(ValueError, match=match):
        getattr(reference, op)(x, w, **kw)
