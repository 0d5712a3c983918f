"""The `convgen` command line, run through its real entry point (`python -m convgen`) in subprocesses.

Kernels come from the session's shared test cache (conftest.py) except where a test needs a cache of
its own (build, cache); exported C is compiled with the system's gcc and checked against
convgen.reference.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from convgen import reference
from convgen.codegen.abi import ENTRY_POINTS, PADDING_MODE_IDS
from convgen.tools.cli import make_parser
from convgen.codegen.csource import extract
from convgen.planning.spec import ConvSpec, Window
from helpers import TOLERANCE, to_layout

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("build", "generate", "show", "export", "compare", "cache")
WINDOW_FIELDS = ("kh", "kw", "sh", "sw", "pt", "pl", "dh", "dw", "pm")  # what a generic kernel reads at run time
GCC = shutil.which("gcc") or shutil.which("cc") or "gcc"  # convgen itself needs a C compiler


def convgen(*args, env=None, cwd=None, timeout=300):
    """Run `python -m convgen ARGS` from the source tree; returns the CompletedProcess."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "convgen", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or ROOT, timeout=timeout)


def assert_one_line_error(proc, code, *fragments):
    """Exit `code`, nothing on stdout, one 'convgen: error: ...' line on stderr containing the fragments."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("convgen: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def spec_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ help, errors
@pytest.mark.parametrize("command", (None,) + COMMANDS)
def test_help_shows_an_example_that_parses(command):
    proc = convgen(*([command] if command else []), "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith(f"usage: convgen{' ' + command if command else ''}")
    examples = re.findall(r"^  (convgen .*)$", proc.stdout.split("example")[1], re.MULTILINE)
    assert examples, proc.stdout
    for example in examples:  # every example in the help is a valid command line
        argv = example.split("&&")[0].split()[1:]
        assert make_parser().parse_args(argv).command == (command or argv[0])


def test_version():
    proc = convgen("--version")
    assert proc.returncode == 0 and re.fullmatch(r"convgen \d+\.\d+\.\d+\n", proc.stdout)


@pytest.mark.parametrize("argv, fragment", [
    ((), "required: COMMAND"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    (("show", "k3z"), "cannot read 'k3z' as a window"),
    (("show", "k3s1p1", "--dtype", "float16"), "invalid choice: 'float16'"),
    (("show", "k3s1p1", "--op", "sideways"), "invalid choice: 'sideways'"),
    (("show", "k3s1p1", "--generic", "--diff"), "--diff compares a specialized build"),
    (("export", "k3s1p1"), "required: -o/--output"),
    (("compare", "k3s1p1", "--shape", "1,2,3"), "five positive integers"),
    (("compare", "generic", "--shape", "1,1,4,4,1"), "give a window such as k3s1p1, not 'generic'"),
    (("compare", "k7s1p0", "--shape", "1,1,3,3,1"), "does not fit k7s1p0"),
    (("build", "-j", "0"), "expected a positive integer"),
    (("cache", "wipe"), "invalid choice: 'wipe'"),
])
def test_usage_errors_exit_2_with_one_line(argv, fragment):
    proc = convgen(*argv)
    assert_one_line_error(proc, 2, fragment)
    assert "--help" in proc.stderr  # points at the command's help


def test_failures_exit_1_with_one_line_and_traceback_only_when_verbose(tmp_path):
    missing = str(tmp_path / "missing.toml")
    assert_one_line_error(convgen("build", missing), 1, f"spec file {missing} does not exist")
    broken = spec_file(tmp_path / "broken.toml", "[[set]\nwindows = [")
    assert_one_line_error(convgen("generate", str(broken), "-o", str(tmp_path / "out")), 1, "not valid TOML")
    verbose = convgen("build", missing, "--verbose")
    assert verbose.returncode == 1
    assert verbose.stderr.startswith("Traceback (most recent call last):")
    assert verbose.stderr.splitlines()[-1] == f"convgen: error: spec file {missing} does not exist"


# ------------------------------------------------------------------------------------------- build
def test_build_then_cache_info_list_clear(tmp_path):
    """A cold build into a private cache, the same build again from the cache, then the cache commands."""
    cache = tmp_path / "cache"
    env = {"CONVGEN_CACHE_DIR": str(cache)}
    kernels = spec_file(tmp_path / "one.toml", '[[set]]\nwindows = ["k1s1p0"]\ngeneric = false\n')

    info = convgen("cache", "info", env=env)
    assert info.returncode == 0
    assert f"directory: {cache} (not created yet)" in info.stdout and "modules:   0 " in info.stdout
    assert convgen("cache", "list", env=env).stdout == f"no cached kernel modules in {cache}\n"

    first = convgen("build", str(kernels), "-j", "1", env=env)
    assert first.returncode == 0, first.stderr
    assert re.match(r"1 kernel modules: 1 built, 0 already cached, 0 failed \(", first.stdout)
    assert "[1/1] built k1s1p0 float32 NCHW" in first.stderr  # the progress line when stderr is a log
    again = convgen("build", str(kernels), env=env)
    assert again.returncode == 0 and "0 built, 1 already cached, 0 failed" in again.stdout

    modules = sorted(cache.glob("_cg_*.so"))
    assert len(modules) == 1  # `convgen build`: one module of every op
    info = convgen("cache", "info", env=env).stdout
    assert f"directory: {cache}\n" in info and "modules:   1 (" in info
    listing = convgen("cache", "list", env=env).stdout.splitlines()
    assert listing[0].split() == ["kernels", "size", "modified", "file"]
    row = listing[1]
    assert row.startswith("k1s1p0 float32 NCHW ") and row.endswith(modules[0].name)
    assert re.search(r"\d+\.\d (kB|MB)  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row), row
    assert listing[2].startswith("1 modules, ")

    cleared = convgen("cache", "clear", env=env)
    assert cleared.returncode == 0 and cleared.stdout == f"removed 1 cached kernel module from {cache}\n"
    assert not list(cache.glob("_cg_*"))
    assert "modules:   0 " in convgen("cache", "info", env=env).stdout


@pytest.mark.parametrize("spec", [ConvSpec.parse("k3x5s2p1x2d2", "float64", "NHWC"), ConvSpec(None, "float32", "NCHW")])
def test_cache_list_reads_the_spec_from_the_modules_symbols(tmp_path, spec):
    """`cache list` labels a module by the entry point symbol cffi keeps in it (as strings in a binary):
    its spec and its op."""
    from convgen.tools.cli import module_label
    module = tmp_path / "module.so"
    module.write_bytes(b"\x7fELF\x00cg_conv2d_fwd_junk\x00_cffi_f_" + spec.symbol("fwd").encode() + b"\x00\x01"
                       + spec.symbol("workspace").encode() + b"\x00")
    assert module_label(module) == f"{spec.short()} {spec.dtype} {spec.layout} forward"
    module.write_bytes(b"\x7fELF\x00" + b"\x00".join(spec.symbol(op).encode() for op in ("fwd", "bwd_data", "bwd_weight")))
    assert module_label(module) == f"{spec.short()} {spec.dtype} {spec.layout}"  # a module of every op
    module.write_bytes(b"\x7fELF\x00cg_conv2d_bwd_data_k3s1p1_nchw_float32\x00")  # the input gradient's module
    assert module_label(module) == "k3s1p1 float32 NCHW input gradient"
    module.write_bytes(b"\x7fELF\x00cg_conv2d_workspace_k3s1p1_nchw_float32\x00")  # no op's entry point
    assert module_label(module) == "?"
    assert module_label(tmp_path / "missing.so") == "?"


def test_build_reports_the_compilers_message_and_exits_1(tmp_path):
    kernels = spec_file(tmp_path / "three.toml", '[[set]]\nwindows = ["k3s1p1"]\n')  # direct, winograd, generic
    env = {"CONVGEN_CACHE_DIR": str(tmp_path / "cache"), "CONVGEN_CFLAGS": "-O2 -fno-such-flag"}
    proc = convgen("build", str(kernels), env=env)
    assert proc.returncode == 1
    assert "3 kernel modules: 0 built, 0 already cached, 3 failed" in proc.stdout
    failed = [line for line in proc.stderr.splitlines() if line.startswith("failed: ")]
    assert sorted(line.split(":")[1].strip() for line in failed) == [
        "generic float32 NCHW", "k3s1p1 float32 NCHW", "k3s1p1 winograd4 float32 NCHW"]
    assert "-fno-such-flag" in proc.stderr.split("failed: ", 1)[1]  # the compiler's own complaint


def test_build_of_already_cached_specs(tmp_path):
    """Specs the test session has built already (tests/grid.py): nothing to compile."""
    kernels = spec_file(tmp_path / "k.toml", '[[set]]\nwindows = ["k3s2p1", "k1s1p0"]\n'
                                             'dtypes = ["float64"]\nlayouts = ["NHWC"]\n')
    proc = convgen("build", str(kernels))
    assert proc.returncode == 0, proc.stderr
    assert "3 kernel modules: 0 built, 3 already cached, 0 failed" in proc.stdout


def test_makefile_builds_and_generates_through_the_cli():
    proc = subprocess.run(["make", "-n", "-B", "build", "generate"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"-m convgen build kernels\.toml$", proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"-m convgen generate kernels\.toml -o generated/$", proc.stdout, re.MULTILINE), proc.stdout


# ---------------------------------------------------------------------------------------- generate
def test_generate_renders_one_file_per_spec(tmp_path):
    kernels = spec_file(tmp_path / "k.toml", '[[set]]\nwindows = ["k3s2p1"]\nlayouts = ["NCHW", "NHWC"]\n')
    out = tmp_path / "gen"
    proc = convgen("generate", str(kernels), "-o", str(out))
    assert proc.returncode == 0 and proc.stdout == f"rendered 4 kernel modules into {out}/\n"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["conv2d_generic_nchw_float32.c", "conv2d_generic_nhwc_float32.c",
                     "conv2d_k3s2p1_nchw_float32.c", "conv2d_k3s2p1_nhwc_float32.c"]
    special = (out / "conv2d_k3s2p1_nhwc_float32.c").read_text()
    assert f"int {ConvSpec.parse('k3s2p1', 'float32', 'NHWC').symbol('fwd')}(" in special
    assert "g->kh" in (out / "conv2d_generic_nhwc_float32.c").read_text() and "g->kh" not in special


# -------------------------------------------------------------------------------------------- show
def _defined_functions(source):
    return set(re.findall(r"^(?:int|int64_t) (cg_conv2d_\w+)\(", source, re.MULTILINE))


def test_show_prints_the_whole_module():
    proc = convgen("show", "k3s2p1", "--dtype", "float64", "--layout", "nhwc")
    assert proc.returncode == 0 and proc.stderr == ""
    spec = ConvSpec.parse("k3s2p1", "float64", "NHWC")
    assert _defined_functions(proc.stdout) == {spec.symbol(entry) for entry in ENTRY_POINTS}
    assert "typedef double real;" in proc.stdout


@pytest.mark.parametrize("op, entries", [("forward", {"fwd"}), ("backward", {"bwd_data", "bwd_weight"}),
                                         ("transpose", {"bwd_data"})])
@pytest.mark.parametrize("generic", [False, True])
def test_show_op_prints_its_entry_points_and_compiles_alone(tmp_path, op, entries, generic):
    proc = convgen("show", "k3s2p1", "--op", op, *(["--generic"] if generic else []))
    assert proc.returncode == 0, proc.stderr
    spec = ConvSpec.parse("k3s2p1")
    spec = spec.generic() if generic else spec
    assert _defined_functions(proc.stdout) == {spec.symbol(e) for e in entries}
    # The cut is complete (it compiles) and minimal (no unused routine).
    path = tmp_path / "part.c"
    path.write_text(proc.stdout)
    cc = subprocess.run([GCC, "-O0", "-fopenmp", "-Wall", "-Werror=unused-function",
                         "-Werror=implicit-function-declaration", "-c", str(path), "-o", os.devnull],
                        capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr


def test_specialized_code_has_no_window_loops_and_generic_has():
    """(Up to schedule.max_unrolled_taps taps: a 7x7 micro-kernel keeps a loop of constant trip count.)"""
    special = convgen("show", "k5s2p2").stdout
    generic = convgen("show", "k5s2p2", "--generic").stdout
    loops = re.compile(r"for \([^;]*;[^;]*<\s*(g->kh|g->kw|KK)\s*;")
    assert loops.search(generic), "the generic build loops over the window"
    assert not loops.search(special), loops.search(special).group(0)
    for field in WINDOW_FIELDS:  # a specialized build reads no window value at run time
        assert f"g->{field}" not in special
    assert "g->kh" in generic and "#define KK (5 * 5)" in special


def test_show_diff_is_generic_against_specialized():
    proc = convgen("show", "k3s1p1", "--diff", "--op", "forward", "--algorithm", "direct")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "--- generic float32 NCHW --op forward"
    assert lines[1] == "+++ specialized k3s1p1 float32 NCHW --op forward"
    removed = [line for line in lines[2:] if line.startswith("-")]
    added = [line for line in lines[2:] if line.startswith("+")]
    assert any("g->kh" in line for line in removed) and not any("g->kh" in line for line in added)
    assert any(ConvSpec.parse("k3s1p1").symbol("fwd") in line for line in added)
    assert any(ConvSpec(None).symbol("fwd") in line for line in removed)
    # Applying the diff to the generic cut gives the specialized cut.
    generic = convgen("show", "k3s1p1", "--generic", "--op", "forward").stdout.splitlines()
    special = convgen("show", "k3s1p1", "--op", "forward", "--algorithm", "direct").stdout.splitlines()
    assert _patch(generic, lines[2:]) == special


def test_show_takes_winograd_for_a_3x3_stride_1_window():
    """By default `show` renders what the ops run for such a window with enough channels: Winograd, whose
    forward entry point has the generated transforms; --diff then shows the algorithm change itself."""
    spec = ConvSpec.parse("k3s1p1", family="winograd", tile=4)
    forward = convgen("show", "k3s1p1", "--op", "forward", "--tile", "4")
    assert forward.returncode == 0, forward.stderr
    assert spec.symbol("fwd") in forward.stdout and "(real)4 * " in forward.stdout
    diff = convgen("show", "k3s1p1", "--diff", "--op", "forward", "--tile", "4").stdout.splitlines()
    assert diff[1] == "+++ specialized k3s1p1 winograd4 float32 NCHW --op forward"
    assert any(spec.symbol("fwd") in line for line in diff if line.startswith("+"))
    assert convgen("show", "k3s2p1", "--tile", "4").returncode == 2  # no Winograd for stride 2
    assert "--tile is the output tile" in convgen("show", "k3s1p1", "--algorithm", "direct", "--tile", "4").stderr


def _patch(before, hunks):
    """Apply unified-diff hunks to a list of lines."""
    out, at = [], 0
    for line in hunks:
        if line.startswith("@@"):
            start = int(re.match(r"@@ -(\d+)", line).group(1)) - 1
            out += before[at:start]
            at = start
        elif line.startswith(" "):
            assert before[at] == line[1:]
            out.append(line[1:])
            at += 1
        elif line.startswith("-"):
            assert before[at] == line[1:]
            at += 1
        elif line.startswith("+"):
            out.append(line[1:])
    return out + before[at:]


def test_extract_keeps_exactly_what_an_entry_point_uses():
    """The cutting behind `show --op`, on C written to exercise each kind of top-level item."""
    source = textwrap.dedent("""\
        /* header comment */
        #include <stdint.h>
        #define SCALE 2
        #define UNUSED_MACRO 3
        typedef int (*op_fn)(int);
        static const int table[] = {1, 2};
        struct node { int v; };
        typedef struct { struct node n; } holder_t;
        enum { FIRST = 1, SECOND };
        enum { OTHER = 9 };
        /* doubles v */
        static int twice(int v) { holder_t h = {{SECOND}}; return SCALE * v + table[0] - 1 + h.n.v; }
        static int unused(int v) { return v + OTHER + UNUSED_MACRO; }
        int entry(int v)
        {
            op_fn f = twice;  /* a comment naming unused() does not count */
            return f(v);
        }
        int other_entry(int v) { return unused(v); }
        """)
    cut = extract(source, ["entry"])
    kept = ["/* header comment */", "#include <stdint.h>", "#define SCALE 2", "typedef int (*op_fn)(int);",
            "static const int table[] = {1, 2};", "struct node { int v; };", "typedef struct { struct node n; } holder_t;",
            "enum { FIRST = 1, SECOND };", "/* doubles v */", "static int twice(int v)", "int entry(int v)"]
    for text in kept:
        assert text in cut, text
    for text in ("UNUSED_MACRO", "OTHER", "static int unused", "other_entry"):
        assert text not in cut.replace("naming unused()", ""), text
    with pytest.raises(ValueError, match="defines no missing"):
        extract(source, ["missing"])


def test_show_into_a_closed_pipe_is_quiet():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(f"{sys.executable} -m convgen show k3s1p1 | head -n 1", shell=True, capture_output=True,
                          text=True, env=env, cwd=ROOT)
    assert proc.stdout.startswith("/*") and proc.stderr == ""


# ------------------------------------------------------------------------------------------ export
_MAIN_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include "{name}.h"

/* argv: OP NTHREADS IN OUT. OP fwd reads x, weight, bias and writes y; OP bwd_weight reads dy, x and writes dw. */
static {real} *read_reals(FILE *in, long count)
{{
    {real} *data = malloc(sizeof({real}) * (size_t)count);
    if (!data || fread(data, sizeof({real}), (size_t)count, in) != (size_t)count) exit(3);
    return data;
}}

int main(int argc, char **argv)
{{
    const long nx = {n}L * {c} * {h} * {w}, ny = {n}L * {f} * {ho} * {wo}, nw = {nw}L;
    if (argc != 5) return 2;
    int nthreads = atoi(argv[2]), status;
    FILE *in = fopen(argv[3], "rb"), *out = fopen(argv[4], "wb");
    if (!in || !out) return 4;
    {real} *result;
    long count;
    if (argv[1][0] == 'f') {{
        {real} *x = read_reals(in, nx), *weight = read_reals(in, nw), *bias = read_reals(in, {f});
        result = malloc(sizeof({real}) * (size_t)ny);
        count = ny;
        status = {fwd}(x, weight, NULL, bias, NULL, result, 0.0, 0.0, {n}, {c}, {h}, {w}, {f}, {ho}, {wo}, 1{window}, nthreads);
    }} else {{
        {real} *dy = read_reals(in, ny), *x = read_reals(in, nx);
        result = malloc(sizeof({real}) * (size_t)nw);
        count = nw;
        status = {bwd_weight}(dy, x, result, {n}, {c}, {h}, {w}, {f}, {ho}, {wo}, 1{window}, nthreads);
    }}
    fwrite(result, sizeof({real}), (size_t)count, out);
    fclose(out);
    return status;
}}
"""

# Large enough (a few MFLOP) that a call asked for 2 threads uses 2: the kernels run small calls on one.
N, C, H, W, F = 4, 16, 32, 32, 16
EXPORTS = {  # name: (window, dtype, layout, generic build, -fopenmp)
    "k3s2p1-f32-nchw-openmp": ("k3s2p1", "float32", "NCHW", False, True),
    "k3s2p1circular-f32-nchw-serial": ("k3s2p1circular", "float32", "NCHW", False, False),
    "generic-f64-nhwc-openmp": ("k3x5s1p1x2d2reflect", "float64", "NHWC", True, True),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The exports above, each compiled with gcc together with a small C main; {name: (program, window, dtype, layout)}."""
    programs, compiles = {}, {}
    for key, (text, dtype, layout, generic, openmp) in EXPORTS.items():
        directory = tmp_path_factory.mktemp(key)
        proc = convgen("export", text, "--dtype", dtype, "--layout", layout, *(["--generic"] if generic else []),
                       "-o", str(directory))
        assert proc.returncode == 0, proc.stderr
        spec = ConvSpec.parse(text, dtype, layout)
        spec = spec.generic() if generic else spec
        name = f"conv2d_{spec.name}"
        assert proc.stdout.startswith(f"wrote {directory / name}.c and {directory / name}.h\n")
        window = Window.parse(text)
        (ho, wo) = window.output_size((H, W))
        args = ""
        if generic:
            args = ", " + ", ".join(str(v) for v in (*window.kernel, *window.stride, window.padding[0][0],
                                                     window.padding[1][0], *window.dilation,
                                                     PADDING_MODE_IDS[window.padding_mode], 0, 0))
        main = _MAIN_C.format(name=name, real=spec.c_type, n=N, c=C, h=H, w=W, f=F, ho=ho, wo=wo,
                              nw=F * C * window.kernel[0] * window.kernel[1], window=args,
                              fwd=spec.symbol("fwd"), bwd_weight=spec.symbol("bwd_weight"))
        (directory / "main.c").write_text(main)
        program = directory / "main"
        command = [GCC, "-O1", *(["-fopenmp"] if openmp else []), "-fno-strict-aliasing", "-Wno-unknown-pragmas",
                   "-o", str(program),
                   str(directory / "main.c"), str(directory / f"{name}.c"), "-lm"]
        compiles[key] = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=directory)
        programs[key] = (program, window, dtype, layout)
    for key, cc in compiles.items():  # compiled side by side
        _, errors = cc.communicate(timeout=300)
        assert cc.returncode == 0, (key, errors)
    return programs


def _run_program(program, op, nthreads, arrays, dtype):
    data, result = program.parent / f"{op}.in", program.parent / f"{op}.out"
    with open(data, "wb") as handle:
        for array in arrays:
            np.ascontiguousarray(array, dtype=dtype).tofile(handle)
    proc = subprocess.run([str(program), op, str(nthreads), str(data), str(result)], capture_output=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    return np.fromfile(result, dtype=dtype)


def _case(window, dtype, layout):
    rng = np.random.default_rng(7)
    x, weight = to_layout(rng.standard_normal((N, C, H, W)), rng.standard_normal((F, C, *window.kernel)), layout)
    (pt, pb), (pl, pr) = window.padding
    kw = dict(stride=window.stride, padding=((pt, pb), (pl, pr)), dilation=window.dilation, layout=layout,
              padding_mode=window.padding_mode)
    return x.astype(dtype), weight.astype(dtype), rng.standard_normal(F).astype(dtype), kw


@pytest.mark.parametrize("key", list(EXPORTS))
@pytest.mark.parametrize("nthreads", [1, 2])
def test_exported_forward_matches_the_reference(exported, key, nthreads):
    program, window, dtype, layout = exported[key]
    x, weight, bias, kw = _case(window, dtype, layout)
    expected = reference.conv2d(x, weight, bias, **kw)
    y = _run_program(program, "fwd", nthreads, [x, weight, bias], dtype).reshape(expected.shape)
    err = np.abs(y - expected).max() / np.abs(expected).max()
    assert err <= TOLERANCE[np.dtype(dtype).type], err


@pytest.mark.parametrize("key", list(EXPORTS))
@pytest.mark.parametrize("nthreads", [1, 2])
def test_exported_weight_gradient_matches_the_reference(exported, key, nthreads):
    """Also without OpenMP, where the pragmas are ignored and one thread must do all of the work."""
    program, window, dtype, layout = exported[key]
    x, weight, _, kw = _case(window, dtype, layout)
    y = reference.conv2d(x, weight, **kw)
    dy = np.random.default_rng(8).standard_normal(y.shape).astype(dtype)
    _, expected, _ = reference.conv2d_backward(dy, x, weight, **kw)
    dw = _run_program(program, "bwd_weight", nthreads, [dy, x], dtype).reshape(expected.shape)
    err = np.abs(dw - expected).max() / np.abs(expected).max()
    assert err <= TOLERANCE[np.dtype(dtype).type], err


def test_exported_header_is_plain_c_with_documented_prototypes(tmp_path):
    proc = convgen("export", "k7s2p3", "--layout", "NHWC", "-o", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    header = (tmp_path / "conv2d_k7s2p3_nhwc_float32.h").read_text()
    source = (tmp_path / "conv2d_k7s2p3_nhwc_float32.c").read_text()
    spec = ConvSpec.parse("k7s2p3", "float32", "NHWC")
    for op in ("fwd", "bwd_data", "bwd_weight", "workspace"):
        # each prototype has its doc comment right above it, and the source defines it
        assert re.search(r"\*/\n(int|int64_t) " + spec.symbol(op) + r"\(", header), op
        assert re.search(r"^(int|int64_t) " + spec.symbol(op) + r"\(", source, re.MULTILINE), op
    assert "weight (7, 7, c / groups, f)" in header and "x (n, h, w, c)" in header
    assert "ho = (h + 6 - 7) / 2 + 1" in header  # the output size with this spec's numbers
    assert "Returns 0, or 1 if the scratch memory could not be allocated" in header
    assert "Python.h" not in source and "cffi" not in source.lower()
    compilers = [(GCC, "c")] + [(cxx, "c++") for cxx in filter(None, [shutil.which("g++")])]
    for compiler, language in compilers:  # the header alone is strict C (and C++ when there is a C++ compiler)
        cc = subprocess.run([compiler, "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-pedantic", "-x", language,
                             str(tmp_path / "conv2d_k7s2p3_nhwc_float32.h")], capture_output=True, text=True)
        assert cc.returncode == 0, cc.stderr


# ----------------------------------------------------------------------------------------- compare
def test_compare_prints_a_table_of_implementations():
    proc = convgen("compare", "k3s1p1", "--shape", "1,2,6,6,3", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "conv2d k3s1p1 float32 NCHW, x (1, 2, 6, 6) -> 3 channels"
    assert lines[1].split() == ["implementation", "algorithm", "time/call", "GFLOP/s", "specialized", "is"]
    assert lines[-1].startswith("GFLOP/s: the direct convolution's FLOP count")
    rows = {re.split(r"\s{2,}", line.strip())[0]: line for line in lines[2:-1]}
    expected = {"convgen specialized", "convgen generic", "numpy im2col+matmul"}
    try:
        import torch  # noqa: F401
        expected.add("pytorch")
    except ImportError:
        pass
    assert set(rows) == expected
    number = r"\d+\.\d+"
    # Two channels: too few for Winograd to pay, so "auto" runs the direct kernel.
    assert re.fullmatch(rf"convgen specialized\s+direct\s+{number} ms\s+{number}\s+-", rows["convgen specialized"])
    algorithms = {"convgen generic": r"direct\s+"}
    for name in expected - {"convgen specialized"}:
        pattern = rf"{re.escape(name)}\s+{algorithms.get(name, '')}{number} ms\s+{number}\s+{number}x (faster|slower)"
        assert re.fullmatch(pattern, rows[name]), rows[name]
        ratio = float(rows[name].split()[-2].rstrip("x"))
        assert ratio >= 1, "a ratio below 1 is written the other way round"
