"""Compile one rendered kernel module with cffi's out-of-line API mode.

cffi writes the C wrapper (`emit_c_code`); the system compiler is then called directly, so its
command line is exactly the flags in the cache key and its own error message reaches the user.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import cffi
from cffi.recompiler import make_c_source

from .render import Rendered

DEFAULT_CFLAGS = ("-O3",)


class BuildError(RuntimeError):
    """The C compiler is missing or rejected a kernel module."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """The compiler and flags that build every kernel module (all of it goes into the cache key)."""

    compiler: str             # absolute path
    version: str              # first line of `compiler --version`
    cflags: tuple[str, ...]   # optimization and instrumentation flags (CONVGEN_CFLAGS)

    @property
    def python_include(self) -> str:
        return sysconfig.get_paths()["include"]


def find_compiler() -> str:
    """CC if set, else the compiler Python was built with, else cc/gcc/clang on PATH."""
    candidates = []
    if os.environ.get("CC"):
        candidates.append(shlex.split(os.environ["CC"])[0])
    configured = sysconfig.get_config_var("CC")
    if configured:
        candidates.append(shlex.split(configured)[0])
    candidates += ["cc", "gcc", "clang"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return os.path.realpath(path)
    raise BuildError("no C compiler found: convgen compiles its kernels at run time and needs gcc or clang "
                     "(e.g. `apt-get install gcc` on Debian/Ubuntu), or set CC to a compiler's path")


@functools.lru_cache(maxsize=None)
def compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"cannot run the C compiler {compiler}: {exc}") from exc
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else "unknown"


def default_toolchain() -> Toolchain:
    compiler = find_compiler()
    cflags = tuple(shlex.split(os.environ["CONVGEN_CFLAGS"])) if os.environ.get("CONVGEN_CFLAGS") else DEFAULT_CFLAGS
    return Toolchain(compiler, compiler_version(compiler), cflags)


def compile_command(toolchain: Toolchain, rendered: Rendered, c_path: Path, so_path: Path) -> list[str]:
    """The full compiler command line for one module."""
    return [toolchain.compiler, *toolchain.cflags, *rendered.schedule.arch_flags, "-fopenmp", "-fPIC", "-shared",
            "-fno-strict-aliasing", "-I", toolchain.python_include, str(c_path), "-o", str(so_path)]


def extension_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def write_wrapper(module_name: str, rendered: Rendered, c_path: Path) -> None:
    """The cffi C wrapper of `rendered`, importable as `module_name`."""
    ffi = cffi.FFI()
    ffi.cdef(rendered.cdef)
    make_c_source(ffi, module_name, rendered.source, str(c_path), verbose=False)


def build_module(module_name: str, rendered: Rendered, toolchain: Toolchain, build_dir: Path) -> Path:
    """Compile `rendered` as the extension module `module_name` inside build_dir; return the .so path."""
    c_path = build_dir / f"{module_name}.c"
    so_path = build_dir / f"{module_name}{extension_suffix()}"
    write_wrapper(module_name, rendered, c_path)
    command = compile_command(toolchain, rendered, c_path, so_path)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except FileNotFoundError as exc:
        raise BuildError(f"the C compiler {toolchain.compiler} disappeared: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"compiling {rendered.spec} took longer than {exc.timeout} s") from exc
    if result.returncode != 0 or not so_path.exists():
        message = (result.stderr or result.stdout).strip()
        if len(message) > 4000:
            message = message[:2000] + "\n...\n" + message[-2000:]
        raise BuildError(f"compiling kernels for {rendered.spec} failed (exit {result.returncode}):\n"
                         f"$ {shlex.join(command)}\n{message}")
    return so_path


def python_abi() -> str:
    """What a compiled extension depends on from the interpreter."""
    return f"{sys.implementation.cache_tag}|{extension_suffix()}|{sysconfig.get_platform()}"
