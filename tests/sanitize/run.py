"""Run the op tests against kernels built with AddressSanitizer and UndefinedBehaviorSanitizer.

    python tests/sanitize/run.py           # `make sanitize`: the op tests, every grid kernel
    python tests/sanitize/run.py --quick   # `.ci/run`: validation, property and thread tests, few kernels
    python tests/sanitize/run.py -- -k hand_checked tests/test_conv2d.py   # any pytest arguments

The kernels are compiled with -fsanitize=address,undefined into their own cache directory
(.cache/sanitize-kernels), and pytest runs in a Python that preloads the sanitizer runtimes (an
instrumented module cannot be loaded otherwise). Any report ends the run with a non-zero exit:
ASan stops at its first error and UBSan is made fatal with -fno-sanitize-recover=all; pytest
captures only Python-level output (--capture=sys), so a report written to file descriptor 2 by a
dying process reaches the run's output, which is also scanned for reports (one printed by a child
process and passed on by a test counts as well).
Leak detection is off: CPython keeps its interned objects until exit, by design.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "sanitize-kernels"
# Unoptimized: every load and store is instrumented as the C writes it (nothing folded or kept in a
# register), and an instrumented module compiles in a quarter of its time at -O1 (a k3s2p1 module of
# every op: 2.7 s against 9.8 s on Zen 4), which more than pays for the slower kernels: the CI subset
# ran in 1 min 44 s against 3 min 48 s at -O1.
CFLAGS = "-O0 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"

# The op tests are every test file except these, which run no kernel of their own (the reference,
# rendering, the command line and README through subprocesses, benchmarks, the long digits example).
NOT_OP_TESTS = {"test_reference.py", "test_render.py", "test_cli.py", "test_readme.py", "test_baselines.py",
                "test_example.py", "test_sanitize.py"}


def op_tests() -> list[str]:
    return [f"tests/{p.name}" for p in sorted((ROOT / "tests").glob("test_*.py")) if p.name not in NOT_OP_TESTS]


# The CI subset: every bad-input and unusual-array case, the property tests with specialized windows
# narrowed to k3s2p1 and k3s1p1 (which Winograd computes, and the depthwise family's kernels too),
# the depthwise tests' odd sizes, 8 threads calling kernels at once, the padding modes' adjoint
# identities (the generic build in every mode and layout; reflect, replicate and circular windows
# specialized) and the pixel-row kernels' border, phase, partial-tile and in-place weight-gradient
# cases (generic, both layouts); the kernels are built in parallel first (those of the thread and padding-mode tests
# are listed by hand: a missing one is only built later, one at a time).
_PADDING_MODE_ADJOINTS = "tests/test_padding_modes.py::test_adjoint_identities_hold_in_every_mode"
QUICK = ["--noconftest", "tests/test_validation.py", "tests/test_properties.py",
         "tests/test_concurrency.py::test_threads_calling_kernels_at_once_match_serial",
         "tests/test_depthwise.py::test_odd_sizes"] + \
    [f"{_PADDING_MODE_ADJOINTS}[{layout}-{mode}-generic]" for layout in ("NCHW", "NHWC")
     for mode in ("zeros", "reflect", "replicate", "circular")] + \
    [f"{_PADDING_MODE_ADJOINTS}[{case}-specialized]" for case in ("NCHW-reflect", "NCHW-replicate", "NHWC-circular")] + \
    [f"tests/test_pixel_rows.py::test_every_op_matches_the_reference[{case}-{layout}-float32-generic]" for case in (
        "1x17x11x10-40-k3s2p1-g1", "2x3x15x14-64-k7s2p3-g1", "3x1x12x12-16-k5s1p2-g1", "2x12x10x9-36-k2x5s1x3p1x2-g3",
        "1x7x9x9-11-k1s3p0-g1", "2x9x4x3-13-k5s1p2-g1", "1x24x1x1-130-k3s1p1-g1", "1x6x17x17-64-k3s1p1-g1",
        "2x40x7x6-12-k3s1p1-g1") for layout in ("NHWC", "NCHW")] + \
    [f"tests/test_pixel_rows.py::test_padding_modes[generic-{mode}-{layout}]" for mode in ("reflect", "circular")
     for layout in ("NHWC", "NCHW")] + \
    [f"tests/test_epilogue.py::test_generic_build_every_activation_in_every_family[{position}-{family}-{layout}-float32]"
     for position, family in (("before", "direct"), ("after", "depthwise")) for layout in ("NCHW", "NHWC")]
QUICK_WINDOWS = "k3s2p1 k3s1p1"
_BOTH = [(dtype, layout) for dtype in ("float32", "float64") for layout in ("NCHW", "NHWC")]
QUICK_SPECS = [("k3s2p1", *both) for both in _BOTH] + [("generic", *both) for both in _BOTH] + \
    [("k3s1p1", *both) for both in _BOTH] + [("k3s1p1", *both, "winograd") for both in _BOTH] + \
    [(window, *both, "depthwise") for window in ("k3s2p1", "k3s1p1", "generic") for both in _BOTH] + \
    [("k1", "float64", "NCHW"), ("k3s1p1d2", "float32", "NCHW"), ("k3s1p1d2", "float32", "NHWC"),
     ("k4s2p1", "float64", "NCHW")] + \
    [(window, "float64", "NCHW") for window in ("k3s1p1reflect", "k3x2s2x1p2_1x0_1d1x2reflect",
                                                "k4x3s1x2p1_2x0_1replicate", "k3s3p6x4d2replicate")] + \
    [(window, "float64", "NHWC") for window in ("k5x3s2p2x1circular", "k2x3s1p0_1x2_2d2x1circular")]

REPORT = re.compile(r"ERROR: AddressSanitizer|SUMMARY: (?:Address|UndefinedBehavior)Sanitizer|"
                    r"^.*: runtime error: ", re.MULTILINE)


def runtime_library(name: str, compiler: str = "gcc") -> str:
    """The compiler's shared sanitizer runtime, e.g. /usr/lib/gcc/x86_64-linux-gnu/12/libasan.so."""
    path = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SystemExit(f"sanitize: {compiler} has no {name}; install its sanitizer runtimes "
                         f"(Debian/Ubuntu: apt-get install libasan8 libubsan1, or gcc itself)")
    return os.path.realpath(path)


def sanitizer_env(cache: Path = CACHE, base: dict | None = None) -> dict:
    """The environment of a Python process that builds and loads sanitized kernels."""
    env = dict(os.environ if base is None else base)
    compiler = env.get("CC", "gcc").split()[0]
    env.update(
        LD_PRELOAD=" ".join([runtime_library("libasan.so", compiler), runtime_library("libubsan.so", compiler)]),
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87",
        CONVGEN_CFLAGS=CFLAGS,
        CONVGEN_CACHE_DIR=str(cache),
        CONVGEN_MODULES=env.get("CONVGEN_MODULES", "whole"),  # the op tests call every op of their kernels
        PYTHONMALLOC="malloc",  # every Python allocation through ASan's allocator, with red zones
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")])),
    )
    return env


def reports(output: str) -> list[str]:
    """The sanitizer report lines in `output`."""
    return [m.group(0).strip() for m in REPORT.finditer(output)]


# Build the quick set in parallel first (without the test conftest there is no prebuild).
_QUICK_PREBUILD = """
import dataclasses, sys, convgen
from convgen.planning import planner
from convgen.planning.spec import ConvSpec
specs = [ConvSpec.parse(*spec[:3]) for spec in {specs!r}]
schedule = convgen.runtime.kernels.settings().schedule()  # Winograd modules get the tile the planner uses
specs = [dataclasses.replace(s, family=given[3], tile=planner.winograd_tile(s.dtype, schedule)
                             if given[3] == "winograd" else 0)
         if len(given) > 3 else s for s, given in zip(specs, {specs!r})]
failed = {{s: o for s, o in convgen.build_all(specs).items() if isinstance(o, Exception)}}
sys.exit(f"sanitize: kernel builds failed: {{failed}}" if failed else 0)
"""


def run(command: list[str], env: dict) -> tuple[int, str]:
    """Run `command`, echoing its output as it comes; return its exit code and output."""
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace")
    lines = []
    for line in process.stdout:
        sys.stdout.write(line)
        lines.append(line)
    return process.wait(), "".join(lines)


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    CACHE.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(CACHE.parent, 0o700)
    os.chmod(CACHE, 0o700)
    env = sanitizer_env()
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys"]
    code, output = 0, ""
    if quick:
        env["CONVGEN_PROPERTY_WINDOWS"] = QUICK_WINDOWS
        code, output = run([sys.executable, "-c", _QUICK_PREBUILD.format(specs=QUICK_SPECS)], env)
    if code == 0:
        code, output = run(pytest + (extra or (QUICK if quick else op_tests())), env)
    found = reports(output)
    print(f"sanitize: {len(found)} sanitizer report(s); exit code {code}")
    return 1 if found or code else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
