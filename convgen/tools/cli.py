"""The `convgen` command line: build kernel sets, read and export their C, compare variants, tune
`auto` (wisdom), manage the cache.

Every command reads a kernel spec in the compact window text of `Window.parse` ("k3s2p1",
"k7s2p3d1", "k3x5s1p1x2", "k3s1p1reflect"), with --dtype and --layout beside it. The layout sets the rank: a 1-D
(--layout NCL/NLC) or 3-D (NCDHW/NDHWC, or a window such as k3x3x3s1p1) spec names the 2-D kernel
module that runs it (`convgen.planning.ndspec`). Exit codes: 0 success, 1 failure,
2 usage error. Errors are one line on stderr ("convgen: error: ..."); --verbose adds the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import sys
import time
import traceback
from pathlib import Path

from .._version import __version__
from ..codegen import abi
from ..planning.schedule import ISAS
from ..planning.ndspec import LAYOUTS as LAYOUTS_BY_RANK, RANK_OF_LAYOUT, NdWindow, lowered_spec, window_rank
from ..planning.spec import DTYPES, WINOGRAD_TILES, WINOGRAD_WINDOW_TEXT, ConvSpec, Window, winograd_computes

LAYOUTS = tuple(layout for rank in (2, 1, 3) for layout in LAYOUTS_BY_RANK[rank])

DEFAULT_SPEC_FILE = "kernels.toml"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# Which entry points `show --op` prints. A transposed convolution runs conv2d's input-gradient kernel.
OP_ENTRIES = {"forward": ("fwd",), "backward": ("bwd_data", "bwd_weight"), "transpose": ("bwd_data",)}
_OP_TITLES = {
    "forward": "the forward convolution",
    "backward": "the input and weight gradients",
    "transpose": "the transposed convolution (conv2d's input gradient, col2im of W^T x)",
}


class UsageError(Exception):
    """Arguments that parse but do not make sense together (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line, pointing at the command's --help."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"convgen: error: {message} (see '{self.prog} --help')\n")


# ----------------------------------------------------------------------------------- argument types
def _spec_text(text: str) -> str:
    """A window such as k3s2p1 or k3x3x3s1p1, or "generic"; checked here so that a typo is a usage error."""
    try:
        if window_rank(text) == 3:
            NdWindow.parse(text)
        else:
            ConvSpec.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _layout(args) -> str:
    """--layout, or by default NCDHW for a window with three values and NCHW for the rest."""
    if args.layout is not None:
        return args.layout
    return "NCDHW" if window_rank(args.spec) == 3 else "NCHW"


def _lowering_note(args) -> str:
    """For a 1-D or 3-D spec: which 2-D module runs it, as a C comment; "" for a 2-D one."""
    layout = _layout(args)
    rank = RANK_OF_LAYOUT[layout]
    if rank == 2 or args.generic or args.spec.strip().lower() == "generic":
        return "" if rank == 2 else f"/* {layout}: the generic 2-D build runs every {rank}-D window. */\n"
    window = NdWindow.parse(args.spec, rank)
    planar = window.lower()[1].short()
    how = ("with a unit height axis" if rank == 1 else
           "with the depth taps folded into the channels (convgen/frontend/depthfold.py)")
    return (f"/* {window.short()} {layout}: a {rank}-D window runs on the 2-D kernels of {planar}, {how}; "
            f"this is that module. */\n")


def _window(text: str) -> Window:
    try:
        return Window.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _window_and_epilogue(text: str) -> ConvSpec:
    """A 2-D window, with an epilogue after it or not ("k3s1p1", "k3s1p1_addrelu"), as a spec."""
    try:
        spec = ConvSpec.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not spec.specialized:
        raise argparse.ArgumentTypeError("compare times a window's builds against each other: give a window "
                                         "such as k3s1p1, not 'generic'")
    return spec


def _shape(text: str):
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape expects N,C,H,W,F as integers, got {text!r}") from None
    if len(values) != 5 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--shape expects five positive integers N,C,H,W,F, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _label(spec: ConvSpec) -> str:
    """A spec as the CLI prints it: "k3s2p1 float32 NCHW", "k3s1p1 winograd4 float32 NCHW", "generic float64 NHWC"."""
    return " ".join(part for part in (spec.short(), spec.algorithm_suffix.lstrip("_"), spec.dtype, spec.layout) if part)


def _spec_from_args(args) -> ConvSpec:
    """The spec the arguments name. --algorithm auto (the default) takes Winograd for the windows it
    computes, as the ops do for layers with enough channels; the generic build is direct.
    --algorithm depthwise names the depthwise family (which the ops pick by the channels, not the
    window), specialized or generic."""
    generic = args.generic or args.spec.strip().lower() == "generic"
    if args.algorithm == "winograd" and generic:
        raise UsageError("--algorithm winograd needs a window: the generic build is always direct")
    if args.tile is not None and (args.algorithm == "direct" or generic):
        raise UsageError("--tile is the output tile of Winograd F(m x m, 3 x 3): it goes with --algorithm winograd "
                         "or auto and a window")
    layout = _layout(args)
    try:
        spec = lowered_spec(args.spec, args.dtype, layout)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.algorithm == "depthwise":  # the family of groups == input channels, any window, generic too
        if args.tile is not None:
            raise UsageError("--tile is the output tile of Winograd F(m x m, 3 x 3): not for --algorithm depthwise")
        return dataclasses.replace(spec, family="depthwise")
    if generic:
        return spec.generic()
    if args.algorithm == "auto" and not winograd_computes(spec.window):
        if args.tile is not None:
            raise UsageError(f"--tile is for Winograd, which does not compute {spec.short()} ({WINOGRAD_WINDOW_TEXT} "
                             f"only)")
        return spec
    if args.algorithm == "direct":
        return spec
    tile = args.tile if args.tile is not None else _schedule(args.isa).winograd_tile
    try:
        return lowered_spec(args.spec, args.dtype, layout, "winograd", tile)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _schedule(isa: str | None):
    from ..runtime.kernels import settings
    from ..planning.schedule import get_schedule
    active = settings()
    return active.schedule() if isa is None else get_schedule(active.toolchain.supported_isas(), isa)


# ------------------------------------------------------------------------------------------ build
def cmd_build(args) -> int:
    from ..runtime.kernels import build_all
    from .specfile import load_spec_file
    specs = load_spec_file(args.specfile)
    if not specs:
        print(f"{args.specfile} lists no kernels")
        return EXIT_OK
    start = time.perf_counter()
    counts = {"built": 0, "cached": 0, "failed": 0}
    failures = []
    live = sys.stderr.isatty()

    def on_done(spec, outcome):
        key = outcome if isinstance(outcome, str) else "failed"
        counts[key] += 1
        if key == "failed":
            failures.append((spec, outcome))
        done = sum(counts.values())
        label = _label(spec)
        if live:  # redraw one line on a terminal; a log gets one line per kernel
            bar = "#" * (30 * done // len(specs))
            print(f"\r[{bar:<30}] {done}/{len(specs)} {label}".ljust(78), end="", flush=True, file=sys.stderr)
        else:
            word = {"built": "built", "cached": "cached", "failed": "FAILED"}[key]
            print(f"[{done}/{len(specs)}] {word} {label}", file=sys.stderr, flush=True)

    build_all(specs, jobs=args.jobs, on_done=on_done)
    if live:
        print(file=sys.stderr)
    for spec, exc in failures:
        print(f"failed: {_label(spec)}: {exc}", file=sys.stderr)
    print(f"{len(specs)} kernel modules: {counts['built']} built, {counts['cached']} already cached, "
          f"{counts['failed']} failed ({time.perf_counter() - start:.1f} s)")
    return EXIT_FAILURE if failures else EXIT_OK


# --------------------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    from .export import module_basename
    from ..codegen.render import render
    from .specfile import load_spec_file
    specs = load_spec_file(args.specfile)
    schedule = _schedule(None)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        (out / f"{module_basename(spec)}.c").write_text(render(spec, schedule).source)
    print(f"rendered {len(specs)} kernel modules into {out}/")
    return EXIT_OK


# ------------------------------------------------------------------------------------------- show
def _view(rendered, op: str | None) -> str:
    """The whole module, or the entry points of `op` with what they use."""
    from ..codegen.csource import extract
    if op is None:
        return rendered.source
    part = extract(rendered.source, [rendered.symbols[entry] for entry in OP_ENTRIES[op]])
    total = rendered.source.count("\n")
    note = (f"/* convgen show --op {op}: {_OP_TITLES[op]}. The entry point{'s' if len(OP_ENTRIES[op]) > 1 else ''} "
            f"and the types, macros and routines they use,\n   {part.count(chr(10))} of the module's {total} lines; "
            f"`convgen show` without --op prints it all. */\n")
    return note + part


def cmd_show(args) -> int:
    from ..codegen.csource import unified_diff
    from ..codegen.render import render
    spec = _spec_from_args(args)
    schedule = _schedule(args.isa)
    if not args.diff:
        sys.stdout.write(_lowering_note(args) + _view(render(spec, schedule), args.op))
        return EXIT_OK
    if not spec.specialized:
        raise UsageError("--diff compares a specialized build with the generic one: give a window such as k3s1p1, "
                         "without --generic")
    generic, specialized = render(spec.generic(), schedule), render(spec, schedule)
    op = f" --op {args.op}" if args.op else ""
    sys.stdout.write(_lowering_note(args) + unified_diff(_view(generic, args.op), _view(specialized, args.op),
                                  f"generic {_label(spec.generic())[8:]}{op}", f"specialized {_label(spec)}{op}"))
    return EXIT_OK


# ----------------------------------------------------------------------------------------- export
def cmd_export(args) -> int:
    from .export import compile_hint, export_module, module_basename
    from ..codegen.render import render
    if RANK_OF_LAYOUT[_layout(args)] == 3:
        raise UsageError("export writes 2-D kernels, and a 3-D convolution folds its depth taps into the channels "
                         "in Python (convgen/frontend/depthfold.py): export its height x width window with a 2-D "
                         "layout")
    rendered = render(_spec_from_args(args), _schedule(args.isa))
    c_path, h_path = export_module(rendered, args.output)
    print(f"wrote {c_path} and {h_path}")
    print(f"build it with: (cd {c_path.parent} && {compile_hint(rendered, module_basename(rendered.spec))})")
    if RANK_OF_LAYOUT[_layout(args)] == 1:
        print(f"(a 1-D window runs as the 2-D window {rendered.spec.short()} with h = 1 in layout "
              f"{rendered.spec.layout}: a unit height axis)")
    return EXIT_OK


# ---------------------------------------------------------------------------------------- compare
def cmd_compare(args) -> int:
    from .compare import compare_layer, format_rows
    window, epilogue = args.spec.window, args.spec.epilogue
    n, c, h, w, f = args.shape
    try:
        window.output_size((h, w))
    except ValueError as exc:
        raise UsageError(f"--shape {n},{c},{h},{w},{f} does not fit {window.short()}: {exc}") from None
    fused = f", then {epilogue}" if epilogue.active else ""
    print(f"conv2d {window.short()} {args.dtype} NCHW, x ({n}, {c}, {h}, {w}) -> {f} channels{fused}")
    print(format_rows(compare_layer(window, n, c, h, w, f, args.dtype, repeat=args.repeat, epilogue=epilogue)))
    return EXIT_OK


# ------------------------------------------------------------------------------------ tune, wisdom
def _layer(text: str):
    """A layer to tune: WINDOW:N,C,H,W,F[:LAYOUT[:DTYPE[:GROUPS]]], e.g. k3s1p1:8,64,56,56,64:NHWC."""
    from .tune import Layer
    parts = text.split(":")
    if not 2 <= len(parts) <= 5:
        raise argparse.ArgumentTypeError(f"a layer is WINDOW:N,C,H,W,F[:LAYOUT[:DTYPE[:GROUPS]]], got {text!r}")
    window = _window(parts[0])
    n, c, h, w, f = _shape(parts[1])
    layout = parts[2].upper() if len(parts) > 2 else "NCHW"
    dtype = parts[3] if len(parts) > 3 else "float32"
    if layout not in ("NCHW", "NHWC") or dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"a layer's layout is NCHW or NHWC and its dtype one of {sorted(DTYPES)}, "
                                         f"got {text!r}")
    groups = _positive(parts[4]) if len(parts) > 4 else 1
    try:
        window.output_size((h, w))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if c % groups or f % groups:
        raise argparse.ArgumentTypeError(f"{text!r}: groups {groups} must divide the channels and the filters")
    return Layer(window, n, c, h, w, f, groups, layout, dtype)


def cmd_tune(args) -> int:
    from ..runtime import wisdom
    from .tune import DEFAULT_LAYERS, OPS, tune
    layers = args.layers or list(DEFAULT_LAYERS)
    ops = OPS if args.op == "both" else (args.op,)
    print(f"tuning {len(layers)} layer(s) x {len(ops)} op(s), mode {args.mode}"
          f"{f', budget {args.budget:g} s' if args.budget else ''}; CPU {wisdom.cpu_name()}", flush=True)
    start = time.perf_counter()
    outcomes, left = tune(layers, ops, args.mode, args.budget, report=lambda line: print(line, flush=True))
    where = wisdom.wisdom_path() if args.mode != "estimate" else "nowhere (estimate measures nothing)"
    print(f"{len(outcomes)} tuned in {time.perf_counter() - start:.1f} s, {left} left; wisdom written to {where}")
    return EXIT_OK


def cmd_wisdom(args) -> int:
    from ..runtime import wisdom
    from ..runtime.kernels import settings
    path = wisdom.wisdom_path()
    if args.action == "forget":
        print(f"forgot the wisdom in {path}" if wisdom.forget() else f"no wisdom in {path}")
        return EXIT_OK
    if args.action == "import":
        if args.file is None:
            raise UsageError("wisdom import needs the FILE to read")
        added = wisdom.import_file(Path(args.file), settings())
        print(f"imported {added} entries from {args.file} into {path}")
        return EXIT_OK
    found = wisdom.read()
    if args.action == "export":
        if args.file is None:
            raise UsageError("wisdom export needs the FILE to write")
        if found is None:
            raise ValueError(f"no wisdom to export in {path}: run `convgen tune` first")
        wisdom.write(found, Path(args.file))
        print(f"exported {len(found.entries)} entries from {path} to {args.file}")
        return EXIT_OK
    if found is None:
        print(f"no wisdom in {path}: `algorithm=\"auto\"` follows the planner's rule (run `convgen tune` to measure)")
        return EXIT_OK
    here = wisdom.machine(settings())
    print(f"wisdom: {path}")
    print("measured on: " + ", ".join(f"{k} {v}" for k, v in sorted(found.stamp.items())))
    if found.stamp != here:
        print("NOT USED here: this machine is " + ", ".join(f"{k} {v}" for k, v in sorted(here.items())))
    for key, entry in sorted(found.entries.items()):
        choice = wisdom.entry_choice(entry)
        print(f"  {key}: {choice.text() if choice else 'unreadable entry, skipped'}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------ cache
# A module's op entry point, as cffi keeps its name in the binary (ConvSpec.symbol(op)); a module per op.
_ENTRY_SYMBOL = re.compile(rb"cg_conv2d_(fwd|bwd_data|bwd_weight)_\w+")


def module_label(path: Path) -> str:
    """Which spec a cached module holds, read from the C symbol names cffi keeps in the binary, and
    which op when it carries one alone (`convgen build` makes modules of every op; a first call, of its op)."""
    try:
        data = path.read_bytes()
    except OSError:
        return "?"
    spec, ops = None, set()
    for found in _ENTRY_SYMBOL.finditer(data):
        try:
            spec = spec or ConvSpec.from_symbol(found.group().decode())
        except ValueError:
            continue
        ops.add(found.group(1).decode())
    if spec is None:
        return "?"
    return _label(spec) if len(ops) == len(abi.OPS) else f"{_label(spec)} {abi.OP_TITLES[ops.pop()]}"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def cmd_cache(args) -> int:
    from ..runtime.cache import cache_clear, cache_info, list_modules
    info = cache_info()
    if args.action == "info":
        print(f"directory: {info['dir']}{'' if Path(info['dir']).is_dir() else ' (not created yet)'}")
        print(f"modules:   {info['modules']} ({_size(info['bytes'])})")
        print("moved by:  CONVGEN_CACHE_DIR (default $XDG_CACHE_HOME/convgen or ~/.cache/convgen)")
    elif args.action == "list":
        modules = list_modules()
        if not modules:
            print(f"no cached kernel modules in {info['dir']}")
            return EXIT_OK
        rows = []
        for path in modules:
            st = path.stat()
            when = datetime.datetime.fromtimestamp(st.st_mtime).strftime("%Y-%m-%d %H:%M:%S")
            rows.append((module_label(path), _size(st.st_size), when, path.name))
        width = max(len("kernels"), *(len(row[0]) for row in rows))
        print(f"{'kernels':<{width}} {'size':>9}  {'modified':<19}  file")
        for label, size, when, name in sorted(rows):
            print(f"{label:<{width}} {size:>9}  {when:<19}  {name}")
        print(f"{len(modules)} modules, {_size(info['bytes'])} in {info['dir']}")
    else:
        removed = cache_clear()
        print(f"removed {removed} cached kernel module{'' if removed == 1 else 's'} from {info['dir']}")
    return EXIT_OK


# ----------------------------------------------------------------------------------------- parser
def _add_spec_options(p, generic_help: str) -> None:
    p.add_argument("spec", type=_spec_text, metavar="SPEC",
                   help="the window: k<kernel>[s<stride>][p<padding>][d<dilation>][padding mode], e.g. k3s2p1, "
                        "k7s2p3d1, k3x5s1p1x2 (h x w), k3s1p1reflect (reflect, replicate or circular padding), "
                        "k3x3x3s1p1 (3-D; d x h x w), k9s1p4 with --layout NCL (1-D); "
                        "or 'generic'")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="element type (default float32)")
    p.add_argument("--layout", default=None, type=str.upper, choices=LAYOUTS,
                   help="data layout, which sets the rank: NCHW or NHWC (2-D), NCL or NLC (1-D), NCDHW or NDHWC "
                        "(3-D); default NCHW, or NCDHW for a window with three values")
    p.add_argument("--generic", action="store_true", help=generic_help)
    p.add_argument("--algorithm", default="auto", choices=("auto", "direct", "winograd", "depthwise"),
                   help="the algorithm family: auto (default) takes winograd for 3x3 windows at stride 1 without "
                        "dilation and direct for the rest; the generic build is direct; depthwise: the kernels "
                        "for groups == input channels (specialized or generic)")
    p.add_argument("--tile", type=int, choices=WINOGRAD_TILES,
                   help="winograd: the output tile m of F(m x m, 3 x 3) (default: the schedule's)")
    p.add_argument("--isa", choices=ISAS,
                   help="render for this instruction set (default: CONVGEN_ISA, else the best this machine runs)")


def make_parser() -> argparse.ArgumentParser:
    # --verbose is accepted before or after the command; SUPPRESS keeps the command's copy from
    # overwriting a --verbose given before it.
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="on an error, print the traceback too")
    parser = _Parser(
        prog="convgen", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Specialized convolution kernels (2-D; 1-D and 3-D windows run on them): build, read, export, "
                    "compare and tune them.",
        epilog="examples:\n  convgen build kernels.toml -j 2\n  convgen show k3s2p1 --op forward --diff\n"
               "  convgen export k3s2p1 -o export/\n  convgen compare k3s1p1 --shape 8,64,56,56,64\n"
               "  convgen tune --layer k3s1p1:8,64,56,56,64\n  convgen cache info\n\n"
               "exit codes: 0 success, 1 failure, 2 usage error")
    parser.add_argument("-v", "--verbose", action="store_true", help="on an error, print the traceback too")
    parser.add_argument("--version", action="version", version=f"convgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name, help, example, func):
        p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", parents=[verbose],
                           epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func, command_parser=p)
        return p

    p = command("build", "build every kernel a spec file lists (parallel, cached)",
                "convgen build kernels.toml -j 2", cmd_build)
    p.add_argument("specfile", nargs="?", default=DEFAULT_SPEC_FILE, metavar="SPECFILE",
                   help=f"TOML kernel-set file (default {DEFAULT_SPEC_FILE})")
    p.add_argument("-j", "--jobs", type=_positive, default=None, help="parallel compiles (default: all cores)")

    p = command("generate", "render the C of every kernel a spec file lists, without compiling",
                "convgen generate kernels.toml -o generated/", cmd_generate)
    p.add_argument("specfile", nargs="?", default=DEFAULT_SPEC_FILE, metavar="SPECFILE",
                   help=f"TOML kernel-set file (default {DEFAULT_SPEC_FILE})")
    p.add_argument("-o", "--output", default="generated", metavar="DIR", help="output directory (default generated)")

    p = command("show", "print the generated C of one kernel module",
                "convgen show k3s2p1 --op forward --diff", cmd_show)
    _add_spec_options(p, "show the generic build (window at run time) of the same dtype and layout")
    p.add_argument("--op", choices=tuple(OP_ENTRIES),
                   help="only this op's entry points and the code they use (transpose = conv2d's input gradient)")
    p.add_argument("--diff", action="store_true", help="unified diff of the generic build against the specialized one")

    p = command("export", "write a kernel module as a standalone .c/.h pair (no Python, no cffi)",
                "convgen export k3s2p1 -o export/  &&  cc -O3 -fopenmp -fno-strict-aliasing -c export/conv2d_k3s2p1_nchw_float32.c",
                cmd_export)
    _add_spec_options(p, "export the generic build (window at run time) of the same dtype and layout")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory for the .c and .h")

    p = command("compare", "time specialized vs generic vs NumPy (and PyTorch when installed) on one NCHW layer",
                "convgen compare k3s1p1 --shape 8,64,56,56,64 --repeat 5", cmd_compare)
    p.add_argument("spec", type=_window_and_epilogue, metavar="SPEC",
                   help="the window, e.g. k3s1p1 or k3s1p1reflect, and any fused epilogue after it (k3s1p1_addrelu: "
                        "a residual added, then relu; every implementation computes the same)")
    p.add_argument("--shape", type=_shape, required=True, metavar="N,C,H,W,F",
                   help="batch, input channels, height, width, output channels")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="element type (default float32)")
    p.add_argument("--repeat", type=_positive, default=7, help="timed rounds; the median is shown (default 7)")

    p = command("tune", "measure the algorithms 'auto' may take for some layers and remember the fastest (wisdom)",
                "convgen tune --layer k3s1p1:8,64,56,56,64:NHWC --budget 60", cmd_tune)
    p.add_argument("--layer", dest="layers", action="append", type=_layer, metavar="WINDOW:N,C,H,W,F[:LAYOUT[:DTYPE]]",
                   help="a layer to tune (repeatable; default: the benchmark networks' layers that have a choice)")
    p.add_argument("--op", choices=("conv2d", "conv2d_backward", "both"), default="both",
                   help="which op to measure (default both)")
    p.add_argument("--mode", choices=("estimate", "measure", "patient"), default="measure",
                   help="estimate: measure nothing, show the planner's rule; measure: medians of 5 rounds (default); "
                        "patient: of 15")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="stop between layers once this much time is spent (default: none)")

    p = command("wisdom", "show, export, import or forget what `convgen tune` measured",
                "convgen wisdom show", cmd_wisdom)
    p.add_argument("action", choices=("show", "export", "import", "forget"),
                   help="show: the entries and the machine they hold for; export/import: to or from FILE (only "
                        "wisdom of this machine, compiler and convgen is imported); forget: delete it")
    p.add_argument("file", nargs="?", default=None, metavar="FILE", help="the file to export to or import from")

    p = command("cache", "show, list or clear the cache of built kernel modules", "convgen cache list", cmd_cache)
    p.add_argument("action", choices=("info", "list", "clear"),
                   help="info: where and how big; list: every module; clear: delete them all")
    return parser


def _one_line(exc: BaseException) -> str:
    """An exception as one readable line; a compiler failure keeps its first error line."""
    from ..runtime.build import BuildError
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    if isinstance(exc, BuildError):
        errors = [line for line in lines[1:] if not line.startswith("$ ") and "error" in line.lower()]
        if errors:
            text = f"{text.rstrip(':')}: {errors[0]}"
    return text


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    try:
        return args.func(args)
    except UsageError as exc:
        args.command_parser.error(str(exc))
    except KeyboardInterrupt:
        print("convgen: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `convgen show ... | head`): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as exc:  # every failure becomes one line; --verbose shows where it came from
        if verbose:
            traceback.print_exc()
        print(f"convgen: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
