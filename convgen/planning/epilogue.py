"""`Epilogue`: what the forward pass does to each output value before it leaves the kernel.

A convolution in an inference graph is followed by work that reads and writes its whole output
again: a per-channel affine (a frozen BatchNorm), an activation, a residual add. The forward kernels
of every family apply that work where they store a block of the output, while the block is in the
caches, instead of a pass of its own over memory:

    y = act(conv(x, w) + bias + residual)      residual="before" (ResNet: add, then activate)
    y = act(conv(x, w) + bias) + residual      residual="after" (an activation, then the skip)

A per-channel scale is folded into the weights by the front end (conv(x, w)·s = conv(x, w·s)), so the
kernels see the shift as the bias. The *kind* of epilogue (which activation, where the residual is
added) is part of a specialized kernel's spec and its text form (`k3s1p1_addrelu`), generated as
straight-line code; the generic build takes it at run time. The activation's numeric parameters
(clamp's bounds, leaky_relu's slope) are always run-time arguments, so a new slope builds nothing.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

import numpy as np

# The activations, in the order of their C ids (ACT_NONE = 0, ...). Each is PyTorch's function of the
# same name: relu, hardtanh's clamp(min, max) (relu6 is clamp(0, 6)), leaky_relu (negative_slope),
# silu, hardswish, gelu (exact, with erf), gelu with approximate="tanh", sigmoid.
ACTIVATIONS = ("none", "relu", "clamp", "leaky_relu", "silu", "hardswish", "gelu", "gelu_tanh", "sigmoid")
# Where the residual is added: nowhere, before the activation, after it. C ids in this order too.
RESIDUALS = ("none", "before", "after")
# The names the API also takes for an activation: relu6 is clamp(0, 6); "gelu_exact" is gelu.
ALIASES = {"relu6": ("clamp", 0.0, 6.0), "hardtanh": ("clamp", -1.0, 1.0), "identity": ("none",),
           "linear": ("none",), "gelu_exact": ("gelu",)}
# Default parameters (alpha, beta) of each activation that takes some (PyTorch's defaults).
DEFAULT_PARAMETERS = {"clamp": (-math.inf, math.inf), "leaky_relu": (0.01, 0.0)}
_PARAMETER_NAMES = {"clamp": ("min", "max"), "leaky_relu": ("negative_slope",)}


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """The work a forward pass does on each output value after the bias: an activation (one of
    ACTIVATIONS, with its parameters alpha and beta: clamp's min and max, leaky_relu's slope in
    alpha) and, where `residual` is "before" or "after", an array shaped as the output added before
    or after the activation. `Epilogue()` does nothing."""

    activation: str = "none"
    residual: str = "none"
    alpha: float = 0.0
    beta: float = 0.0

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {self.activation!r}")
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {', '.join(map(repr, RESIDUALS))}, got {self.residual!r}")
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"the activation's {name} must be a real number, got {value!r}")
            if math.isnan(value):
                raise ValueError(f"the activation's {name} must not be NaN")
            object.__setattr__(self, name, float(value))
        if self.activation == "clamp" and self.alpha > self.beta:
            raise ValueError(f"clamp needs min <= max, got min={self.alpha} and max={self.beta}")
        if self.activation == "none" and self.residual == "after":
            object.__setattr__(self, "residual", "before")  # one add, however it is said: one kernel

    @property
    def active(self) -> bool:
        """Whether it changes anything: an identity epilogue is no epilogue (the kernels skip it)."""
        return self.activation != "none" or self.residual != "none"

    def kind(self) -> "Epilogue":
        """The epilogue without its numeric parameters: what a specialized kernel is generated for."""
        return Epilogue(self.activation, self.residual)

    @property
    def arguments(self) -> tuple[float, float]:
        """The run-time parameters the forward entry point takes: (alpha, beta)."""
        return (self.alpha, self.beta)

    def text(self) -> str:
        """The kind in a spec's text form: "" for none, else the activation's name without its
        underscores, "add" before it when the residual is added first and after it when last:
        "relu", "addrelu", "reluadd", "add", "leakyrelu"."""
        if not self.active:
            return ""
        name = "" if self.activation == "none" else self.activation.replace("_", "")
        return ("add" if self.residual == "before" else "") + name + ("add" if self.residual == "after" else "")

    @classmethod
    def parse(cls, text: str) -> "Epilogue":
        """The epilogue kind whose `text()` is `text` ("" for none)."""
        match = _TEXT.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"cannot read {text!r} as an epilogue: expected e.g. relu, addrelu, reluadd, add, silu")
        before, name, after = match.group("before"), match.group("activation"), match.group("after")
        activation = next(a for a in ACTIVATIONS if a.replace("_", "") == (name or "none"))
        if after and activation == "none":
            raise ValueError(f"cannot read {text!r} as an epilogue: a residual alone is written 'add'")
        return cls(activation, "before" if before else "after" if after else "none")

    def __str__(self) -> str:
        return self.text() or "none"


_ACTIVATION_TEXT = "|".join(sorted((a.replace("_", "") for a in ACTIVATIONS if a != "none"), key=len, reverse=True))
# What `Epilogue.text` writes, for the parsers of spec names and C symbols.
TEXT_PATTERN = rf"(?:add)?(?:{_ACTIVATION_TEXT})(?:add)?|add"
_TEXT = re.compile(rf"(?P<before>add)?(?P<activation>{_ACTIVATION_TEXT})?(?P<after>add)?")

NO_EPILOGUE = Epilogue()


def as_epilogue(activation=None, residual: bool = False, residual_position: str = "before") -> Epilogue:
    """The epilogue of a call's arguments, as the ops take them.

    `activation`: None, a name (ACTIVATIONS or an alias such as "relu6"), or a (name, parameters...)
    tuple: ("leaky_relu", 0.2), ("clamp", min, max). `residual`: whether a residual array is given;
    `residual_position`: "before" (default: add, then activate) or "after" the activation.
    """
    if activation is None:
        activation = "none"
    parameters: tuple = ()
    if isinstance(activation, (tuple, list)) and activation and isinstance(activation[0], str):
        activation, parameters = activation[0], tuple(activation[1:])
    if not isinstance(activation, str):
        raise TypeError(f"activation must be None, a name or a (name, parameters...) tuple, got {activation!r}")
    name = activation.lower()
    if name in ALIASES:
        if parameters:
            raise ValueError(f"activation {activation!r} takes no parameters, got {parameters!r}")
        name, *fixed = ALIASES[name]
        parameters = tuple(fixed)
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS + tuple(ALIASES)))}, "
                         f"got {activation!r}")
    names = _PARAMETER_NAMES.get(name, ())
    if len(parameters) > len(names):
        raise ValueError(f"activation {name!r} takes {len(names) or 'no'} parameter{'s' if len(names) != 1 else ''}"
                         f"{' (' + ', '.join(names) + ')' if names else ''}, got {parameters!r}")
    defaults = DEFAULT_PARAMETERS.get(name, (0.0, 0.0))
    values = [defaults[i] if i >= len(parameters) or parameters[i] is None else parameters[i] for i in range(2)]
    if not isinstance(residual_position, str) or residual_position.lower() not in ("before", "after"):
        raise ValueError(f"residual_position must be 'before' or 'after' (the activation), got {residual_position!r}")
    return Epilogue(name, residual_position.lower() if residual else "none", values[0], values[1])


__all__ = ["Epilogue", "NO_EPILOGUE", "ACTIVATIONS", "RESIDUALS", "ALIASES", "TEXT_PATTERN", "as_epilogue"]
