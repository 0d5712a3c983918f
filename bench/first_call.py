"""How long the first call of a new window waits for its kernels: each case in a fresh process and an
empty kernel cache, the first forward call timed, then the first backward call (conv2d_backward,
which compiles the input and weight gradients' modules side by side); then the same two calls of a
second new window, the padding one larger, which finds the objects the first built in the cache:
the interface objects every module links (the cffi wrapper of its entry points, compiled once per
dtype, build and set of ops) and, for a direct or Winograd module, the core objects (the
window-independent half of its code and its plans, compiled once per dtype, layout and schedule).
What a process pays once before its first kernel (compiling the
templates, asking the compiler what it targets) is timed apart, first. Then a second process on the
cache the first filled times its start (the templates loaded compiled) and its first forward call
of the first window (its module loaded). Writes bench/results/first_call.md.

    python bench/first_call.py [--repeat 3] [--out bench/results/first_call.md] [--cases k3s1p1:NCHW:auto ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peak import cpu_model  # noqa: E402

# (window text, layout, algorithm): the windows the targets name, 3x3 and 5x5 in both layouts. The
# 3x3 stride-1 window runs the Winograd family under "auto"; its direct build is timed too.
CASES = [("k3s1p1", "NCHW", "auto"), ("k3s1p1", "NCHW", "direct"), ("k3s1p1", "NHWC", "auto"),
         ("k3s2p1", "NCHW", "auto"), ("k5s1p2", "NCHW", "auto"), ("k5s3p1", "NHWC", "auto")]

# Run in the child: import convgen, make arrays, time the first forward and backward calls; with
# "cached", in a cache the first child filled, only the process start and the first forward call.
CHILD = r"""
import json, sys, time
import numpy as np
import convgen
from convgen.planning.spec import Window
text, layout, algorithm, mode = sys.argv[1:5]
window = Window.parse(text)
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 16, 20, 20), dtype=np.float32)
w = rng.standard_normal((16, 16) + window.kernel, dtype=np.float32)
if layout == "NHWC":
    x, w = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), np.ascontiguousarray(w.transpose(2, 3, 1, 0))
kw = dict(stride=window.stride, padding=window.padding, layout=layout, algorithm=algorithm)
start = time.perf_counter()
from convgen.codegen.render import render
from convgen.planning.spec import ConvSpec
from convgen.runtime.cache import compiled_templates
render(ConvSpec(None, "float32", layout), convgen.runtime.kernels.settings().schedule(),
       compiled_templates=compiled_templates())  # as the runtime renders
once = time.perf_counter() - start
if mode == "cached":
    start = time.perf_counter()
    convgen.conv2d(x, w, **kw)
    print(json.dumps({"cached_once": once, "cached_forward": time.perf_counter() - start}))
    sys.exit()
def time_first_calls():  # seconds of the first forward and the first backward call of the window in kw
    start = time.perf_counter()
    y = convgen.conv2d(x, w, **kw)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    convgen.conv2d_backward(np.ones_like(y), x, w, **kw)
    return forward, time.perf_counter() - start
forward, backward = time_first_calls()
kw["padding"] = tuple(p + 1 for p in window.padding[0])  # the next window: a new module, the cache warm
next_forward, next_backward = time_first_calls()
print(json.dumps({"once": once, "forward": forward, "backward": backward, "next_forward": next_forward,
                  "next_backward": next_backward}))
"""


def first_calls(text: str, layout: str, algorithm: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        os.chmod(cache, 0o700)
        # the default a user has: a module per op (CONVGEN_MODULES=whole would build all three at once)
        env = dict(os.environ, CONVGEN_CACHE_DIR=cache, CONVGEN_MODULES="per-op")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        times = {}
        for mode in ("fresh", "cached"):
            proc = subprocess.run([sys.executable, "-c", CHILD, text, layout, algorithm, mode], capture_output=True,
                                  text=True, env=env, timeout=600, check=True)
            times.update(json.loads(proc.stdout.splitlines()[-1]))
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per case; the median is kept")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "first_call.md"))
    parser.add_argument("--cases", nargs="+", metavar="WINDOW:LAYOUT:ALGORITHM",
                        help="the cases to time (default: the windows the targets name), e.g. k3s1p1:NHWC:auto")
    args = parser.parse_args(argv)
    cases = [tuple(case.split(":")) for case in args.cases] if args.cases else CASES
    lines = ["# First call of a new window", "",
             f"Each case in a fresh process with an empty kernel cache, {args.repeat} times, medians; x (2, 16, 20, 20), "
             f"16 filters, float32. Process start: what the process pays once before its first kernel (templates "
             f"compiled, the compiler asked what it targets), timed first. The first forward call compiles the forward "
             f"module; the first backward call (conv2d_backward) the input and weight gradients' modules, side by "
             f"side. Next window: the same two calls of a second new window in the same process, the padding one "
             f"larger: its modules link the interface objects the first built (a direct or Winograd one its core objects too). "
             f"Cached: a second process on the cache the first filled (the templates it compiled, its modules), its start "
             f"and its first forward call of the first window. "
             f"CPU: {cpu_model()}, "
             f"{os.cpu_count()} cores.", "",
             "| window | layout | algorithm | process start (s) | first forward (s) | first backward (s) "
             "| next window forward (s) | next window backward (s) | cached: process start (s) | cached: first forward (s) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for text, layout, algorithm in cases:
        runs = [first_calls(text, layout, algorithm) for _ in range(args.repeat)]
        medians = [statistics.median(r[key] for r in runs)
                   for key in ("once", "forward", "backward", "next_forward", "next_backward", "cached_once",
                               "cached_forward")]
        lines.append(f"| {text} | {layout} | {algorithm} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
