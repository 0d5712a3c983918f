"""Per-call overhead on the Python side: a tiny convolution through the public op, minus the same
kernel called directly through cffi with prepared pointers (the C work and the cffi call itself);
and, with PyTorch installed, a tiny convolution called from PyTorch through convgen.torch against
PyTorch's own conv2d (forward under inference_mode; forward and backward with autograd).

    python bench/overhead.py [--repeat 7] [--out bench/results/overhead.md]

Targets: at most 10 µs of Python per NumPy call once a spec is loaded; from PyTorch, at most 2× the
time of PyTorch's own call. Medians of alternated runs, as in the bench.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import convgen  # noqa: E402
from convgen.codegen import abi  # noqa: E402
from convgen.frontend import resolve  # noqa: E402
from convgen.planning.spec import ConvSpec  # noqa: E402
from convgen.tools.timing import time_alternating  # noqa: E402


def measure(specialize: bool, repeat: int) -> dict:
    """Median µs per call of each op on a tiny layer, through the op and directly in C."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    w = rng.standard_normal((2, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(2).astype(np.float32)
    kw = dict(padding=1, specialize=specialize)
    y = convgen.conv2d(x, w, b, **kw)
    dy = np.ones_like(y)
    grads = tuple(np.empty_like(a) for a in (x, w, b))
    t = np.empty_like(convgen.conv_transpose2d(y, w, **kw))

    # The kernels called straight through their cffi functions, with the pointers made once and the
    # arguments convgen.codegen.abi declares (what Kernels.call passes).
    problem = resolve.conv_problem(x.shape, w.shape, x.dtype, 1, 1, 1, 1, "NCHW")
    spec = ConvSpec(problem.window if specialize else None, "float32", "NCHW")
    k = convgen.get_kernels(spec)
    args = (*abi.size_arguments(problem, specialize), convgen.num_threads())
    modules = {entry: k.module(entry) for entry in ("fwd", "bwd_data", "bwd_weight")}  # a module per op
    fwd, bwd_data, bwd_weight = (getattr(m.lib, abi.interface_symbol(entry)) for entry, m in modules.items())
    ptr = {name: modules["fwd"].ffi.from_buffer("float[]", a) for name, a in
           dict(x=x, w=w, b=b, y=y, dy=dy, dx=grads[0], dw=grads[1], t=t).items()}
    null = modules["fwd"].ffi.NULL  # no prepared weights: the kernels lay them out on each call, as the ops do
    epilogue = problem.epilogue.arguments  # (none here, but the forward entry takes its parameters)
    funcs = {
        "conv2d": lambda: convgen.conv2d(x, w, b, out=y, **kw),
        "conv2d C only": lambda: fwd(ptr["x"], ptr["w"], null, ptr["b"], null, ptr["y"], *epilogue, *args),
        "conv2d_backward": lambda: convgen.conv2d_backward(dy, x, w, out=grads, **kw),
        "conv2d_backward C only": lambda: (bwd_data(ptr["dy"], ptr["w"], null, ptr["dx"], *args),
                                           bwd_weight(ptr["dy"], ptr["x"], ptr["dw"], *args),
                                           np.sum(dy, axis=(0, 2, 3), out=grads[2])),
        "conv_transpose2d": lambda: convgen.conv_transpose2d(y, w, out=t, **kw),
        "conv_transpose2d C only": lambda: bwd_data(ptr["y"], ptr["w"], null, ptr["t"], *args),
    }
    seconds = time_alternating(funcs, repeat=repeat, min_time=0.05)
    return {name: s * 1e6 for name, s in seconds.items()}


def measure_torch(repeat: int) -> list[str]:
    """Table rows: a 1×8×8×8 → 8, 1×1 convolution from PyTorch, convgen.torch against torch."""
    import torch
    import torch.nn.functional as F

    import convgen.torch as cgt

    rows = []
    for fmt, memory_format in (("contiguous", torch.contiguous_format), ("channels_last", torch.channels_last)):
        x = torch.randn(1, 8, 8, 8).to(memory_format=memory_format)
        w, b = torch.randn(8, 8, 1, 1), torch.randn(8)
        params = ([1, 1], [0, 0, 0, 0], [0, 0], [1, 1], 1, "auto")

        def inference(f):
            def run():
                with torch.inference_mode():
                    f(x, w, b)
            return run

        xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))

        def training(f):
            return lambda: f(xg, wg, bg).sum().backward()

        funcs = {"torch forward": inference(F.conv2d), "convgen forward": inference(cgt.conv2d),
                 "custom op forward": inference(lambda x, w, b: torch.ops.convgen.conv2d(x, w, b, *params)),
                 "torch forward+backward": training(F.conv2d), "convgen forward+backward": training(cgt.conv2d)}
        times = {name: s * 1e6 for name, s in time_alternating(funcs, repeat=repeat, min_time=0.05).items()}
        for what in ("forward", "forward+backward"):
            ratio = times[f"convgen {what}"] / times[f"torch {what}"]
            op = f"{times['custom op forward']:.1f}" if what == "forward" else "–"
            rows.append(f"| {fmt} | {what} | {times[f'torch {what}']:.1f} | {times[f'convgen {what}']:.1f} | "
                        f"{op} | {ratio:.2f}× {'(met)' if ratio <= 2 else '(not met)'} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "overhead.md"))
    args = parser.parse_args(argv)
    from peak import cpu_model
    lines = ["# Per-call overhead (Python side)", "", f"CPU: {cpu_model()}", "",
             "Tiny layer x (1, 2, 4, 4), w (2, 2, 3, 3), k3s1p1, float32, outputs preallocated with out=. "
             "Overhead = the op's median time per call minus the same kernels called directly through cffi "
             f"(median of {args.repeat} alternated samples; {convgen.num_threads()} threads allowed; "
             "calls this small run on one).", "",
             "| op | variant | through the op (µs) | C only (µs) | Python-side overhead (µs) |",
             "| --- | --- | ---: | ---: | ---: |"]
    worst = 0.0
    for specialize in (True, False):
        times = measure(specialize, args.repeat)
        for op in ("conv2d", "conv2d_backward", "conv_transpose2d"):
            overhead = times[op] - times[f"{op} C only"]
            worst = max(worst, overhead)
            lines.append(f"| {op} | {'specialized' if specialize else 'generic'} | {times[op]:.2f} | "
                         f"{times[op + ' C only']:.2f} | {overhead:.2f} |")
    lines += ["", f"Largest overhead: {worst:.2f} µs (target ≤ 10 µs: {'met' if worst <= 10 else 'not met'})."]
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        lines += ["", "## From PyTorch", "",
                  f"x (1, 8, 8, 8) float32, w (8, 8, 1, 1), bias; {torch.get_num_threads()} PyTorch threads. "
                  "Forward under inference_mode; forward+backward: y.sum().backward() with x, w and b requiring "
                  "gradients. convgen: `convgen.torch.conv2d` (an eager call of a signature seen before); custom "
                  "op: `torch.ops.convgen.conv2d`, what a traced graph runs. Medians of "
                  f"{args.repeat} alternated samples, µs per call; target: convgen ≤ 2× torch.", "",
                  "| memory format | call | torch (µs) | convgen (µs) | custom op (µs) | convgen / torch |",
                  "| --- | --- | ---: | ---: | ---: | ---: |", *measure_torch(args.repeat)]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
