"""The `convgen` command line: build kernel sets, render them, compare variants on a layer."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_SPEC_FILE = "kernels.toml"


def _specs_from_file(path):
    from .specfile import load_spec_file
    return load_spec_file(path)


def cmd_build(args) -> int:
    from .kernels import build_all
    specs = _specs_from_file(args.specfile)
    start = time.perf_counter()
    counts = {"built": 0, "cached": 0, "failed": 0}
    failures = []

    def on_done(spec, outcome):
        key = outcome if isinstance(outcome, str) else "failed"
        counts[key] += 1
        if key == "failed":
            failures.append((spec, outcome))
        done = sum(counts.values())
        bar = "#" * (30 * done // len(specs))
        print(f"\r[{bar:<30}] {done}/{len(specs)} {spec.short()} {spec.dtype} {spec.layout}".ljust(78),
              end="", flush=True, file=sys.stderr)

    build_all(specs, jobs=args.jobs, on_done=on_done)
    print(file=sys.stderr)
    for spec, exc in failures:
        print(f"failed: {spec}: {exc}", file=sys.stderr)
    print(f"{len(specs)} kernel modules: {counts['built']} built, {counts['cached']} already cached, "
          f"{counts['failed']} failed ({time.perf_counter() - start:.1f} s)")
    return 1 if failures else 0


def cmd_generate(args) -> int:
    from .kernels import settings
    from .render import render
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    schedule = settings().schedule()
    specs = _specs_from_file(args.specfile)
    for spec in specs:
        rendered = render(spec, schedule)
        path = out / f"conv2d_{spec.short()}_{spec.layout.lower()}_{spec.dtype}.c"
        path.write_text(rendered.source)
    print(f"rendered {len(specs)} kernel modules into {out}/")
    return 0


def cmd_compare(args) -> int:
    from .compare import compare_layer, format_rows
    from .spec import Window
    window = Window.parse(args.spec)
    n, c, h, w, f = args.shape
    print(f"conv2d {window.short()} {args.dtype} NCHW, x ({n}, {c}, {h}, {w}) -> {f} channels")
    print(format_rows(compare_layer(window, n, c, h, w, f, args.dtype, repeat=args.repeat)))
    return 0


def _shape(text: str):
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,C,H,W,F as integers, got {text!r}") from None
    if len(values) != 5 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected five positive integers N,C,H,W,F, got {text!r}")
    return values


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convgen", description="Specialized 2-D convolution kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="build every spec of a kernel-set file",
                       epilog="example: convgen build kernels.toml -j 2")
    p.add_argument("specfile", nargs="?", default=DEFAULT_SPEC_FILE)
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: all cores)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("generate", help="render the C of a kernel-set file without compiling",
                       epilog="example: convgen generate kernels.toml -o generated/")
    p.add_argument("specfile", nargs="?", default=DEFAULT_SPEC_FILE)
    p.add_argument("-o", "--output", default="generated")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("compare", help="time specialized vs generic vs NumPy (and PyTorch) on one layer",
                       epilog="example: convgen compare k3s1p1 --shape 8,64,56,56,64")
    p.add_argument("spec")
    p.add_argument("--shape", type=_shape, required=True, help="N,C,H,W,F")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--repeat", type=int, default=7)
    p.set_defaults(func=cmd_compare)
    return parser


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    return args.func(args)
