"""Specialized against generic (and NumPy, and PyTorch when installed) on one layer, timed side by side."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..planning import planner
from .baselines import numpy_conv2d, torch_module
from ..runtime import wisdom
from ..runtime.kernels import settings
from ..frontend.ops import _numpy_epilogue, conv2d
from ..frontend.resolve import conv_problem
from ..planning.epilogue import NO_EPILOGUE, Epilogue, as_epilogue
from ..planning.spec import Window
from .timing import time_alternating


def _algorithm_text(spec, variant: str = "") -> str:
    """The algorithm of a spec's kernels, and the schedule variant a measured plan runs them with."""
    if spec.family == "winograd":
        return f"winograd F({spec.tile}x{spec.tile})"
    return f"{spec.family}, {variant}" if variant else spec.family


# The activation each epilogue kind is timed with: its parameters (clamp as relu6, leaky_relu's default slope).
_TIMED_ACTIVATION = {"clamp": ("clamp", 0.0, 6.0)}


def _torch_epilogue(torch, epilogue: Epilogue):
    """The epilogue as PyTorch operations after a convolution: f(y, residual) -> y."""
    F = torch.nn.functional
    activate = {"none": lambda t: t, "relu": F.relu, "clamp": F.relu6, "leaky_relu": F.leaky_relu, "silu": F.silu,
                "hardswish": F.hardswish, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
                "sigmoid": torch.sigmoid}[epilogue.activation]
    if epilogue.residual == "before":
        return lambda y, r: activate(y + r)
    if epilogue.residual == "after":
        return lambda y, r: activate(y) + r
    return lambda y, r: activate(y)


def compare_layer(window: Window, n: int, c: int, h: int, w: int, f: int, dtype: str = "float32",
                  repeat: int = 7, with_baselines: bool = True, epilogue: Epilogue = NO_EPILOGUE) -> list[dict]:
    """Time conv2d on one NCHW layer with each implementation; rows in the order timed. With an
    `epilogue` (its kind), every row computes it too: convgen's builds fused in their store, NumPy's
    and PyTorch's as operations after the convolution.

    Each row: name, algorithm, seconds (median per call), gflops (the direct convolution's FLOP
    count over the time: an *effective* rate, which Winograd can push past the FMA peak) and
    speedup (this row's time over the specialized kernel's: > 1 means specialized is faster).
    "convgen specialized" is what `algorithm="auto"` runs; where this machine's wisdom (`convgen
    tune`) made it another plan than the planner's rule, "convgen estimate" times the rule's beside it.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    weight = rng.standard_normal((f, c, *window.kernel)).astype(dtype)
    kw = dict(stride=window.stride, padding=window.padding, dilation=window.dilation, padding_mode=window.padding_mode)
    problem = conv_problem(x.shape, weight.shape, x.dtype, groups=1, layout="NCHW", **kw)
    y = np.empty(problem.output_shape, dtype)
    residual = rng.standard_normal(problem.output_shape).astype(dtype) if epilogue.residual != "none" else None
    fused = dict(activation=_TIMED_ACTIVATION.get(epilogue.activation, epilogue.activation), residual=residual,
                 residual_position="after" if epilogue.residual == "after" else "before")
    epilogue = as_epilogue(fused["activation"], residual is not None, fused["residual_position"])
    problem = dataclasses.replace(problem, epilogue=epilogue)
    active = settings()
    schedule = active.schedule()
    # what "auto" runs: the planner's rule (its estimate), or what `convgen tune` measured (wisdom)
    estimate = planner.plan(problem, True, schedule)
    measured = planner.plan(problem, True, schedule, "auto", wisdom.lookup("conv2d", problem, active))
    chosen = measured.spec
    funcs = {"convgen specialized": (lambda: conv2d(x, weight, **kw, **fused, out=y),
                                     _algorithm_text(chosen, measured.variant))}
    if measured != estimate:  # the rule's plan beside the measured one (the rule's Winograd tile is the schedule's)
        funcs["convgen estimate"] = (lambda: conv2d(x, weight, **kw, **fused, algorithm=estimate.family, out=y),
                                     _algorithm_text(estimate.spec))
    if chosen.family != "direct" and estimate.family != "direct":  # what the algorithm buys over direct
        funcs["convgen spec. direct"] = (lambda: conv2d(x, weight, **kw, **fused, algorithm="direct", out=y),
                                         "direct")
    funcs["convgen generic"] = (lambda: conv2d(x, weight, **kw, **fused, specialize=False, out=y),
                                _algorithm_text(chosen.generic()))
    numpy_epilogue = (lambda out: _numpy_epilogue(out, epilogue, residual)) if epilogue.active else (lambda out: out)
    symmetric = all(a == b for a, b in window.padding)
    if with_baselines and window.dilation == (1, 1) and symmetric:
        pads = (window.padding[0][0], window.padding[1][0])
        mode = window.padding_mode
        if mode == "zeros":
            funcs["numpy im2col+matmul"] = (lambda: numpy_epilogue(numpy_conv2d(x, weight, window.stride, pads)), None)
        else:  # the baselines pad a copy of x first, as torch.nn.Conv2d does for these modes
            numpy_mode = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}[mode]
            funcs["numpy im2col+matmul"] = (lambda: numpy_epilogue(numpy_conv2d(
                np.pad(x, ((0, 0), (0, 0)) + window.padding, mode=numpy_mode), weight, window.stride)), None)
        torch = torch_module()
        if torch is not None:
            tx, tw = torch.from_numpy(x), torch.from_numpy(weight)
            tr = None if residual is None else torch.from_numpy(residual)
            F = torch.nn.functional
            after = _torch_epilogue(torch, epilogue)

            def run_torch():
                with torch.no_grad():
                    if mode == "zeros":
                        out = F.conv2d(tx, tw, stride=window.stride, padding=pads)
                    else:
                        out = F.conv2d(F.pad(tx, (pads[1], pads[1], pads[0], pads[0]), mode=mode), tw,
                                       stride=window.stride)
                    after(out, tr)
            funcs["pytorch"] = (run_torch, None)
    seconds = time_alternating({name: func for name, (func, _) in funcs.items()}, repeat=repeat)
    best = seconds["convgen specialized"]
    return [{"name": name, "algorithm": algorithm or "",
             "seconds": s, "gflops": problem.flops / s / 1e9, "speedup": s / best}
            for (name, (_, algorithm)), s in zip(funcs.items(), seconds.values())]


def _ratio(speedup: float) -> str:
    """How the specialized kernel compares with a row: "1.27x faster" or "1.27x slower", never "0.79x faster"."""
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'implementation':<22} {'algorithm':<18} {'time/call':>11} {'GFLOP/s':>9} {'specialized is':>15}"]
    for row in rows:
        ms = row["seconds"] * 1e3
        ratio = "-" if row["name"] == "convgen specialized" else _ratio(row["speedup"])
        lines.append(f"{row['name']:<22} {row['algorithm']:<18} {ms:>8.3f} ms {row['gflops']:>9.1f} {ratio:>15}")
    lines.append("GFLOP/s: the direct convolution's FLOP count over the time (effective; Winograd does fewer).")
    return "\n".join(lines)
