"""convgen.torch: the custom ops, the nn modules and `convert`, inside autograd, torch.compile and torch.export.

Oracles: PyTorch's own convolutions (per-side padding by F.pad before conv2d or by cropping the
unpadded conv_transpose2d), convgen.reference where PyTorch has no such padding ("same" with
strides, transposed "same"), torch.autograd.gradcheck's numerical derivatives, torch.library.opcheck
(the fake implementations' shapes and strides against the real ones), and the model before `convert`.
"""

import copy
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import convgen
import convgen.torch as cgt
from convgen import reference
from convgen.runtime import kernels
from convgen.torch import library
from grid import CONV_CASES, GRADIENT_WINDOWS, FORWARD_WINDOWS, TRANSPOSE_CASES, Case
from helpers import seeded_rng

F = torch.nn.functional
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}  # max |Δ| / max |expected|, direct kernels

# Small cases for full-mode gradcheck (two op calls per input element); the grids run fast mode.
GRADCHECK_CONV_CASES = [
    Case("d3-s2-pad2-g2", 1, 4, 6, 7, 4, (3, 3), 2, 2, 3, 2),
    Case("sides-rect-d2x1", 1, 2, 5, 6, 3, (2, 3), (1, 2), ((0, 1), (1, 0)), (2, 1)),
    Case("same-s2-odd-total", 1, 2, 9, 8, 3, (3, 3), 2, "same"),
    Case("valid-d2-g2", 1, 4, 7, 6, 4, (3, 3), 1, "valid", 2, 2),
]
GRADCHECK_TRANSPOSE_CASES = [
    Case("k4-s2-pad1", 1, 2, 3, 4, 3, (4, 4), 2, 1),
    Case("s2-d3-op2-g2", 1, 4, 3, 3, 2, (3, 3), 2, 2, 3, 2, output_padding=2),
    Case("sides-s3x1-d1x3-op2", 1, 2, 3, 3, 2, (5, 3), (3, 1), ((2, 1), (0, 2)), (1, 3), output_padding=2),
    Case("same-s2-odd-total", 2, 2, 3, 4, 2, (4, 3), 2, "same"),
]


def _pads(padding):
    """((top, bottom), (left, right)) of an int, (h, w) or per-side padding."""
    if isinstance(padding, int):
        return ((padding, padding), (padding, padding))
    return tuple(p if isinstance(p, tuple) else (p, p) for p in padding)


def tensors(case, dtype, fmt, transposed=False, requires_grad=False):
    """A case's x (in the memory format), weight and bias as tensors, from the grid's seeded arrays."""
    x, w, b = case.arrays(seeded_rng("torch", case, dtype, transposed), "NCHW", np.float64, transposed)
    x, w, b = (torch.from_numpy(a).to(DTYPES[dtype]) for a in (x, w, b))
    x = x.to(memory_format=FORMATS[fmt])
    return tuple(t.requires_grad_(requires_grad) for t in (x, w, b))


def expected(case, x, w, b, transposed=False):
    """PyTorch's result for a case (x NCHW); convgen.reference's where PyTorch has no such padding."""
    kw = case.kwargs(transposed)
    stride, padding, dilation, groups = kw["stride"], kw["padding"], kw["dilation"], kw["groups"]
    if padding == "same" and (transposed or stride not in (1, (1, 1))):
        op = reference.conv_transpose2d if transposed else reference.conv2d
        args = [t.detach().double().numpy() for t in (x, w, b)]
        return torch.from_numpy(op(*args, **kw)).to(x.dtype)
    if padding == "same":
        with warnings.catch_warnings():  # PyTorch pads a copy for an even kernel; it says so
            warnings.simplefilter("ignore", UserWarning)
            return F.conv2d(x, w, b, stride, "same", dilation, groups)
    (top, bottom), (left, right) = _pads(0 if padding == "valid" else padding)
    if not transposed:
        return F.conv2d(F.pad(x, (left, right, top, bottom)), w, b, stride, 0, dilation, groups)
    full = F.conv_transpose2d(x, w, b, stride, 0, kw["output_padding"], groups, dilation)
    return full[:, :, top:full.shape[2] - bottom, left:full.shape[3] - right]


def assert_close(actual, wanted, what=""):
    assert actual.shape == wanted.shape and actual.dtype == wanted.dtype, (what, actual.shape, wanted.shape)
    scale = max(float(wanted.abs().max()), 1e-30)
    err = float((actual.detach() - wanted.detach()).abs().max()) / scale
    assert err <= TOLERANCE[wanted.dtype], f"{what}: relative error {err:.3g}"


def run(transposed):
    return cgt.conv_transpose2d if transposed else cgt.conv2d


# ---------------------------------------------------------------------------------------- import
def test_the_package_reaches_pytorch_itself_and_convgen_does_not_need_it():
    assert library.torch is torch and Path(torch.__file__).parent.name == "torch"
    assert not Path(torch.__file__).resolve().is_relative_to(Path(convgen.__file__).resolve().parent)
    script = ("import sys; sys.modules['torch'] = None\n"  # as if PyTorch were not installed
              "import convgen; assert 'torch' not in dir(convgen)\n"
              "try:\n    import convgen.torch\nexcept ImportError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("convgen.torch needs PyTorch, which is not installed: pip install torch")
    proc = subprocess.run([sys.executable, "-c", "import sys, convgen; print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr  # importing convgen does not import torch


def test_the_ops_are_registered_under_convgen():
    for name in ("conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward"):
        assert hasattr(torch.ops.convgen, name)
    assert "SymInt[] output_padding" in str(torch.ops.convgen.conv2d.default._schema)


# ------------------------------------------------------------------------------ forward values
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv2d_matches_pytorch(case, dtype, fmt):
    x, w, b = tensors(case, dtype, fmt)
    y = cgt.conv2d(x, w, b, **case.kwargs())
    assert_close(y, expected(case, x, w, b), case.name)
    assert y.is_contiguous(memory_format=FORMATS[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=str)
def test_conv_transpose2d_matches_pytorch(case, dtype, fmt):
    x, w, b = tensors(case, dtype, fmt, transposed=True)
    y = cgt.conv_transpose2d(x, w, b, **case.kwargs(True))
    assert_close(y, expected(case, x, w, b, True), case.name)
    assert y.is_contiguous(memory_format=FORMATS[fmt])


def test_torch_positional_order_unbatched_and_strided_inputs():
    """torch.nn.functional's positional order (conv_transpose2d: groups before dilation), unbatched
    (C, H, W) input, and inputs whose strides are neither layout's (copied, then computed)."""
    case = TRANSPOSE_CASES[3]  # s2-d3-op2-g2: stride 2, padding 2, output_padding 2, groups 2, dilation 3
    x, w, b = tensors(case, "float64", "contiguous", transposed=True)
    want = F.conv_transpose2d(x, w, b, 2, 2, 2, 2, 3)
    assert_close(cgt.conv_transpose2d(x, w, b, 2, 2, 2, 2, 3), want)
    assert_close(cgt.conv_transpose2d(x[0], w, b, 2, 2, 2, 2, 3), want[0])
    case = CONV_CASES[1]  # d3-s2-pad2-g2
    x, w, b = tensors(case, "float64", "contiguous")
    assert_close(cgt.conv2d(x, w, b, 2, 2, 3, 2), F.conv2d(x, w, b, 2, 2, 3, 2))
    assert_close(cgt.conv2d(x[1], w, b, 2, 2, 3, 2), F.conv2d(x[1], w, b, 2, 2, 3, 2))
    strided = x.transpose(2, 3)  # neither contiguous nor channels_last
    wide = w.transpose(2, 3).contiguous()
    assert_close(cgt.conv2d(strided, wide, None, 2, 2, 3, 2), F.conv2d(strided, wide, None, 2, 2, 3, 2))
    sliced = torch.cat([x, x], dim=3)[..., ::2]
    assert_close(cgt.conv2d(sliced, w, b, 2, 2, 3, 2), F.conv2d(sliced, w, b, 2, 2, 3, 2))


# ---------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("transposed, case", [(False, c) for c in GRADCHECK_CONV_CASES]
                         + [(True, c) for c in GRADCHECK_TRANSPOSE_CASES], ids=str)
def test_gradcheck(case, transposed, fmt):
    x, w, b = tensors(case, "float64", fmt, transposed, requires_grad=True)
    kw = case.kwargs(transposed)
    assert torch.autograd.gradcheck(lambda x, w, b: run(transposed)(x, w, b, **kw), (x, w, b))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gradcheck_fast_mode_over_the_whole_grid(fmt):
    """Fast mode (random directions, two evaluations per input) over every grid case of both ops."""
    for transposed, cases in ((False, CONV_CASES), (True, TRANSPOSE_CASES)):
        for case in cases:
            x, w, b = tensors(case, "float64", fmt, transposed, requires_grad=True)
            kw = case.kwargs(transposed)
            assert torch.autograd.gradcheck(lambda x, w, b: run(transposed)(x, w, b, **kw), (x, w, b),
                                            fast_mode=True), case.name


@pytest.fixture
def entries(monkeypatch):
    """Every kernel entry point called, in order: (entry, addresses of its arrays, 0 for NULL)."""
    seen = []
    call, call_addresses = kernels.Kernels.call, kernels.Kernels.call_addresses

    def recording_call(self, entry, problem, arrays, nthreads=None):
        seen.append((entry, [0 if a is None else _address(a) for a in arrays]))
        return call(self, entry, problem, arrays, nthreads)

    def recording_call_addresses(self, entry, problem, addresses, nthreads=None):
        seen.append((entry, list(addresses)))
        return call_addresses(self, entry, problem, addresses, nthreads)

    monkeypatch.setattr(kernels.Kernels, "call", recording_call)
    monkeypatch.setattr(kernels.Kernels, "call_addresses", recording_call_addresses)
    return seen


@pytest.mark.parametrize("path", ["eager", "custom-op"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("wanted", ["x", "w", "b", "xb", "wb", "xwb"])
@pytest.mark.parametrize("transposed, case", [(False, CONV_CASES[1]), (False, CONV_CASES[3]),
                                              (True, TRANSPOSE_CASES[3]), (True, TRANSPOSE_CASES[2])], ids=str)
def test_gradients_of_the_inputs_that_require_them(case, transposed, wanted, fmt, path, entries):
    """Only the requested gradients come back, equal to PyTorch's, and only their kernels run. An
    eager call runs the kernel of each gradient wanted; the custom op (what torch.compile records)
    runs dx alone as the adjoint op (conv_transpose2d for conv2d, conv2d cut to size for
    conv_transpose2d, whose output_padding of 1 or 2 with dilation 2 or 3 adds rows no input feeds)
    and dx beside dw through the backward op. Either way dx is one kernel call."""
    x, w, b = tensors(case, "float64", fmt, transposed)
    inputs = dict(x=x, w=w, b=b)
    for name in wanted:
        inputs[name].requires_grad_(True)
    kw = case.kwargs(transposed)
    if path == "eager":
        y = run(transposed)(x, w, b, **kw)
    else:
        y = getattr(torch.ops.convgen, "conv_transpose2d" if transposed else "conv2d")(
            x, w, b, *_op_params(case, transposed))
    dy = torch.from_numpy(seeded_rng("dy", case).standard_normal(tuple(y.shape)))
    got = torch.autograd.grad(y, [inputs[n] for n in wanted], dy)
    x2, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    want = torch.autograd.grad(expected(case, x2, w2, b2, transposed), [dict(x=x2, w=w2, b=b2)[n] for n in wanted], dy)
    for name, g, r in zip(wanted, got, want):
        assert_close(g, r, f"d{name}")
    forward, dx = ("bwd_data", "fwd") if transposed else ("fwd", "bwd_data")  # a transposed call runs conv()'s
    with_x = "x" in wanted or (path == "custom-op" and "w" in wanted)
    assert [entry for entry, _ in entries] == [forward] + [dx] * with_x + ["bwd_weight"] * ("w" in wanted)


@pytest.mark.parametrize("path, message", [
    ("eager", "differentiate twice a function that was marked with @once_differentiable"),
    ("custom-op", "convgen.conv2d_backward.default but no autograd formula")])
def test_second_derivatives_are_refused(path, message):
    """Documented limit: the gradients have no gradient of their own, in an eager call and in the
    custom op that tracing records."""
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    if path == "eager":
        y = cgt.conv2d(x, w, None, 1, 1)
    else:
        y = torch.ops.convgen.conv2d(x, w, None, [1, 1], [1, 1, 1, 1], [0, 0], [1, 1], 1, "auto")
    dx, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        dx.sum().backward()


# ----------------------------------------------------------------------------- memory: no copies
def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


@pytest.mark.parametrize("path", ["eager", "custom-op"])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv2d", "conv_transpose2d"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernels_run_on_the_tensors_memory(fmt, transposed, path, entries):
    """An eager call (the first of its signature and the next) and the custom ops a graph runs: the
    kernels read x where it lies and write y where the returned tensor's memory is, channels_last
    for a channels_last input; dx and dw likewise; the inputs are never written."""
    case = TRANSPOSE_CASES[0] if transposed else CONV_CASES[1]
    x, w, b = tensors(case, "float32", fmt, transposed, requires_grad=True)
    saved = [t.detach().clone() for t in (x, w, b)]
    name = "conv_transpose2d" if transposed else "conv2d"
    forward, dx_entry = ("bwd_data", "fwd") if transposed else ("fwd", "bwd_data")
    for _ in range(2):
        entries.clear()
        if path == "eager":
            y = run(transposed)(x, w, b, **case.kwargs(transposed))
        else:
            y = getattr(torch.ops.convgen, name)(x, w, b, *_op_params(case, transposed))
        (entry, addresses), = entries
        assert entry == forward and addresses[0] == x.data_ptr() and addresses[-1] == y.data_ptr()
        assert y.is_contiguous(memory_format=FORMATS[fmt])
        dy = torch.randn(y.shape, dtype=y.dtype).to(memory_format=FORMATS[fmt])
        if path == "eager":
            y.backward(dy)
            dx, dw = x.grad, w.grad
        else:
            dx, dw, db = getattr(torch.ops.convgen, f"{name}_backward")(dy, x.detach(), w.detach(),
                                                                        *_op_params(case, transposed))
            torch.testing.assert_close(db, dy.sum((0, 2, 3)))
        (dx_called, dx_addresses), (dw_called, dw_addresses) = entries[1:]
        assert (dx_called, dw_called) == (dx_entry, "bwd_weight")
        assert dx_addresses[0] == dy.data_ptr() and dx_addresses[-1] == dx.data_ptr()
        assert dw_addresses[1 - transposed] == x.data_ptr()
        assert dx.is_contiguous(memory_format=FORMATS[fmt]) and dw.shape == w.shape
        x.grad = w.grad = b.grad = None
    for before, after in zip(saved, (x, w, b)):
        assert torch.equal(before, after.detach())


@pytest.mark.parametrize("transposed", [False, True], ids=["conv2d", "conv_transpose2d"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_signature_seen_before_computes_each_calls_values(fmt, transposed):
    """Eager calls of one signature share its checks and plan, never its values: each call's output
    and gradients are those of its own tensors (x, weights and bias all new), including through
    weights in PyTorch's order on a channels_last input (reordered per call) and a sliced x."""
    case = TRANSPOSE_CASES[5] if transposed else CONV_CASES[2]
    for seed in range(3):
        x, w, b = tensors(case, "float64", fmt, transposed)
        x, w, b = x * (seed + 1), w - seed, b + seed
        x = x.detach().requires_grad_(True)
        w = w.detach().requires_grad_(True)
        wide = torch.cat([x, x], dim=3)[..., :x.shape[3]] if seed == 2 else x  # same shape, other strides
        y = run(transposed)(wide, w, b, **case.kwargs(transposed))
        x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        want = expected(case, x2, w2, b, transposed)
        assert_close(y, want.detach(), "y")
        dy = torch.from_numpy(seeded_rng("dy", case, seed).standard_normal(tuple(y.shape)))
        got = torch.autograd.grad(y, [x, w], dy)
        for name, g, r in zip("xw", got, torch.autograd.grad(want, [x2, w2], dy)):
            assert_close(g, r, f"d{name}")


def test_eager_calls_run_on_torchs_thread_count(monkeypatch):
    """convgen.torch follows torch.set_num_threads, whatever convgen's own count."""
    seen = []
    call_addresses = kernels.Kernels.call_addresses
    monkeypatch.setattr(kernels.Kernels, "call_addresses",
                        lambda self, entry, problem, addresses, nthreads=None:
                        seen.append(nthreads) or call_addresses(self, entry, problem, addresses, nthreads))
    x, w = torch.randn(2, 4, 9, 9, requires_grad=True), torch.randn(6, 4, 3, 3, requires_grad=True)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            seen.clear()
            cgt.conv2d(x, w, None, 1, 1).sum().backward()
            assert seen == [threads] * 3  # forward, dx, dw
            seen.clear()
            torch.ops.convgen.conv2d(x, w, None, [1, 1], [1, 1, 1, 1], [0, 0], [1, 1], 1, "auto")  # what graphs run
            assert seen == [threads]
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_batch_gives_an_empty_output_and_zero_gradients(fmt):
    """Nothing to multiply: an empty y and empty-sum gradients, as PyTorch's, in an eager call (twice:
    the second from its remembered signature) and in the custom op."""
    w, b = torch.randn(4, 3, 3, 3, requires_grad=True), torch.randn(4, requires_grad=True)
    x = torch.randn(0, 3, 5, 5).to(memory_format=FORMATS[fmt]).requires_grad_(True)
    want = torch.nn.functional.conv2d(x, w, b, padding=1)
    want_grads = torch.autograd.grad(want.sum(), (x, w, b))
    for call in (lambda: cgt.conv2d(x, w, b, 1, 1), lambda: cgt.conv2d(x, w, b, 1, 1),
                 lambda: torch.ops.convgen.conv2d(x, w, b, [1, 1], [1, 1, 1, 1], [0, 0], [1, 1], 1, "auto")):
        y = call()
        torch.testing.assert_close(y, want)
        for got, expected_grad in zip(torch.autograd.grad(y.sum(), (x, w, b)), want_grads):
            torch.testing.assert_close(got, expected_grad)


def test_tracing_records_the_custom_op_even_for_a_signature_seen_eagerly():
    """make_fx (a dispatch mode over real tensors) and torch.jit.trace see the custom op, not the
    eager shortcut, after eager calls of the same signature."""
    from torch.fx.experimental.proxy_tensor import make_fx
    x, w = torch.randn(1, 3, 6, 6), torch.randn(4, 3, 3, 3)
    f = lambda x, w: cgt.conv2d(x, w, None, 1, 1)  # noqa: E731
    expected_y = f(x, w)
    graph = make_fx(f)(x, w)
    assert "convgen.conv2d" in str(graph.graph)
    torch.testing.assert_close(graph(x, w), expected_y)
    traced = torch.jit.trace(f, (x, w), check_trace=False)
    assert "convgen::conv2d" in str(traced.graph)


def _op_params(case, transposed):
    """The explicit argument lists a grid case passes to the custom ops (its padding is numeric)."""
    kw = case.kwargs(transposed)
    (top, bottom), (left, right) = _pads(kw["padding"])
    pair = lambda v: list(v) if isinstance(v, tuple) else [v, v]  # noqa: E731
    return (pair(kw["stride"]), [top, bottom, left, right], pair(kw.get("output_padding", 0)), pair(kw["dilation"]),
            kw["groups"], "auto")


@pytest.mark.parametrize("transposed", [False, True], ids=["conv2d", "conv_transpose2d"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck(fmt, transposed):
    """torch.library.opcheck: the schema, the autograd registration, the fake implementations' shapes
    and strides against the real ones, and AOT dispatch with static and dynamic shapes."""
    case = TRANSPOSE_CASES[3] if transposed else CONV_CASES[1]
    x, w, b = tensors(case, "float64", fmt, transposed, requires_grad=True)
    name = "conv_transpose2d" if transposed else "conv2d"
    params = _op_params(case, transposed)
    torch.library.opcheck(getattr(torch.ops.convgen, name), (x, w, b, *params))
    y = getattr(torch.ops.convgen, name)(x, w, b, *params)
    dy = torch.randn(y.shape, dtype=y.dtype).to(memory_format=FORMATS[fmt])
    torch.library.opcheck(getattr(torch.ops.convgen, f"{name}_backward"), (dy, x.detach(), w.detach(), *params))


def test_meta_tensors_give_shapes_and_memory_formats():
    x = torch.empty(2, 4, 11, 10, device="meta").to(memory_format=torch.channels_last)
    y = cgt.conv2d(x, torch.empty(6, 2, 3, 3, device="meta"), None, 2, 2, 3, 2)
    assert y.device.type == "meta" and y.shape == (2, 6, 5, 4) and y.is_contiguous(memory_format=torch.channels_last)
    y = cgt.conv_transpose2d(torch.empty(1, 4, 3, 3, device="meta"), torch.empty(4, 1, 3, 3, device="meta"),
                             None, 2, 2, 2, 2, 3)
    assert y.shape == (1, 2, 9, 9)  # (3 - 1)·2 − 4 + 3·2 + 2 + 1
    with pytest.raises(ValueError, match="w expects 2 input channels per group .* but x has 4"):
        cgt.conv2d(x, torch.empty(6, 2, 3, 3, device="meta"))  # checked where traced, with convgen's message


# ------------------------------------------------------------------------------------- errors
def test_bad_arguments_are_refused_by_name():
    x, w = torch.randn(1, 4, 6, 6), torch.randn(4, 2, 3, 3)
    cases = [
        (TypeError, "input must be float32 or float64.*float16", lambda: cgt.conv2d(x.half(), w.half())),
        (TypeError, "input must be float32 or float64.*int64", lambda: cgt.conv2d(x.long(), w.long())),
        (TypeError, "input and weight must share one dtype", lambda: cgt.conv2d(x, w.double())),
        (TypeError, "input and bias must share one dtype", lambda: cgt.conv2d(x, w, torch.zeros(4).double())),
        (TypeError, "input must be a torch.Tensor, got ndarray", lambda: cgt.conv2d(x.numpy(), w)),
        (ValueError, "input must be a 4-D batch", lambda: cgt.conv2d(x[None], w)),
        (ValueError, "weight must have 4 dimensions", lambda: cgt.conv2d(x, w[0])),
        (ValueError, "bias must be 1-D", lambda: cgt.conv2d(x, w, torch.zeros(1, 4))),
        (ValueError, "w expects 2 input channels per group", lambda: cgt.conv2d(x, w)),
        (ValueError, "groups=3 must divide", lambda: cgt.conv2d(x, w, groups=3)),
        (ValueError, "kernel extent 5 along h", lambda: cgt.conv2d(x[:, :, :4], w, groups=2, dilation=2)),
        (ValueError, "padding must be an int, a pair, a pair of pairs, 'same' or 'valid'; got 'full'",
         lambda: cgt.conv2d(x, w, groups=2, padding="full")),
        (ValueError, "stride must be an int or 2 ints", lambda: cgt.conv2d(x, w, groups=2, stride=(1, 1, 1))),
        (ValueError, "stride must be >= 1, got 0", lambda: cgt.conv2d(x, w, groups=2, stride=0)),
        (ValueError, "algorithm", lambda: cgt.conv2d(x, w, groups=2, algorithm="fft")),
        (ValueError, "output_padding along h must be smaller than max\\(stride, dilation\\) = 2",
         lambda: cgt.conv_transpose2d(x, w, stride=2, output_padding=2)),
        (ValueError, "output_padding must be 0 with padding='same'",
         lambda: cgt.conv_transpose2d(x, w, stride=2, padding="same", output_padding=1)),
    ]
    for kind, message, call in cases:
        with pytest.raises(kind, match=message):
            call()


class ElsewhereTensor(torch.Tensor):
    """A CPU tensor that says it is on a GPU: the device check without a GPU on the machine."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_tensors_on_other_devices_are_refused():
    x, w = torch.randn(1, 4, 6, 6), torch.randn(4, 4, 3, 3)
    with pytest.raises(ValueError, match=r"input is on device cuda:0; convgen runs on the CPU \(move it with"):
        cgt.conv2d(x.as_subclass(ElsewhereTensor), w)
    with pytest.raises(ValueError, match="weight is on device cuda:0"):
        cgt.conv_transpose2d(x, w.as_subclass(ElsewhereTensor))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_padding_modes_agree_with_pytorchs_conv2d(mode, fmt):
    """Conv2d's padding modes, forward and every gradient, against torch.nn.Conv2d with the same
    Parameters (which pads a copy of the input with F.pad); a second input without a weight gradient
    takes the dx-only path."""
    torch.manual_seed(5)
    theirs = torch.nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(2, 1), dilation=(1, 2), groups=2,
                             padding_mode=mode).double()
    ours = cgt.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(2, 1), dilation=(1, 2), groups=2, padding_mode=mode,
                      dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64).to(memory_format=FORMATS[fmt])
    xs = [x.clone().requires_grad_() for _ in range(2)]
    expected, got = theirs(xs[0]), ours(xs[1])
    assert got.is_contiguous(memory_format=FORMATS[fmt])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    dy = torch.randn_like(expected)
    expected.backward(dy)
    got.backward(dy)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, rtol=0, atol=1e-12)

    ours.requires_grad_(False)
    theirs.requires_grad_(False)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    theirs(xs[0]).backward(dy)
    ours(xs[1]).backward(dy)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=1e-12)


def test_padding_mode_gradcheck_and_refusals():
    x = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: cgt.conv2d(x, w, None, 1, (2, 1), padding_mode="reflect"), (x, w))
    with pytest.raises(ValueError, match="padding_mode must be one of .* got 'mirror'"):
        cgt.conv2d(x, w, padding=1, padding_mode="mirror")
    with pytest.raises(ValueError, match="reflect"):  # PyTorch's rule: reflect pads less than the input
        cgt.conv2d(x, w, padding=(5, 1), padding_mode="reflect")
    layer = cgt.ConvTranspose2d(2, 3, 3, padding=1)
    layer.padding_mode = "circular"  # the constructor refuses it, as PyTorch's
    with pytest.raises(ValueError, match="Only 'zeros' padding mode is supported for ConvTranspose2d, got 'circular'"):
        layer(torch.randn(1, 2, 5, 5))


# ------------------------------------------------------------------------------------ modules
def test_modules_are_pytorchs_modules_computed_by_convgen():
    torch.manual_seed(3)
    theirs = torch.nn.Conv2d(4, 6, (4, 2), padding="same", groups=2)
    torch.manual_seed(3)
    ours = cgt.Conv2d(4, 6, (4, 2), padding="same", groups=2)  # same initialization, same keys
    assert isinstance(ours, torch.nn.Conv2d) and list(ours.state_dict()) == ["weight", "bias"]
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
    assert repr(ours) == repr(theirs)
    x = torch.randn(2, 4, 5, 7)
    with torch.no_grad():
        assert_close(ours(x), theirs(x))

    theirs = torch.nn.ConvTranspose2d(3, 2, 3, stride=2, padding=0, bias=False)
    ours = cgt.ConvTranspose2d(3, 2, 3, stride=2, padding=0, bias=False, algorithm="direct")
    ours.load_state_dict(theirs.state_dict())
    assert repr(ours) == repr(theirs)[:-1] + ", algorithm='direct')"
    x = torch.randn(2, 3, 3, 4, dtype=torch.float32)
    with torch.no_grad():
        assert_close(ours(x, output_size=[8, 10]), theirs(x, output_size=[8, 10]))  # output_padding 1
        assert ours(x).shape == (2, 2, 7, 9)


class SmallCNN(torch.nn.Module):
    """Every window here is in the test grid's prebuilt set (or compiled once by the Winograd tests)."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1, groups=2), torch.nn.ReLU(),  # 8 per group: Winograd
            torch.nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), torch.nn.ReLU())
        self.head = torch.nn.Conv2d(8, 3, 1, bias=False)

    def forward(self, x):
        return self.head(self.features(x)) + x


CNN_SWAPPED = ["features.0", "features.2", "features.4", "features.6", "head"]
# float32: the direct kernels sum in another order than oneDNN (~1e-7 relative) and the grouped 3x3
# layer runs Winograd F(4x4, 3x3) (~4e-6); through five layers and back, 1e-4 of the largest value.
CNN_TOLERANCE = 1e-4


def _output_and_gradients(model, x):
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    loss = (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum()
    grads = torch.autograd.grad(loss, [x, *model.parameters()])
    return y.detach(), grads


def _relative(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_gives_the_same_outputs_and_gradients(fmt):
    torch.manual_seed(0)
    original = SmallCNN().to(memory_format=FORMATS[fmt])
    converted = copy.deepcopy(original)
    parameters = dict(converted.named_parameters())
    report = cgt.convert(converted)
    assert [entry.name for entry in report.swapped] == CNN_SWAPPED and report.left == []
    assert report.model is converted and str(report).startswith("convgen.torch.convert: 5 swapped, 0 left")
    assert all(type(converted.get_submodule(name)) in (cgt.Conv2d, cgt.ConvTranspose2d) for name in CNN_SWAPPED)
    assert all(p is parameters[name] for name, p in converted.named_parameters())  # the very same Parameters
    assert list(converted.state_dict()) == list(original.state_dict())

    x = torch.randn(2, 3, 12, 12).to(memory_format=FORMATS[fmt])
    y, grads = _output_and_gradients(converted, x)
    y_torch, grads_torch = _output_and_gradients(original, x)
    assert y.is_contiguous(memory_format=FORMATS[fmt])
    assert _relative(y, y_torch) <= CNN_TOLERANCE
    names = ["x"] + [name for name, _ in original.named_parameters()]
    for name, g, g_torch in zip(names, grads, grads_torch):
        assert g.shape == g_torch.shape and _relative(g, g_torch) <= CNN_TOLERANCE, name


def _weight_order(kind_name, weight):
    """"convgen" when the weights' memory is convgen's channels-last (kh, kw, in, out) order,
    "contiguous" when it is PyTorch's (out, in, kh, kw), else "other"."""
    kind = library.KINDS[kind_name]
    if weight.permute(kind.weight_to_last).is_contiguous():
        return "convgen"
    return "contiguous" if weight.is_contiguous() else "other"


@pytest.fixture
def weight_copies(monkeypatch):
    """Counts the calls that reorder a copy of the weights instead of reading them where they lie."""
    counted = []
    original = library._weight_in_layout

    def counting(kind, weight, last):
        counted.append(tuple(weight.shape))
        return original(kind, weight, last)

    monkeypatch.setattr(library, "_weight_in_layout", counting)
    return counted


@pytest.mark.parametrize("wants_gradient", [False, True], ids=["inference", "training"])
def test_a_modules_weights_are_laid_once_for_the_inputs_layout(wants_gradient, weight_copies):
    torch.manual_seed(0)
    original = SmallCNN()
    converted = copy.deepcopy(original)
    cgt.convert(converted)
    parameters = dict(converted.named_parameters())
    first_weight = parameters["features.0.weight"]
    x = torch.randn(2, 3, 12, 12).to(memory_format=torch.channels_last)
    with torch.set_grad_enabled(wants_gradient):
        for _ in range(2):  # the first call plans on the weights as they lie; the second re-lays them
            converted(x)
        assert all(_weight_order(kind, converted.get_submodule(name).weight) == "convgen"
                   for name, kind in zip(CNN_SWAPPED, ["conv2d"] * 3 + ["conv_transpose2d", "conv2d"]))
        copies_before = len(weight_copies)
        for _ in range(3):
            y = converted(x)
            if wants_gradient:
                y.sum().backward()
        assert len(weight_copies) == copies_before, "a call copied weights after they were laid out"
    assert all(p is parameters[name] for name, p in converted.named_parameters())  # the same Parameters
    assert first_weight.shape == (8, 3, 3, 3)
    for (name, theirs), ours in zip(original.state_dict().items(), converted.state_dict().values()):
        assert torch.equal(theirs, ours), name  # the values did not move, only their memory
    y, grads = _output_and_gradients(converted, x)
    y_torch, grads_torch = _output_and_gradients(original, x)
    assert _relative(y, y_torch) <= CNN_TOLERANCE
    assert all(_relative(g, g_torch) <= CNN_TOLERANCE for g, g_torch in zip(grads, grads_torch))

    # Calls on the other layout re-lay them back: a copy per call never outlives the layout change.
    contiguous = x.contiguous()
    for _ in range(2):
        converted(contiguous)
    assert _weight_order("conv2d", first_weight) == "contiguous"


def test_laid_out_weights_never_go_stale():
    """Every write to the weights reaches the kernels: through the optimizer, load_state_dict, and
    `.data`, which PyTorch's version counter does not see, once the kept layouts are forgotten."""
    torch.manual_seed(1)
    original = SmallCNN()
    converted = copy.deepcopy(original)
    cgt.convert(converted)
    x = torch.randn(2, 3, 12, 12).to(memory_format=torch.channels_last)
    ours = torch.optim.SGD(converted.parameters(), lr=1e-3, momentum=0.9)
    theirs = torch.optim.SGD(original.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(4):  # (training steps: the weights are laid out on the second)
        for model, optimizer in ((converted, ours), (original, theirs)):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    assert _weight_order("conv2d", converted.features[0].weight) == "convgen"
    for (name, a), b in zip(original.named_parameters(), converted.parameters()):
        assert _relative(b.detach(), a.detach()) <= CNN_TOLERANCE, name
    with torch.no_grad():
        assert _relative(converted(x), original(x)) <= CNN_TOLERANCE

    fresh = SmallCNN()
    converted.load_state_dict(fresh.state_dict())
    with torch.no_grad():
        assert _relative(converted(x), fresh(x)) <= CNN_TOLERANCE
        assert _relative(converted(x), fresh(x)) <= CNN_TOLERANCE  # (the second call: laid out now)
        converted.features[0].weight.data.mul_(-2.0)  # unseen by the version counter
        fresh.features[0].weight.data.mul_(-2.0)
        cgt.forget_laid_out_weights()
        assert _relative(converted(x), fresh(x)) <= CNN_TOLERANCE


@pytest.fixture
def layouts_made(monkeypatch):
    """Counts the weights laid out for the kernels once (`Kernels.prepare_weights`), by entry point."""
    made = []
    original = kernels.Kernels.prepare_weights

    def counting(self, entry, problem, weight, nthreads=None):
        made.append(entry)
        return original(self, entry, problem, weight, nthreads)

    monkeypatch.setattr(kernels.Kernels, "prepare_weights", counting)
    return made


def _deep_pair(seed):
    """A PyTorch stack and its converted copy; the last two layers share one call signature (one Bound)."""
    torch.manual_seed(seed)
    original = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 3, padding=1),
                                   torch.nn.Conv2d(16, 16, 3, padding=1)).eval()
    converted = copy.deepcopy(original)
    cgt.convert(converted)
    return original, converted


def test_inference_lays_each_weight_out_once(layouts_made):
    original, converted = _deep_pair(3)
    x = torch.randn(2, 8, 9, 9)
    with torch.inference_mode():
        for call in range(4):
            assert _relative(converted(x), original(x)) <= 1e-5, call
            # none on the first call (a training step would change them before the next), each of
            # the three weights on the second, none after
            assert len(layouts_made) == (0 if call == 0 else 3), call
    cgt.forget_laid_out_weights()
    with torch.inference_mode():
        converted(x)
        converted(x)
    assert len(layouts_made) == 6


def test_training_steps_never_lay_weights_out_ahead(layouts_made):
    original, converted = _deep_pair(4)
    x = torch.randn(2, 8, 9, 9)
    ours, theirs = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (converted, original))
    for _ in range(3):
        for model, optimizer in ((converted, ours), (original, theirs)):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    assert layouts_made == []  # every call saw new weights: the kernels laid them out themselves
    for a, b in zip(original.parameters(), converted.parameters()):
        assert _relative(b.detach(), a.detach()) <= 1e-5
    with torch.no_grad():  # evaluation after the steps: laid out on its second call, the values the steps left
        for _ in range(3):
            assert _relative(converted(x), original(x)) <= 1e-5


def test_laid_out_weights_follow_every_change_the_version_counter_sees():
    original, converted = _deep_pair(5)
    x = torch.randn(1, 8, 9, 9)

    def agree(note):
        with torch.no_grad():
            for _ in range(3):  # the first call records the values, the second lays them out, the third reads them
                assert _relative(converted(x), original(x)) <= 1e-5, note

    agree("start")
    with torch.no_grad():  # in place, through the Parameter
        for model in (original, converted):
            model[1].weight.mul_(-3.0)
    agree("mul_")
    with torch.no_grad():  # through a view, and through detach(), which share the version counter
        for model in (original, converted):
            model[2].weight[:4].zero_()
            model[0].weight.detach().add_(1.0)
    agree("views")
    fresh = copy.deepcopy(original)
    with torch.no_grad():
        for p in fresh.parameters():
            p.normal_()
    for model in (original, converted):
        model.load_state_dict(fresh.state_dict())
    agree("load_state_dict")
    replacement = torch.randn_like(original[1].weight)
    for model in (original, converted):  # a new Parameter, at a new address
        model[1].weight = torch.nn.Parameter(replacement.clone())
    torch.nn.init.kaiming_normal_(original[2].weight)  # torch.nn.init writes in place, under no_grad
    with torch.no_grad():
        converted[2].weight.copy_(original[2].weight)
    agree("new parameters")
    original, converted = original.double(), converted.double()  # dtype: new tensors, new signatures
    x = x.double()
    agree("double")


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_weights_in_another_layout_are_copied_once_per_value(mode, weight_copies, layouts_made):
    """A functional call on a channels_last input with contiguous weights (not a converted module's,
    which are re-laid in place) reorders a copy of them: once per value when no gradient is taken,
    the copy laid out for the kernels on the second call like a weight that lies in the layout; every
    change the version counter sees, and a write through `.data` once forgotten, reaches the kernels;
    weights being trained are copied once per step, the forward pass's copy serving its backward pass."""
    torch.manual_seed(7)
    x = torch.randn(2, 6, 9, 9).to(memory_format=torch.channels_last)
    weight, bias = torch.randn(8, 6, 3, 3), torch.randn(8)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def agree(note, calls=3):
        with context():
            for _ in range(calls):
                got = cgt.conv2d(x, weight, bias, padding=1)
        want = torch.nn.functional.conv2d(x, weight, bias, padding=1)
        assert _relative(got, want) <= 1e-5, note

    with context():
        cgt.conv2d(x, weight, bias, padding=1)  # plans the signature (on a copy too) and copies the weights
    weight_copies.clear()
    agree("the same values")
    assert weight_copies == [] and layouts_made == ["fwd"]
    with torch.no_grad():
        weight.mul_(-2.0)
    agree("mul_")
    assert len(weight_copies) == 1 and layouts_made == ["fwd", "fwd"]
    weight.data[:, :3].zero_()  # unseen by the version counter...
    cgt.forget_laid_out_weights()  # ...until the kept copies are forgotten
    agree("written through .data")
    assert len(weight_copies) == 2
    trained = weight.clone().requires_grad_(True)
    cgt.conv2d(x, trained, bias, padding=1).sum().backward()  # (another signature: planned first)
    weight_copies.clear()
    xg = x.clone().requires_grad_(True)
    for _ in range(2):
        trained.grad = xg.grad = None
        cgt.conv2d(xg, trained, bias, padding=1).sum().backward()
    assert len(weight_copies) == 2  # (one per step: the input gradient reads the forward pass's copy)
    got = (xg.grad, trained.grad)
    trained.grad = xg.grad = None
    torch.nn.functional.conv2d(xg, trained, bias, padding=1).sum().backward()
    assert _relative(got[0], xg.grad) <= 1e-5 and _relative(got[1], trained.grad) <= 1e-5


def test_laid_out_weights_serve_concurrent_calls():
    original, converted = _deep_pair(6)
    inputs = [torch.randn(1, 8, 9, 9) for _ in range(4)]
    with torch.no_grad():
        wanted = [original(x) for x in inputs]
        converted(inputs[0])
    results = {}

    def run(index):
        with torch.no_grad():
            for _ in range(5):
                results[index] = converted(inputs[index])

    import threading
    workers = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert all(_relative(results[i], wanted[i]) <= 1e-5 for i in range(4))


def test_weights_laid_out_between_a_forward_pass_and_its_backward_pass():
    """A graph recorded on the weights in one order runs its backward pass after a call on the
    other layout re-laid them (the saved Bound must not read them as if they had not moved)."""
    torch.manual_seed(2)
    original = torch.nn.Conv2d(4, 6, 3, padding=1)
    converted = cgt.convert(copy.deepcopy(original)).model
    x = torch.randn(2, 4, 7, 7, requires_grad=True)
    y = converted(x)  # contiguous: the weights are read as they lie
    with torch.no_grad():
        for _ in range(2):
            converted(x.to(memory_format=torch.channels_last))
    assert _weight_order("conv2d", converted.weight) == "convgen"
    grads = torch.autograd.grad(y.square().sum(), (x, converted.weight))  # dx reads the weights
    wanted = torch.autograd.grad(original(x).square().sum(), (x, original.weight))
    assert all(_relative(g, w) <= 1e-5 for g, w in zip(grads, wanted))


def test_convert_lays_out_a_channels_last_models_weights_at_once():
    torch.manual_seed(0)
    model = SmallCNN().to(memory_format=torch.channels_last)
    cgt.convert(model)
    assert all(_weight_order(kind, model.get_submodule(name).weight) == "convgen"
               for name, kind in zip(CNN_SWAPPED, ["conv2d"] * 3 + ["conv_transpose2d", "conv2d"]))
    contiguous = SmallCNN()
    cgt.convert(contiguous)
    assert all(_weight_order("conv2d", contiguous.get_submodule(name).weight) == "contiguous"
               for name in CNN_SWAPPED)
    told = SmallCNN()  # contiguous weights, for channels_last inputs: the 1x1 head's too
    cgt.convert(told, memory_format=torch.channels_last)
    assert _weight_order("conv2d", told.head.weight) == "convgen"
    cgt.convert(told, memory_format=torch.contiguous_format)  # (already convgen's: laid back)
    assert all(_weight_order("conv2d", told.get_submodule(name).weight) == "contiguous" for name in CNN_SWAPPED)
    with pytest.raises(ValueError, match="memory_format"):
        cgt.convert(SmallCNN(), memory_format=torch.preserve_format)


class Hooked(torch.nn.Conv2d):
    pass


def test_convert_leaves_what_convgen_does_not_compute_and_says_why():
    torch.manual_seed(0)
    shared = torch.nn.Conv2d(2, 2, 3, padding=1)
    hooked = torch.nn.Conv2d(2, 2, 3)
    hooked.register_forward_hook(lambda *args: None)
    model = torch.nn.ModuleDict(dict(
        shared_a=shared, inner=torch.nn.Sequential(shared, torch.nn.ReLU()),
        reflect=torch.nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
        float16=torch.nn.Conv2d(2, 2, 3).half(), conv1d=torch.nn.Conv1d(2, 2, 3), hooked=hooked,
        subclass=Hooked(2, 2, 3), lazy=torch.nn.LazyConv2d(2, 3),
        spectral=torch.nn.utils.parametrizations.spectral_norm(torch.nn.Conv2d(2, 2, 3)),
        done=cgt.Conv2d(2, 2, 3), transposed=torch.nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1)))
    report = cgt.convert(model)
    assert [entry.name for entry in report.swapped] == ["shared_a", "reflect", "transposed"]
    assert type(model["reflect"]) is cgt.Conv2d and model["reflect"].padding_mode == "reflect"
    assert model["shared_a"] is model["inner"][0] and type(model["inner"][0]) is cgt.Conv2d
    reasons = {entry.name: entry.reason for entry in report.left}
    assert reasons == {
        "float16": "dtype torch.float16: convgen computes float32 and float64",
        "conv1d": "convgen computes Conv2d, ConvTranspose2d, not Conv1d",
        "hooked": "has forward or backward hooks (old-style weight_norm is one), which a swap would drop",
        "subclass": "a subclass of torch.nn.Conv2d, whose forward may differ",
        "lazy": "a lazy module whose parameters do not exist yet (run one forward pass first)",
        "spectral": "parametrized (e.g. weight_norm, spectral_norm): its weight is computed on each call",
        "done": "already computed by convgen",
    }
    for name in reasons:
        assert f"left     {name}: " in str(report)

    conv = torch.nn.Conv2d(2, 2, 3, padding=1)
    report = cgt.convert(conv)  # the model itself is a convolution: the twin is report.model
    assert type(report.model) is cgt.Conv2d and report.model.weight is conv.weight
    assert str(report).splitlines()[1].startswith("  swapped  (model): Conv2d(2, 2, kernel_size=(3, 3)")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got list"):
        cgt.convert([conv])


# ----------------------------------------------------------------------------- compile, export
def test_compiled_training_step_agrees(capsys):
    """aot_eager traces forward and backward through the ops' fake implementations (fullgraph: no
    graph break anywhere in convgen.torch); the compiled step matches the eager converted model."""
    torch.manual_seed(1)
    model = SmallCNN()
    cgt.convert(model)
    x = torch.randn(2, 3, 8, 8)
    start = time.perf_counter()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y, grads = _output_and_gradients(compiled, x)
    elapsed = time.perf_counter() - start
    y_eager, grads_eager = _output_and_gradients(model, x)
    assert _relative(y, y_eager) <= 1e-6
    for g, g_eager in zip(grads, grads_eager):
        assert _relative(g, g_eager) <= 1e-6
    with capsys.disabled():
        print(f"\n  aot_eager compile and first step: {elapsed:.1f} s", end="")


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
def test_inductor_compiled_model_agrees_and_keeps_channels_last(capsys):
    """One inductor compile (forward, inference): the ReLU becomes generated C++ between the custom
    ops, which receive and return channels_last buffers. (One pointwise kernel: each is a C++ compile.)"""
    torch.manual_seed(2)
    model = torch.nn.Sequential(cgt.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                cgt.ConvTranspose2d(8, 3, 4, stride=2, padding=1)).eval()
    model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    start = time.perf_counter()
    with torch._inductor.config.patch(compile_threads=1), torch.no_grad():  # no worker pool to start
        y = torch.compile(model, fullgraph=True)(x)
        elapsed = time.perf_counter() - start
        y_eager = model(x)
    assert _relative(y, y_eager) <= 1e-6 and y.is_contiguous(memory_format=torch.channels_last)
    with capsys.disabled():
        print(f"\n  inductor compile and first call: {elapsed:.1f} s", end="")


def test_export_traces_the_ops():
    torch.manual_seed(3)
    model = SmallCNN().eval()
    cgt.convert(model)
    x = torch.randn(1, 3, 8, 8)
    program = torch.export.export(model, (x,))
    code = program.graph_module.code
    assert code.count("torch.ops.convgen.conv2d.default") == 4
    assert code.count("torch.ops.convgen.conv_transpose2d.default") == 1
    with torch.no_grad():
        assert _relative(program.module()(x), model(x)) <= 1e-6


def test_every_window_is_prebuilt():
    """The windows these tests compute are compiled up front with the grid, not serially on first use."""
    windows = set(FORWARD_WINDOWS + GRADIENT_WINDOWS)
    cases = [(c, False) for c in CONV_CASES + GRADCHECK_CONV_CASES] + [(c, True) for c in TRANSPOSE_CASES
                                                                         + GRADCHECK_TRANSPOSE_CASES]
    missing = {case.name: case.window(t).short() for case, t in cases if case.window(t) not in windows}
    assert not missing


def _deep_network(memory_format):
    """Four 3×3 convolutions of 64 channels (Winograd's under "auto" in inference) with training-mode
    BatchNorm: where rounding compounds through a training step. SiLU rather than ReLU, whose kink
    would turn a pre-activation rounded across zero into a jump in the gradient (either library's)."""
    torch.manual_seed(5)
    nn = torch.nn
    body = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(64, 64, 3, padding=1, bias=False),
                                                        nn.BatchNorm2d(64), nn.SiLU())])
    stem = nn.Conv2d(3, 64, 3, padding=1)
    return nn.Sequential(stem, body).to(memory_format=memory_format)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_deep_networks_gradients_are_as_accurate_as_pytorchs(fmt):
    """Against the same step in float64: convgen's parameter gradients no further than twice
    PyTorch's distance (‖g − g64‖ / ‖g64‖), because a call whose gradients are wanted runs Winograd
    at F(2×2) only ("auto-training"), where inference takes F(4×4). Measured here (AVX-512 Xeon):
    PyTorch 9.8e-7 contiguous and 1.8e-6 channels_last; convgen 9.7e-7 and 1.2e-6 (the direct
    kernels: 6.9e-7 and 9.9e-7; F(4×4) in both passes 5.6e-6, in the input gradient alone 1.7e-6)."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16).to(memory_format=FORMATS[fmt])
    model = _deep_network(FORMATS[fmt])
    exact = copy.deepcopy(model).double()
    converted = copy.deepcopy(model)
    cgt.convert(converted)

    def gradients(net, images):
        net.zero_grad(set_to_none=True)
        net(images).square().mean().backward()
        return [p.grad.double() for p in net.parameters()]

    want = gradients(exact, x.double())

    def distance(grads):
        return float(sum((g - w).square().sum() for g, w in zip(grads, want)).sqrt()
                     / sum(w.square().sum() for w in want).sqrt())

    library._BOUND.clear()
    torch_error, convgen_error = distance(gradients(model, x)), distance(gradients(converted, x))
    assert convgen_error <= 2 * torch_error, (convgen_error, torch_error)
    (body,) = [bound for bound in library._BOUND.values() if bound.forward_call.problem.conv().c == 64]
    for call in (body.forward_call, body.backward_call):
        assert (call.plan.family, call.plan.spec.tile) == ("winograd", 2)
    library._BOUND.clear()
    converted.eval()
    with torch.inference_mode():
        converted(x)
    (body,) = [bound for bound in library._BOUND.values() if bound.forward_call.problem.conv().c == 64]
    assert (body.forward_call.plan.family, body.forward_call.plan.spec.tile) == ("winograd", 4)
