"""PyTorch's own test inputs for its six convolutions, as plain data (torch 2.13, CPU).

Three of torch's suites (in `torch.testing._internal`) are read:

- `op_db`: the OpInfo entries of nn.functional.conv1d/2d/3d and conv_transpose1d/2d/3d, their
  `sample_inputs` (valid calls) and `error_inputs` (calls torch rejects);
- `module_db`: the `module_inputs_func` inputs of nn.Conv1d/2d/3d and nn.ConvTranspose1d/2d/3d;
- `common_nn`: the module tests of the same layers (`module_tests` and `get_new_module_tests()`).

Each input becomes a `Sample`: NumPy copies of torch's tensors (torch's layout: channels first,
weights (out, in/groups, *kernel), transposed (in, out/groups, *kernel)), the keyword arguments as
the suite spells them and, for a layer, its constructor's positional and keyword arguments exactly
as the suite passes them, with the weight and bias torch initialized. Values are drawn under fixed
seeds, so every run sees the same samples. `Sample.needs` names the convgen features a sample
exercises beyond batched 2-D convolution with zero padding (`CATEGORIES`).
"""

from __future__ import annotations

import dataclasses
import types
import zlib

import numpy as np
import torch
from torch.testing._internal import common_nn
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_modules import module_db

DTYPES = {"float32": torch.float32, "float64": torch.float64}
FUNCTIONAL = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
LAYERS = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")

# What a sample may need beyond batched 2-D zero-padded convolution with keyword arguments.
CATEGORIES = {
    "1d": "conv1d / conv_transpose1d and their layers",
    "3d": "conv3d / conv_transpose3d and their layers",
    "unbatched": "an input without its batch dimension, (C, *spatial)",
    "padding_mode": "a layer's padding_mode other than 'zeros' ('reflect', 'replicate', 'circular')",
    "torch_positional_order": "layer arguments passed by position past kernel_size..bias (Conv) or "
                              "kernel_size..output_padding (ConvTranspose), in torch's order",
}

# torch's positional parameters, after (input, weight, bias) for the functions and after
# (in_channels, out_channels, kernel_size) for the layers.
FUNCTIONAL_POSITIONAL = {
    False: ("stride", "padding", "dilation", "groups"),
    True: ("stride", "padding", "output_padding", "groups", "dilation"),
}
LAYER_POSITIONAL = {
    False: ("stride", "padding", "dilation", "groups", "bias", "padding_mode"),
    True: ("stride", "padding", "output_padding", "groups", "bias", "dilation", "padding_mode"),
}
# The leading positional arguments any layer in torch's spirit takes alike (Conv: through bias;
# ConvTranspose: through output_padding); past them only torch's exact order ("torch_positional_order")
# gives the same layer (dilation after bias in ConvTranspose, padding_mode ninth in Conv).
_ORDER_AGREED = {False: 8, True: 6}


def seed(*key) -> int:
    """A seed from `key`, the same in every run and process (unlike hash() of strings)."""
    return zlib.crc32(repr(key).encode())


def numpy(value):
    """A NumPy copy of a tensor (None stays None)."""
    return None if value is None else value.detach().cpu().resolve_conj().numpy().copy()


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One input of torch's suites.

    op is convgen's name for what runs it: a function ("conv2d", "conv_transpose3d") or a layer
    ("Conv2d", "ConvTranspose1d"). x is torch's input (N, C, *spatial) or unbatched (C, *spatial);
    weight and bias are the function's arguments or the layer's parameters as torch initialized
    them (bias None: none). kwargs are the function's keywords or the layer constructor's, args
    the layer constructor's positional arguments (in_channels first).
    """

    id: str
    suite: str
    op: str
    dtype: str
    x: np.ndarray
    weight: np.ndarray | None
    bias: np.ndarray | None
    kwargs: dict
    args: tuple = ()
    error: str | None = None  # error inputs: what torch says

    @property
    def layer(self) -> bool:
        return self.op[0].isupper()

    @property
    def transposed(self) -> bool:
        return "ranspose" in self.op

    @property
    def dim(self) -> int:
        return int(self.op[-2])

    @property
    def batched(self) -> bool:
        return self.x.ndim == self.dim + 2

    @property
    def layer_arguments(self) -> dict:
        """A layer's constructor arguments by name (torch's order for the positional ones)."""
        names = ("in_channels", "out_channels", "kernel_size") + LAYER_POSITIONAL[self.transposed]
        return dict(zip(names, self.args), **self.kwargs)

    @property
    def needs(self) -> frozenset:
        """The CATEGORIES this sample exercises."""
        needs = set()
        if self.dim != 2:
            needs.add(f"{self.dim}d")
        if not self.batched and self.error is None:
            needs.add("unbatched")
        if self.layer and self.layer_arguments.get("padding_mode", "zeros") != "zeros":
            needs.add("padding_mode")
        if self.layer and len(self.args) > _ORDER_AGREED[self.transposed]:
            needs.add("torch_positional_order")
        return frozenset(needs)

    def by_keyword(self) -> "Sample":
        """This layer sample with every constructor argument after kernel_size passed by keyword
        (torch's names), e.g. Conv2d(2, 3, 3, stride=2, ..., padding_mode='reflect')."""
        arguments = self.layer_arguments
        args = tuple(arguments.pop(name) for name in ("in_channels", "out_channels", "kernel_size"))
        base, dtype = self.id.rsplit("-", 1)
        return dataclasses.replace(self, id=f"{base}-by_keyword-{dtype}", args=args, kwargs=arguments)

    def describe(self) -> str:
        """The sample as a call, e.g. conv2d(x (2, 4, 8, 8) float32, w (2, 2, 3, 3), bias, stride=(3, 2))."""
        def shape(a):
            return "None" if a is None else f"{tuple(a.shape)} {a.dtype}"
        if self.layer:
            call = ", ".join([repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()])
            text = f"{self.op}({call})(x {shape(self.x)})"
        else:
            call = ", ".join([f"x {shape(self.x)}", f"w {shape(self.weight)}", f"bias {shape(self.bias)}"]
                             + [f"{k}={v!r}" for k, v in self.kwargs.items()])
            text = f"{self.op}({call})"
        return f"[{self.suite}] {text}" + (f" -> torch: {self.error!r}" if self.error else "")

    def __str__(self):
        return self.id


# ------------------------------------------------------------------------------------------ op_db
def _opinfos():
    """The six functions' OpInfos, in FUNCTIONAL's order."""
    found = {op.name.split(".")[-1]: op for op in op_db
             if op.name.startswith("nn.functional.") and op.name.split(".")[-1] in FUNCTIONAL}
    missing = set(FUNCTIONAL) - set(found)
    assert not missing, f"torch's op_db has no OpInfo for {sorted(missing)}"
    return [found[name] for name in FUNCTIONAL]


def _functional(suite, name, index, sample_input, dtype, error=None) -> Sample:
    """A Sample from an OpInfo SampleInput: positional arguments past the bias become keywords."""
    args = list(sample_input.args)
    kwargs = dict(sample_input.kwargs)
    weight = args.pop(0) if args else kwargs.pop("weight")
    bias = args.pop(0) if args else kwargs.pop("bias", None)
    kwargs.update(zip(FUNCTIONAL_POSITIONAL["transpose" in name], args))
    tag = "" if sample_input.input.dim() == int(name[-2]) + 2 else "-unbatched"
    sample_id = f"{suite}-{name}-{index:02d}{tag}" + ("" if error is not None else f"-{dtype}")
    return Sample(sample_id, suite, name, dtype, numpy(sample_input.input), numpy(weight), numpy(bias), kwargs,
                  error=error)


def op_db_samples(dtype: str) -> list[Sample]:
    """Every `sample_inputs` of the six functions' OpInfos in `dtype`, on the CPU."""
    samples = []
    for opinfo in _opinfos():
        name = opinfo.name.split(".")[-1]
        torch.manual_seed(seed("op_db", name, dtype))
        for index, sample_input in enumerate(opinfo.sample_inputs("cpu", DTYPES[dtype], requires_grad=False)):
            samples.append(_functional("op_db", name, index, sample_input, dtype))
    return samples


def op_db_error_samples() -> list[Sample]:
    """Every `error_inputs` of the six functions' OpInfos (their dtypes are torch's choice)."""
    samples = []
    for opinfo in _opinfos():
        if opinfo.error_inputs_func is None:
            continue
        name = opinfo.name.split(".")[-1]
        torch.manual_seed(seed("op_db-error", name))
        for index, error_input in enumerate(opinfo.error_inputs("cpu")):
            dtype = str(error_input.sample_input.input.dtype).removeprefix("torch.")
            samples.append(_functional("op_db-error", name, index, error_input.sample_input, dtype,
                                       error=error_input.error_regex))
    return samples


def unsupported_dtype_samples() -> list[Sample]:
    """The first sample of each function in every dtype torch computes on the CPU that NumPy holds
    but convgen does not (float16, complex, integers); its dtype field names that dtype."""
    samples = []
    for opinfo in _opinfos():
        name = opinfo.name.split(".")[-1]
        for dtype in sorted(opinfo.supported_dtypes("cpu"), key=str):
            if dtype in DTYPES.values() or dtype == torch.bfloat16:  # (bfloat16: no NumPy dtype)
                continue
            torch.manual_seed(seed("op_db-dtype", name, str(dtype)))
            first = next(iter(opinfo.sample_inputs("cpu", dtype, requires_grad=False)))
            dname = str(dtype).removeprefix("torch.")
            samples.append(_functional("op_db-dtype", name, 0, first, dname))
    return samples


# ------------------------------------------------------------------------------------ the layers
def _layer(suite, name, cls, args, kwargs, x, dtype) -> Sample:
    """A layer Sample: torch's module built from these arguments (seeded) lends its weight and bias."""
    torch.manual_seed(seed(suite, name, dtype, "weights"))
    module = getattr(torch.nn, cls)(*args, **kwargs, dtype=DTYPES[dtype])
    return Sample(f"{suite}-{name}-{dtype}", suite, cls, dtype, numpy(x), numpy(module.weight), numpy(module.bias),
                  dict(kwargs), tuple(args))


def module_db_samples(dtype: str) -> list[Sample]:
    """Every module_db input of the six layers (their Lazy twins are not convgen's business)."""
    samples = []
    infos = [info for info in module_db if info.module_cls.__name__ in LAYERS]
    missing = set(LAYERS) - {info.module_cls.__name__ for info in infos}
    assert not missing, f"torch's module_db has no ModuleInfo for {sorted(missing)}"
    for info in infos:
        cls = info.module_cls.__name__
        torch.manual_seed(seed("module_db", cls, dtype))
        inputs = info.module_inputs_func(info, device="cpu", dtype=DTYPES[dtype], requires_grad=False,
                                         training=True)
        for index, module_input in enumerate(inputs):
            constructor, forward = module_input.constructor_input, module_input.forward_input
            assert len(forward.args) == 1 and not forward.kwargs, f"{cls} input {index}: one input tensor expected"
            desc = getattr(module_input, "desc", "") or ""
            name = f"{cls}-{index}" + (f"-{desc}" if desc else "")
            samples.append(_layer("module_db", name, cls, constructor.args, constructor.kwargs, forward.args[0],
                                  dtype))
    return samples


class _RecordingNN(types.SimpleNamespace):
    """Stands in for torch.nn inside a common_nn constructor lambda: records the layer and its arguments."""

    def __getattr__(self, cls):
        return lambda *args, **kwargs: (cls, args, kwargs)


def _constructor_call(test: dict) -> tuple[str, tuple, dict]:
    """(layer class, positional args, keyword args) of a common_nn test's constructor."""
    if "constructor" not in test:
        return test["module_name"], tuple(test.get("constructor_args", ())), {}
    fn = test["constructor"]
    recorder = types.FunctionType(fn.__code__, dict(fn.__globals__, nn=_RecordingNN()), fn.__name__,
                                  fn.__defaults__, fn.__closure__)
    call = recorder()
    assert isinstance(call, tuple) and call[0] in LAYERS, f"{test['fullname']}: not a single layer constructor"
    return call


def common_nn_samples(dtype: str) -> list[Sample]:
    """Every common_nn module test of the six layers, with a seeded input of its input_size."""
    samples = []
    for test in common_nn.module_tests + common_nn.get_new_module_tests():
        name = test.get("fullname") or test["module_name"] + (f"_{test['desc']}" if test.get("desc") else "")
        if (test.get("module_name") or name.split("_")[0]) not in LAYERS:
            continue
        cls, args, kwargs = _constructor_call(test)
        torch.manual_seed(seed("common_nn", name, dtype, "input"))
        x = torch.randn(test["input_size"], dtype=DTYPES[dtype])
        samples.append(_layer("common_nn", name, cls, args, kwargs, x, dtype))
    return samples


def all_samples() -> list[Sample]:
    """Every valid float32 and float64 sample of the three suites, and the layer samples that pass
    arguments by position past bias (Conv) or output_padding (ConvTranspose) once more with them by
    keyword, under torch's names."""
    samples = [sample for dtype in DTYPES for sample in
               op_db_samples(dtype) + module_db_samples(dtype) + common_nn_samples(dtype)]
    return samples + [s.by_keyword() for s in samples if "torch_positional_order" in s.needs]


__all__ = ["Sample", "CATEGORIES", "DTYPES", "FUNCTIONAL", "LAYERS", "all_samples", "op_db_samples",
           "op_db_error_samples", "unsupported_dtype_samples", "module_db_samples", "common_nn_samples", "seed"]
