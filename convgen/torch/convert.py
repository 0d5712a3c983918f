"""`convert(model)`: swap a model's PyTorch convolutions for their convgen twins, and say what happened.

A module is swapped when its type is exactly one of `TWINS`' keys and convgen computes it: float32
or float64 weights on the CPU (any padding_mode), no hooks, no parametrization, nothing but its
weight and bias. The twin holds the very same Parameter objects (an optimizer built before the swap
keeps working) and the same training flag; everything else in the model is left alone. The weights
of a channels_last model are laid out at once in the memory order convgen's channels-last kernels
read (`convgen.torch.modules`), so that DistributedDataParallel, built after the conversion, records
the strides they keep.
"""

from __future__ import annotations

import dataclasses

import torch

from .library import DTYPES, KINDS, relay_weight, weight_in_layout
from .modules import TWINS

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@dataclasses.dataclass(frozen=True)
class Swapped:
    name: str      # the module's qualified name in the model ("" for the model itself)
    module: torch.nn.Module  # the convgen twin now in its place


@dataclasses.dataclass(frozen=True)
class Left:
    name: str
    module: torch.nn.Module  # the convolution left in place
    reason: str


@dataclasses.dataclass
class ConvertReport:
    """What `convert` did: `model` (the model, or the twin when the model itself was a convolution),
    `swapped` and `left` (every convolution module kept, with the reason); `print` shows them."""

    model: torch.nn.Module
    swapped: list[Swapped] = dataclasses.field(default_factory=list)
    left: list[Left] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"convgen.torch.convert: {len(self.swapped)} swapped, {len(self.left)} left"]
        lines += [f"  swapped  {entry.name or '(model)'}: {entry.module!r}" for entry in self.swapped]
        lines += [f"  left     {entry.name or '(model)'}: {type(entry.module).__name__}: {entry.reason}"
                  for entry in self.left]
        return "\n".join(lines)


def weights_refusal(module: torch.nn.Module, replacement: str) -> str | None:
    """Why convgen cannot take over a convolution module's weights as they are (their dtype or device,
    hooks that `replacement`, "a swap" or "fusing", would drop), or None."""
    if module.weight.dtype not in DTYPES:
        return f"dtype {module.weight.dtype}: convgen computes float32 and float64"
    if module.weight.device.type != "cpu":
        return f"on device {module.weight.device}: convgen runs on the CPU"
    if any(getattr(module, hooks, None) for hooks in _HOOKS):
        return f"has forward or backward hooks (old-style weight_norm is one), which {replacement} would drop"
    return None


def _reason_to_leave(module: torch.nn.Module) -> str | None:
    """Why a convolution module cannot be swapped, or None if it can."""
    if isinstance(module, tuple(TWINS.values())):
        return "already computed by convgen"
    if type(module) not in TWINS:
        if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            return "a lazy module whose parameters do not exist yet (run one forward pass first)"
        if torch.nn.utils.parametrize.is_parametrized(module):
            return "parametrized (e.g. weight_norm, spectral_norm): its weight is computed on each call"
        for base in TWINS:
            if isinstance(module, base):
                return f"a subclass of torch.nn.{base.__name__}, whose forward may differ"
        return f"convgen computes {', '.join(base.__name__ for base in TWINS)}, not {type(module).__name__}"
    refusal = weights_refusal(module, "a swap")
    if refusal is not None:
        return refusal
    extra = sorted(set(module._parameters) - {"weight", "bias"}) + sorted(module._buffers)
    if extra:
        return f"holds more than a weight and a bias ({', '.join(extra)})"
    return None


def _channels_last_weight(weight: torch.Tensor) -> bool:
    """Whether `Module.to(memory_format=torch.channels_last)` laid out these weights (and not only
    that they have a single pixel or channel, which both layouts share)."""
    return weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()


def _lay_out(twins: list[torch.nn.Module], memory_format) -> None:
    """Lay the twins' weights out for inputs of `memory_format` (None: channels_last when some weight
    of theirs is, as after `model.to(memory_format=torch.channels_last)`, else as they lie)."""
    if memory_format is None:
        if not any(_channels_last_weight(twin.weight) for twin in twins):
            return
        memory_format = torch.channels_last
    for twin in twins:
        kind = KINDS[twin.kind_name]
        if not weight_in_layout(kind, twin.weight, memory_format is torch.channels_last):
            relay_weight(kind, twin.weight, memory_format is torch.channels_last)


def _twin(module: torch.nn.Module) -> torch.nn.Module:
    """The convgen twin of a PyTorch convolution, holding the same Parameter objects."""
    kwargs = dict(kernel_size=module.kernel_size, stride=module.stride, padding=module.padding,
                  dilation=module.dilation, groups=module.groups, bias=module.bias is not None,
                  padding_mode=module.padding_mode)
    if module.transposed:
        kwargs["output_padding"] = module.output_padding
    # Built on the meta device: its own initial weights cost nothing and are replaced at once.
    twin = TWINS[type(module)](module.in_channels, module.out_channels, **kwargs, device="meta",
                               dtype=module.weight.dtype)
    twin.weight = module.weight
    if module.bias is not None:
        twin.bias = module.bias
    twin.train(module.training)
    return twin


def convert(model: torch.nn.Module, *, memory_format=None) -> ConvertReport:
    """Swap, in place, every convolution of `model` that convgen computes for its convgen twin.

    Returns a `ConvertReport`: what was swapped and every convolution left in place with the reason.
    The Parameters are shared, not copied. A module reachable by several names is swapped once and
    replaced under all of them. When `model` is itself a convolution it cannot be replaced in place:
    use `report.model`.

    memory_format : the layout of the inputs the model will run on, torch.channels_last or
        torch.contiguous_format, for which its convgen modules' weights are laid out now (their
        memory, not their shape or values: see `convgen.torch.modules`). None (the default): channels_last
        when a weight already is (after `model.to(memory_format=torch.channels_last)`), else as they lie.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if memory_format is not None and memory_format not in (torch.channels_last, torch.contiguous_format):
        raise ValueError(f"memory_format must be torch.channels_last, torch.contiguous_format or None, "
                         f"got {memory_format!r}")
    report = ConvertReport(model)
    decided = {}  # id(module) -> its twin, or itself when left

    def decide(name, module):
        if id(module) not in decided:
            reason = _reason_to_leave(module)
            if reason is None:
                decided[id(module)] = _twin(module)
                report.swapped.append(Swapped(name, decided[id(module)]))
            else:
                decided[id(module)] = module
                report.left.append(Left(name, module, reason))
        return decided[id(module)]

    def visit(parent, prefix):
        for name, child in list(parent.named_children()):
            qualified = f"{prefix}.{name}" if prefix else name
            if isinstance(child, torch.nn.modules.conv._ConvNd):
                replacement = decide(qualified, child)
                if replacement is not child:
                    setattr(parent, name, replacement)
            elif id(child) not in decided:
                decided[id(child)] = child
                visit(child, qualified)

    if isinstance(model, torch.nn.modules.conv._ConvNd):
        report.model = decide("", model)
    else:
        visit(model, "")
    _lay_out([m for m in report.model.modules() if isinstance(m, tuple(TWINS.values()))], memory_format)
    return report


__all__ = ["convert", "ConvertReport", "Swapped", "Left"]
