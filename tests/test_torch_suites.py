"""PyTorch's own convolution test inputs, run through convgen and checked against torch itself.

Every float32 and float64 sample of torch 2.13's suites for its six convolutions (`torch_samples`:
the OpInfo `sample_inputs` of nn.functional.conv1d/2d/3d and conv_transpose1d/2d/3d, the
`module_db` inputs and the `common_nn` module tests of nn.Conv1d/2d/3d and nn.ConvTranspose1d/2d/3d)
is run through convgen — the ops for the functional samples, convgen's layers (built with the same
positional and keyword arguments, torch's weight and bias copied in) for the module samples — and
its output, input gradient, weight gradient and bias gradient are compared with torch autograd on
the same values (relative to the largest expected magnitude: 2e-5 in float32, 1e-12 in float64).
Each sample runs in these variants:

- the generic build in both layouts (channels first, and channels last with convgen's weight
  conventions: (*kernel, in/groups, out), transposed (*kernel, out/groups, in)), on contiguous
  arrays and on non-contiguous views of the same values;
- the specialized build, contiguous and not: for most windows in one dtype and one layout (the
  four combinations taken in turn from window to window), for one window in six (a fixed subset,
  by the window's geometry) in both layouts for both dtypes. Every window then compiles one
  specialized module, one in six four. The kernel builds, not the calls, are what this file costs:
  about 90 modules beyond those the other tests build; on the shared two-core machine it measured
  2 min 15 s with only those built (most of it compiling) and 40 s with its own built too.

torch's `error_inputs` must be refused by convgen with ValueError or TypeError before any kernel is
built (the calls run with a cache that cannot compile); where convgen deliberately computes what
torch refuses, `EXTENSIONS` says why and the test checks what it computes. Every other dtype torch
convolves on the CPU that NumPy holds (float16, complex, int64) must be refused with a TypeError
naming it (bfloat16 has no NumPy dtype).

Samples that exercise a feature convgen does not have yet fail, with the feature named. While such a
feature is on its way, its category is in `PENDING` and those samples are expected to fail
(strict xfail: once the feature works, they pass and the run fails until it is taken out of
`PENDING`). The test ids name the suite, the op or layer, the sample and the dtype.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import convgen
from torch_samples import (CATEGORIES, DTYPES, FUNCTIONAL, LAYERS, all_samples, op_db_error_samples, seed,
                           unsupported_dtype_samples)

# Categories of samples (torch_samples.CATEGORIES) whose convgen feature has not landed yet: their
# tests are strict xfails. Empty it as the features arrive; nothing else may skip or expect a failure.
PENDING = set()

# Where each category's feature comes from (for the messages).
PROVIDER = {"1d": "1-D ops and layers", "3d": "3-D ops and layers", "unbatched": "unbatched inputs",
            "padding_mode": "padding_mode on the ops and layers",
            "torch_positional_order": "layers taking torch's positional order"}

# torch error inputs that convgen computes on purpose: sample id -> why.
EXTENSIONS = {
    "op_db-error-conv3d-09": "padding='same' with stride > 1: convgen follows TensorFlow (output size "
                             "ceil(input / stride), the odd pad after); torch refuses strided 'same'",
}

TOLERANCE = {"float32": 2e-5, "float64": 1e-12}
LAYOUTS = {1: ("NCL", "NLC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}
FULL_MATRIX_EVERY = 6  # one window in 6 is specialized in both layouts for both dtypes, the others in one of:
SPECIALIZED = (("float64", 0), ("float32", 1), ("float32", 0), ("float64", 1))  # (dtype, index in LAYOUTS)

# torch's note that its own "same" padding of an even kernel copies the input: nothing to act on here.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")

SAMPLES = all_samples()
ERROR_SAMPLES = op_db_error_samples()
DTYPE_SAMPLES = unsupported_dtype_samples()


def pending_marks(needs):
    """A strict xfail for a sample that needs a PENDING category, else nothing."""
    pending = sorted(set(needs) & PENDING)
    if not pending:
        return ()
    return (pytest.mark.xfail(strict=True, reason="PENDING: " + "; ".join(f"{c} ({PROVIDER[c]})" for c in pending)),)


def params(samples):
    return [pytest.param(s, id=s.id, marks=pending_marks(s.needs)) for s in samples]


# ---------------------------------------------------------------------------------------- layouts
def channels_last(image, batched=True):
    """An image (batch) moved from (N, C, *spatial) to (N, *spatial, C); unbatched (C, *s) to (*s, C)."""
    axis = 1 if batched else 0
    return np.moveaxis(image, axis, -1)


def weight_last(weight):
    """A weight moved from torch's (A, B, *kernel) to convgen's channels-last (*kernel, B, A)."""
    return np.transpose(weight, tuple(range(2, weight.ndim)) + (1, 0))


def in_layout(sample, layout, image=None, weight=None):
    """`image` or `weight` (torch's layout) in `layout`, as a contiguous array."""
    last = layout == LAYOUTS[sample.dim][1]
    if image is not None:
        return np.ascontiguousarray(channels_last(image, image.ndim == sample.dim + 2) if last else image)
    return np.ascontiguousarray(weight_last(weight) if last else weight)


def strided(array):
    """The same values as a non-contiguous view: every other element of a twice as long last axis."""
    if array is None:
        return None
    base = np.full(array.shape[:-1] + (2 * array.shape[-1],), np.nan, dtype=array.dtype)
    view = base[..., ::2]
    view[...] = array
    return view


def window_of(sample):
    """The window `sample` convolves with, as torch states it (kernel, stride, padding, dilation per
    axis, the padding mode; the input size where padding is a string): samples that share it share
    the kernels they compile."""
    arguments = sample.layer_arguments if sample.layer else sample.kwargs

    def per_axis(value):
        value = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        return value * sample.dim if len(value) == 1 else value

    padding = arguments.get("padding", 0)
    padding = (padding, sample.x.shape[-sample.dim:]) if isinstance(padding, str) else per_axis(padding)
    return (sample.weight.shape[2:], per_axis(arguments.get("stride", 1)), padding,
            per_axis(arguments.get("dilation", 1)), arguments.get("padding_mode", "zeros"))


def variants(sample):
    """(layout, specialize, contiguous) of every run of `sample` (see the module docstring)."""
    key = seed(*window_of(sample))
    layouts = LAYOUTS[sample.dim]
    if key % FULL_MATRIX_EVERY == 0:
        specialized = layouts
    else:  # the window's one specialized (dtype, layout), cycling through the four over windows
        dtype, layout = SPECIALIZED[key % len(SPECIALIZED)]
        specialized = (layouts[layout],) if sample.dtype == dtype else ()
    return [(layout, specialize, contiguous)
            for layout in layouts for specialize in (True, False) for contiguous in (True, False)
            if not specialize or layout in specialized]


# ------------------------------------------------------------------------------------ torch's side
def torch_reference(sample):
    """torch's (y, dy, dx, dw, db) for `sample` in its layout: autograd of sum(y * dy), dy seeded.

    db is the bias gradient, or dy summed over batch and space where there is no bias (what convgen's
    backward ops return as db either way)."""
    dtype = DTYPES[sample.dtype]
    x = torch.tensor(sample.x, requires_grad=True)
    if sample.layer:
        module = getattr(torch.nn, sample.op)(*sample.args, **sample.kwargs, dtype=dtype)
        with torch.no_grad():
            module.weight.copy_(torch.tensor(sample.weight))
            if sample.bias is not None:
                module.bias.copy_(torch.tensor(sample.bias))
        w, b = module.weight, module.bias
        y = module(x)
    else:
        w = torch.tensor(sample.weight, requires_grad=True)
        b = None if sample.bias is None else torch.tensor(sample.bias, requires_grad=True)
        y = getattr(torch.nn.functional, sample.op)(x, w, b, **sample.kwargs)
    dy = np.random.default_rng(seed(sample.id, "dy")).standard_normal(tuple(y.shape)).astype(sample.dtype)
    y.backward(torch.tensor(dy))
    grads = [np.zeros_like(t.detach().numpy()) if t.grad is None else t.grad.numpy() for t in (x, w)]
    channel = 1 if sample.batched else 0
    db = (b.grad.numpy() if b is not None and b.grad is not None
          else dy.sum(axis=tuple(a for a in range(dy.ndim) if a != channel)))
    return y.detach().numpy(), dy, grads[0], grads[1], db


# ---------------------------------------------------------------------------------- convgen's side
def run_convgen(sample, layout, specialize, contiguous, dy):
    """convgen's (y, dx, dw, db) for `sample` in `layout`, given dy in `layout`; inputs checked unchanged.

    db is None for a layer without bias."""
    prepare = (lambda a: a) if contiguous else strided
    x = prepare(in_layout(sample, layout, image=sample.x))
    w = prepare(in_layout(sample, layout, weight=sample.weight))
    bias = prepare(sample.bias)
    dy = prepare(dy)
    given = [(name, a, np.copy(a)) for name, a in (("x", x), ("w", w), ("bias", bias), ("dy", dy)) if a is not None]
    if sample.layer:
        layer = getattr(convgen, sample.op)(*sample.args, **sample.kwargs, dtype=np.dtype(sample.dtype),
                                            layout=layout, specialize=specialize)
        assert layer.weight.shape == w.shape, (f"the layer's weight has shape {layer.weight.shape}, torch's "
                                               f"in {layout} is {w.shape}")
        assert (layer.bias is None) == (bias is None), f"layer bias {layer.bias!r}, torch's {sample.bias!r}"
        layer.weight[...] = w
        if bias is not None:
            layer.bias[...] = bias
        y = layer(x)
        dx = layer.backward(dy)
        dw, db = layer.dw, layer.db
    else:
        kwargs = dict(sample.kwargs, layout=layout, specialize=specialize)
        y = getattr(convgen, sample.op)(x, w, bias, **kwargs)
        dx, dw, db = getattr(convgen, sample.op + "_backward")(dy, x, w, **kwargs)
    for name, array, copy in given:
        assert np.array_equal(array, copy, equal_nan=True), f"convgen modified its argument {name}"
    return y, dx, dw, db


def mismatch(name, actual, expected, dtype):
    """Why `actual` does not agree with torch's `expected` (None if it does)."""
    if not isinstance(actual, np.ndarray):
        return f"{name} is {type(actual).__name__}, expected an array {expected.shape}"
    if actual.shape != expected.shape or actual.dtype != np.dtype(dtype):
        return f"{name} has shape {actual.shape} {actual.dtype}, torch's is {expected.shape} {dtype}"
    if expected.size == 0:
        return None
    scale = max(float(np.abs(expected).max()), 1e-30)
    error = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()) / scale
    if not error <= TOLERANCE[dtype]:
        return f"{name} differs from torch's by {error:.3g} of its largest magnitude (tolerance {TOLERANCE[dtype]})"
    return None


# ----------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module", autouse=True)
def warm_kernels(request):
    """Compile the specialized kernels the selected samples use on all cores at once: the first call
    of each, in threads (builds of different specs run in parallel). Errors are left to the tests."""
    import concurrent.futures

    selected = [item.callspec.params["sample"] for item in request.session.items
                if item.module is request.module and item.originalname == "test_sample"]
    jobs = {(s.op, s.dtype, layout, s.x.shape[-s.dim:], s.weight.shape, repr(s.args), repr(s.kwargs)): (s, layout)
            for s in selected if not s.needs & PENDING for layout, specialize, _ in variants(s) if specialize}

    def first_call(job):
        sample, layout = job
        try:
            run_convgen(sample, layout, True, True, np.zeros(1, sample.dtype))  # (the backward fails: no matter)
        except Exception:  # noqa: BLE001 - the test of this sample says what went wrong
            pass

    with concurrent.futures.ThreadPoolExecutor(max_workers=convgen.num_threads()) as pool:
        list(pool.map(first_call, jobs.values()))


@pytest.mark.parametrize("sample", params(SAMPLES))
def test_sample(sample):
    """Forward and the three gradients of one torch sample agree with torch in every variant."""
    y, dy, dx, dw, db = torch_reference(sample)
    failures = []
    for layout, specialize, contiguous in variants(sample):
        variant = f"{layout} {'specialized' if specialize else 'generic'} {'contiguous' if contiguous else 'strided'}"
        try:
            got = run_convgen(sample, layout, specialize, contiguous, in_layout(sample, layout, image=dy))
        except Exception as exc:  # noqa: BLE001 - reported with the variant and the sample below
            failures.append(f"{variant}: {type(exc).__name__}: {exc}")
            continue
        expected = [in_layout(sample, layout, image=y), in_layout(sample, layout, image=dx),
                    in_layout(sample, layout, weight=dw), db]
        for name, actual, want in zip(("y", "dx", "dw", "db"), got, expected):
            if name == "db" and sample.layer and sample.bias is None:
                problem = None if actual is None else f"db is {type(actual).__name__}, expected None (no bias)"
            else:
                problem = mismatch(name, actual, want, sample.dtype)
            if problem:
                failures.append(f"{variant}: {problem}")
    if failures:
        needs = ", ".join(sorted(sample.needs)) or "nothing beyond batched 2-D convolution"
        pytest.fail(f"{sample.describe()}\n  exercises: {needs}\n  " + "\n  ".join(dict.fromkeys(failures)),
                    pytrace=False)


@pytest.fixture
def no_kernels(tmp_path, monkeypatch):
    """Any kernel load fails with BuildError: an empty cache and a flag no compiler accepts."""
    cache = tmp_path / "empty-cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(cache))
    with convgen.configure(cflags=("--no-such-flag-convgen-must-not-compile",)):
        yield
    assert not any(cache.glob("*.so")), "a kernel was built"


def torch_call(sample):
    """torch's op on the sample's arrays."""
    tensors = [None if a is None else torch.tensor(a) for a in (sample.x, sample.weight, sample.bias)]
    return getattr(torch.nn.functional, sample.op)(*tensors, **sample.kwargs)


@pytest.mark.parametrize("sample", params([s for s in ERROR_SAMPLES if s.id not in EXTENSIONS]))
@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
def test_error_input(sample, specialize, no_kernels):
    """torch's error inputs: torch refuses them, and convgen refuses them with ValueError or TypeError
    before it builds or runs anything."""
    with pytest.raises(RuntimeError, match=sample.error):
        torch_call(sample)
    op = getattr(convgen, sample.op)
    try:
        result = op(sample.x, sample.weight, sample.bias, specialize=specialize, **sample.kwargs)
    except (ValueError, TypeError) as exc:
        assert str(exc), "the error has no message"
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{sample.describe()}\n  convgen raised {type(exc).__name__}: {exc}", pytrace=False)
    else:
        pytest.fail(f"{sample.describe()}\n  convgen returned an array of shape {np.shape(result)}", pytrace=False)


@pytest.mark.parametrize("sample", params([s for s in ERROR_SAMPLES if s.id in EXTENSIONS]))
def test_extension(sample):
    """A torch error input convgen computes on purpose (EXTENSIONS): strided padding='same' agrees with
    torch's convolution of the input padded by TensorFlow's rule."""
    assert "same" in EXTENSIONS[sample.id] and sample.kwargs.get("padding") == "same"
    with pytest.raises(RuntimeError, match=sample.error):
        torch_call(sample)
    stride = sample.kwargs["stride"]
    spatial, kernel = sample.x.shape[2:], sample.weight.shape[2:]
    pads = []
    for n, k in zip(spatial, kernel):  # TensorFlow: output ceil(n / s), the odd pad after
        total = max((-(-n // stride) - 1) * stride + k - n, 0)
        pads.append((total // 2, total - total // 2))
    padded = torch.nn.functional.pad(torch.tensor(sample.x), [p for pair in reversed(pads) for p in pair])
    kwargs = {k: v for k, v in sample.kwargs.items() if k != "padding"}
    expected = getattr(torch.nn.functional, sample.op)(padded, torch.tensor(sample.weight),
                                                       torch.tensor(sample.bias), **kwargs).numpy()
    for specialize in (True, False):
        got = getattr(convgen, sample.op)(sample.x, sample.weight, sample.bias, specialize=specialize,
                                          **sample.kwargs)
        problem = mismatch("y", got, expected, "float64")
        assert problem is None, f"{sample.describe()}: {problem}"


@pytest.mark.parametrize("sample", params(DTYPE_SAMPLES))
def test_unsupported_dtype_refused(sample):
    """A dtype torch convolves but convgen does not is refused with a TypeError that names it."""
    op = getattr(convgen, sample.op)
    with pytest.raises(TypeError, match=re.escape(sample.dtype)):
        op(sample.x, sample.weight, sample.bias, **sample.kwargs)


# Sequence lengths: torch takes an int, one value per axis, or a 1-sequence for every axis.
ONE_FOR_EVERY_AXIS = [
    ("conv2d", dict(stride=(2,), padding=(1,), dilation=[2])),
    ("conv_transpose2d", dict(stride=[2], padding=(1,), output_padding=(1,), dilation=(1,))),
    ("Conv2d", dict(stride=(2,), padding=[1], dilation=(2,))),
    ("ConvTranspose2d", dict(stride=(2,), padding=(1,), output_padding=[1])),
]
WRONG_LENGTHS = [
    ("conv2d", dict(stride=(2, 1, 1))), ("conv2d", dict(padding=())), ("conv2d", dict(dilation=[1, 1, 1])),
    ("conv_transpose2d", dict(stride=2, output_padding=(1, 1, 1))), ("Conv2d", dict(stride=())),
]


@pytest.mark.parametrize("op, kwargs", ONE_FOR_EVERY_AXIS, ids=[op for op, _ in ONE_FOR_EVERY_AXIS])
def test_one_value_for_every_axis(op, kwargs):
    """stride=(2,) means stride 2 on both axes, as in torch (functions and layers, float64 NCHW)."""
    rng = np.random.default_rng(seed(op, "one-for-every-axis"))
    x = rng.standard_normal((2, 2, 7, 6))
    transposed = "ranspose" in op
    if op[0].isupper():
        module = getattr(torch.nn, op)(2, 3, 3, **kwargs, dtype=torch.float64)
        layer = getattr(convgen, op)(2, 3, 3, **kwargs, dtype=np.float64)
        layer.weight[...] = module.weight.detach().numpy()
        layer.bias[...] = module.bias.detach().numpy()
        expected, got = module(torch.tensor(x)).detach().numpy(), layer(x)
    else:
        w = rng.standard_normal((2, 3, 3, 3) if transposed else (3, 2, 3, 3))
        expected = getattr(torch.nn.functional, op)(torch.tensor(x), torch.tensor(w), **kwargs).numpy()
        got = getattr(convgen, op)(x, w, **kwargs)
    assert mismatch("y", got, expected, "float64") is None, mismatch("y", got, expected, "float64")


@pytest.mark.parametrize("op, kwargs", WRONG_LENGTHS, ids=[f"{op}-{next(iter(kw))}" for op, kw in WRONG_LENGTHS])
def test_lengths_torch_refuses(op, kwargs):
    """A sequence of neither one value nor one per axis: torch refuses it, convgen with a ValueError."""
    x, w = np.ones((1, 2, 7, 6)), np.ones((2, 2, 3, 3))
    with pytest.raises(RuntimeError):
        if op[0].isupper():
            getattr(torch.nn, op)(2, 2, 3, **kwargs, dtype=torch.float64)(torch.tensor(x))
        else:
            getattr(torch.nn.functional, op)(torch.tensor(x), torch.tensor(w), **kwargs)
    name = next(iter(kwargs)) if op != "conv_transpose2d" else "output_padding"
    with pytest.raises(ValueError, match=name):
        if op[0].isupper():
            getattr(convgen, op)(2, 2, 3, **kwargs)
        else:
            getattr(convgen, op)(x, w, **kwargs)


def test_every_suite_is_read():
    """The enumeration found what torch 2.13 has: every function in op_db with samples in both dtypes
    and error inputs for the three convolutions, every layer in module_db and common_nn, and samples
    of every category; no id twice."""
    found = {(s.suite, s.op, s.dtype) for s in SAMPLES}
    for dtype in DTYPES:
        assert all(("op_db", op, dtype) in found for op in FUNCTIONAL)
        assert all(("module_db", layer, dtype) in found for layer in LAYERS)
        assert all(("common_nn", layer, dtype) in found for layer in LAYERS)
    assert {s.op for s in ERROR_SAMPLES} == {"conv1d", "conv2d", "conv3d"}
    assert {s.dtype for s in DTYPE_SAMPLES} >= {"float16", "complex64", "complex128"}
    assert set().union(*(s.needs for s in SAMPLES)) == set(CATEGORIES)
    assert PENDING <= set(CATEGORIES) and set(EXTENSIONS) <= {s.id for s in ERROR_SAMPLES}
    ids = [s.id for s in SAMPLES + ERROR_SAMPLES + DTYPE_SAMPLES]
    assert len(ids) == len(set(ids))
