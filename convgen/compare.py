"""Specialized against generic (and NumPy, and PyTorch when installed) on one layer, timed side by side."""

from __future__ import annotations

import numpy as np

from .baselines import numpy_conv2d, torch_module
from .ops import conv2d
from .spec import Window, conv_flops
from .timing import time_alternating


def compare_layer(window: Window, n: int, c: int, h: int, w: int, f: int, dtype: str = "float32",
                  repeat: int = 7, with_baselines: bool = True) -> list[dict]:
    """Time conv2d on one NCHW layer with each implementation; rows sorted as measured.

    Each row: name, seconds (median per call), gflops, and speedup (the specialized kernel's
    speed relative to this row's: > 1 means specialized is faster).
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    weight = rng.standard_normal((f, c, *window.kernel)).astype(dtype)
    kw = dict(stride=window.stride, padding=window.padding, dilation=window.dilation)
    y = np.empty_like(conv2d(x, weight, **kw))
    funcs = {
        "convgen specialized": lambda: conv2d(x, weight, **kw, out=y),
        "convgen generic": lambda: conv2d(x, weight, **kw, specialize=False, out=y),
    }
    symmetric = all(a == b for a, b in window.padding)
    if with_baselines and window.dilation == (1, 1) and symmetric:
        pads = (window.padding[0][0], window.padding[1][0])
        funcs["numpy im2col+matmul"] = lambda: numpy_conv2d(x, weight, window.stride, pads)
        torch = torch_module()
        if torch is not None:
            tx, tw = torch.from_numpy(x), torch.from_numpy(weight)

            def run_torch():
                with torch.no_grad():
                    torch.nn.functional.conv2d(tx, tw, stride=window.stride, padding=pads)
            funcs["pytorch"] = run_torch
    seconds = time_alternating(funcs, repeat=repeat)
    flops = conv_flops(n, f, c, window.kernel, y.shape[2:])
    best = seconds["convgen specialized"]
    return [{"name": name, "seconds": s, "gflops": flops / s / 1e9, "speedup": s / best}
            for name, s in seconds.items()]


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'implementation':<22} {'time/call':>11} {'GFLOP/s':>9} {'specialized is':>15}"]
    for row in rows:
        ms = row["seconds"] * 1e3
        ratio = "-" if row["name"] == "convgen specialized" else f"{row['speedup']:.2f}x faster"
        lines.append(f"{row['name']:<22} {ms:>8.3f} ms {row['gflops']:>9.1f} {ratio:>15}")
    return "\n".join(lines)
