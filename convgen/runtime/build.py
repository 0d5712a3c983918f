"""Compile one rendered kernel module with cffi's out-of-line API mode: its kernels as one
translation unit, linked with the objects it shares with other modules (built through the cache):
the interface object and, for a split module, the core object.

cffi writes the C wrapper that lets Python call the entry points (`make_c_source`). That wrapper
reads no window value: under the entry points' interface names (`abi.interface_symbol`) it is the
same for every module of one dtype, build (specialized or generic) and set of ops, so it is compiled
once, as the *interface object*, into an extension module named after it (`interface_module_name`),
and each module's kernels are compiled under those names and linked with it (a module's wrapper and
Python's headers took about a sixth of its compile). The system compiler is called directly, so its
command line is exactly the flags in the cache key and its own error message reaches the user.
Everything a built module depends on besides its rendered source is named here: the compiler and
what `-march=native` means to it on this machine (`Toolchain`, from toolchain.py), the flags, and
the interpreter, platform and cffi version (`python_abi`). All of it goes into the cache key.
The module is written into the build directory the cache hands out (cache.py publishes it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable

import cffi
from cffi.recompiler import make_c_source

from ..codegen import abi
from ..codegen.render import Rendered, compilable_part
from ..planning.schedule import supported_isas
from .toolchain import INSTALL_HINT, BuildError, compiler_env, compiler_version, find_compiler, native_macros

DEFAULT_CFLAGS = ("-O3",)
# A split module's own code (the window's packing, scatter, Winograd's transforms and the loops around
# the core's micro-kernels) by default: -O1, with CG_HOT_O2 defined, so that the few functions marked
# CG_HOT in the templates (those that do their own arithmetic: the direct forward pass's micro-kernel
# over the phase planes and its stores, the input gradient's scatter) compile at -O2. It compiles in
# about 70 % of -O2's time (under half of -O3's) at the same speed (alternated against -O2 on 22 layers,
# forward and backward, both layouts, AVX2: 1.00x geometric mean, each 0.94-1.04x); the loops
# whose speed came from -O3 alone say so in the templates (`omp simd`, `GCC unroll`), which hold at
# -O1 too. The core object and whole modules (depthwise) keep DEFAULT_CFLAGS.
DEFAULT_WINDOW_CFLAGS = ("-O1", "-DCG_HOT_O2")
# Added to every build, after the user's flags: OpenMP, a position-independent shared object, no
# type-based alias analysis (the kernels view one buffer through several pointer types), and hidden
# symbols: the modules of one spec's ops export entry points of the same names, and with only the
# module's init function visible, no module's call can bind to another's function.
FIXED_FLAGS = ("-fopenmp", "-fPIC", "-shared", "-fno-strict-aliasing", "-fvisibility=hidden")
# Linked into every module, after its objects: the math library (the epilogue's exp, erf, tanh).
LINK_LIBRARIES = ("-lm",)


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """The compiler and flags that build every kernel module (all of it goes into the cache key)."""

    compiler: str             # absolute path
    version: str              # first line of `compiler --version`, and what -march=native selects here
    cflags: tuple[str, ...]   # optimization and instrumentation flags (CONVGEN_CFLAGS)
    window_cflags: tuple[str, ...] | None = None   # a split module's own code's, if not cflags

    def module_cflags(self, rendered: Rendered) -> tuple[str, ...]:
        """The flags `rendered`'s own code compiles with: window_cflags for a split module's (the
        core object it links takes cflags), cflags for a whole module."""
        if rendered.cores and self.window_cflags is not None:
            return self.window_cflags
        return self.cflags

    @property
    def python_include(self) -> str:
        return sysconfig.get_paths()["include"]

    def supported_isas(self) -> tuple[str, ...]:
        """The instruction sets this compiler's -march=native can run here, best first."""
        return supported_isas(native_macros(self.compiler))


def default_toolchain() -> Toolchain:
    """The compiler found by `find_compiler`, with CONVGEN_CFLAGS for every part of every module, else
    the defaults (-O3; -O1 with CG_HOT functions at -O2 for a split module's window code)."""
    compiler = find_compiler()
    if os.environ.get("CONVGEN_CFLAGS"):
        cflags = tuple(shlex.split(os.environ["CONVGEN_CFLAGS"]))
        check_sanitizer_runtime(cflags)
        return Toolchain(compiler, compiler_version(compiler), cflags)
    return Toolchain(compiler, compiler_version(compiler), DEFAULT_CFLAGS, DEFAULT_WINDOW_CFLAGS)


def check_sanitizer_runtime(cflags) -> None:
    """Refuse AddressSanitizer builds in a process whose ASan runtime was not loaded first.

    The runtime cannot be loaded later: importing such a module would end the interpreter (see
    `make sanitize` for how to run with it preloaded).
    """
    if not any(flag.startswith("-fsanitize=") and "address" in flag for flag in cflags):
        return
    try:
        with open("/proc/self/maps") as maps:
            loaded = "libasan" in maps.read()
    except OSError:
        return  # no way to tell here; the loader will say
    if not loaded:
        raise BuildError("kernels built with -fsanitize=address can only be loaded into a Python started with the "
                         "AddressSanitizer runtime preloaded, e.g. LD_PRELOAD=\"$(gcc -print-file-name=libasan.so) "
                         "$(gcc -print-file-name=libubsan.so)\" ASAN_OPTIONS=detect_leaks=0 python ...")


def _compiler(toolchain: Toolchain, rendered: Rendered, cflags: tuple[str, ...]) -> list[str]:
    """The compiler with the flags of one step of a module's build: `cflags`, then the schedule's."""
    return [toolchain.compiler, *cflags, *rendered.schedule.arch_flags]


def compile_command(toolchain: Toolchain, rendered: Rendered, c_path: Path, so_path: Path) -> list[str]:
    """The full compiler command line for one module of one translation unit (its own wrapper inside)."""
    return [*_compiler(toolchain, rendered, toolchain.module_cflags(rendered)), *FIXED_FLAGS,
            "-I", toolchain.python_include, str(c_path), "-o", str(so_path), *LINK_LIBRARIES]


def interface_cflags(toolchain: Toolchain) -> tuple[str, ...]:
    """The flags of the interface object: the window code's (it converts arguments: nothing to gain
    from -O3), no ISA flags (it is linked into the modules of every ISA)."""
    return toolchain.window_cflags if toolchain.window_cflags is not None else toolchain.cflags


def interface_command(toolchain: Toolchain, c_path: Path, o_path: Path) -> list[str]:
    """The command line that compiles an interface object (see the module docstring)."""
    flags = [flag for flag in FIXED_FLAGS if flag != "-shared"]
    return [toolchain.compiler, *interface_cflags(toolchain), *flags, "-I", toolchain.python_include,
            "-c", str(c_path), "-o", str(o_path)]


def object_command(toolchain: Toolchain, rendered: Rendered, c_path: Path, o_path: Path,
                   core: bool = False) -> list[str]:
    """The command line that compiles one translation unit of a split module, its own code (or, if
    `core`, its core object, with the toolchain's cflags), without linking."""
    flags = [flag for flag in FIXED_FLAGS if flag != "-shared"]
    cflags = toolchain.cflags if core else toolchain.module_cflags(rendered)
    return [*_compiler(toolchain, rendered, cflags), *flags, "-I", toolchain.python_include,
            "-c", str(c_path), "-o", str(o_path)]


def link_command(toolchain: Toolchain, rendered: Rendered, objects, so_path: Path) -> list[str]:
    """The command line that links a split module's objects into its shared object."""
    return [*_compiler(toolchain, rendered, toolchain.module_cflags(rendered)), *FIXED_FLAGS,
            *map(str, objects), "-o", str(so_path), *LINK_LIBRARIES]


def _start(command: list[str], toolchain: Toolchain) -> subprocess.Popen:
    try:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=compiler_env())
    except OSError as exc:
        raise BuildError(f"cannot run the C compiler {toolchain.compiler}: {exc}; {INSTALL_HINT}") from exc


def _finish(process: subprocess.Popen, command: list[str], rendered: Rendered, output: Path, what: str) -> None:
    """Wait for the compiler `process` (at most 600 s) and raise BuildError unless it wrote `output`."""
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired as exc:
        process.kill()
        process.communicate()
        raise BuildError(f"compiling {what} for {rendered.spec} took longer than {exc.timeout} s") from exc
    if process.returncode != 0 or not output.exists():
        message = (stderr or stdout).strip()
        if len(message) > 4000:
            message = message[:2000] + "\n...\n" + message[-2000:]
        raise BuildError(f"compiling {what} for {rendered.spec} failed (exit {process.returncode}):\n"
                         f"$ {shlex.join(command)}\n{message}")


def _run_compiler(command: list[str], toolchain: Toolchain, rendered: Rendered, output: Path, what: str) -> None:
    _finish(_start(command, toolchain), command, rendered, output, what)


def extension_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _write_cffi_source(module_name: str, cdef: str, source: str, rendered: Rendered, c_path: Path) -> None:
    """The cffi C wrapper of the declarations `cdef` after `source`, importable as `module_name`."""
    ffi = cffi.FFI()
    try:
        ffi.cdef(cdef)
    except (cffi.CDefError, cffi.FFIError) as exc:
        raise BuildError(f"cffi cannot read the declarations rendered for {rendered.spec}: {exc}\n{cdef}") from exc
    make_c_source(ffi, module_name, source, str(c_path), verbose=False)


def write_wrapper(module_name: str, rendered: Rendered, c_path: Path) -> None:
    """The cffi C wrapper of `rendered`, importable as `module_name`."""
    _write_cffi_source(module_name, rendered.cdef, rendered.source, rendered, c_path)


def interface_module_name(rendered: Rendered) -> str:
    """The extension module name of the interface object `rendered` links (what its modules are
    imported as): named after its source (its declarations and the address forms defined on them),
    which is all that makes one differ from another."""
    source = abi.interface_source(rendered.spec, rendered.ops)
    return "_cg_interface_" + hashlib.sha256(source.encode()).hexdigest()[:24]


def renamed_source(rendered: Rendered) -> str:
    """The source the runtime compiles of `rendered`'s kernels: its entry points renamed to the names
    its interface object calls, and their own names kept in the binary as a string, which `convgen
    cache list` reads to label the module."""
    renames = "".join(f"#define {symbol} {abi.interface_symbol(entry)}\n" for entry, symbol in rendered.symbols.items())
    names = "\\0".join(rendered.symbols.values())
    return ("/* The entry points under the names the interface object (convgen/runtime/build.py) calls. */\n"
            f"{renames}{rendered.source}\n"
            f'__attribute__((used)) static const char cg_entry_point_names[] = "{names}";\n')


def write_interface(module_name: str, rendered: Rendered, c_path: Path) -> None:
    """The cffi C wrapper of the interface object of `rendered`, importable as `module_name`: its
    declarations are the prototypes of the entry points the module's kernels define, and it defines
    each op's address form (`abi.address_definition`) on them."""
    _write_cffi_source(module_name, abi.interface_cdef(rendered.spec, rendered.ops),
                       abi.interface_source(rendered.spec, rendered.ops), rendered, c_path)


def build_interface_object(name: str, rendered: Rendered, toolchain: Toolchain, build_dir: Path) -> Path:
    """Compile the interface object of `rendered` as `name`.o inside build_dir."""
    check_sanitizer_runtime(toolchain.cflags)
    c_path, o_path = build_dir / f"{name}.c", build_dir / f"{name}.o"
    write_interface(interface_module_name(rendered), rendered, c_path)
    _run_compiler(interface_command(toolchain, c_path, o_path), toolchain, rendered, o_path, "the interface object")
    return o_path


def build_module(module_name: str, rendered: Rendered, toolchain: Toolchain, build_dir: Path,
                 cores: tuple[Callable[[], Path], ...] = (), interface: Callable[[], Path] | None = None) -> Path:
    """Compile `rendered` inside build_dir; return the .so path.

    With `interface`, a function that returns the path of its interface object (compiling it if need
    be), the module is importable as `interface_module_name(rendered)` and its entry points go by
    their interface names (`abi.interface_symbol`), as the runtime builds every module; without, it
    carries a wrapper of its own and is importable as `module_name`, its entry points under their
    own names. A split module (`rendered.cores` set) takes `cores`, for each part of its core object a
    function that returns the path of that part's object. All are called while the module's own code
    compiles, so the compiles run side by side, and the objects are linked in after.
    """
    check_sanitizer_runtime(toolchain.cflags)  # flags may come from configure(), not only the environment
    c_path = build_dir / f"{module_name}.c"
    so_path = build_dir / f"{module_name}{extension_suffix()}"
    if len(cores) != len(rendered.cores):
        raise ValueError(f"the module of {rendered.spec} links {len(rendered.cores)} core objects: pass as many `cores`")
    if interface is None:
        write_wrapper(module_name, rendered, c_path)
        if not rendered.cores:
            _run_compiler(compile_command(toolchain, rendered, c_path, so_path), toolchain, rendered, so_path,
                          "kernels")
            return so_path
    else:
        c_path.write_text(renamed_source(rendered))
    o_path = build_dir / f"{module_name}.o"
    command = object_command(toolchain, rendered, c_path, o_path)
    process = _start(command, toolchain)
    try:
        # (on a first call both may be missing from the cache: they compile side by side too)
        makers = [make for make in (interface, *cores) if make is not None]
        with concurrent.futures.ThreadPoolExecutor(max(1, len(makers))) as pool:
            shared = list(pool.map(lambda make: make(), makers))
    except BaseException:
        process.kill()
        process.communicate()
        raise
    _finish(process, command, rendered, o_path, "kernels")
    _run_compiler(link_command(toolchain, rendered, (o_path, *shared), so_path), toolchain, rendered, so_path,
                  "and linking kernels")
    return so_path


def build_core_object(name: str, rendered: Rendered, source: str, toolchain: Toolchain, build_dir: Path) -> Path:
    """Compile `source`, a part of the core object of the split module `rendered`, as the object
    `name`.o inside build_dir."""
    check_sanitizer_runtime(toolchain.cflags)
    c_path = build_dir / f"{name}.c"
    o_path = build_dir / f"{name}.o"
    c_path.write_text(compilable_part(source))
    _run_compiler(object_command(toolchain, rendered, c_path, o_path, core=True), toolchain, rendered,
                  o_path, "the core object")
    return o_path


def python_abi() -> str:
    """What a built module depends on besides its source, compiler and flags: the interpreter's
    extension ABI and platform, the cffi that wrote its wrapper, and the flags every build adds."""
    return (f"{sys.implementation.cache_tag}|{extension_suffix()}|{sysconfig.get_platform()}|"
            f"cffi {cffi.__version__}|{' '.join(FIXED_FLAGS + LINK_LIBRARIES)}")
