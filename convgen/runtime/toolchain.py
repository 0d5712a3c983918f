"""The C compiler on this machine: which one, and what it targets here.

`find_compiler` picks the compiler, `native_macros` asks it once what `-march=native` means on this
machine (the schedule picks its instruction set from that), and `compiler_version` names it for the
cache key, native macros included. Nothing here imports the rest of convgen.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sysconfig

INSTALL_HINT = ("convgen compiles its kernels at run time and needs a C compiler with OpenMP: install gcc "
                "(Debian/Ubuntu: `apt-get install gcc`; Fedora: `dnf install gcc`; macOS: `brew install gcc`), "
                "or set CC to a compiler's path")


class BuildError(RuntimeError):
    """The C compiler is missing or rejected a kernel module."""


def find_compiler() -> str:
    """CC if set (it must exist), else the compiler Python was built with, else cc/gcc/clang on PATH."""
    if os.environ.get("CC"):
        name = shlex.split(os.environ["CC"])[0]
        path = shutil.which(name)
        if path is None:
            raise BuildError(f"CC={os.environ['CC']!r} names no compiler on PATH; {INSTALL_HINT}")
        return os.path.realpath(path)
    candidates = []
    configured = sysconfig.get_config_var("CC")
    if configured:
        candidates.append(shlex.split(configured)[0])
    candidates += ["cc", "gcc", "clang"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return os.path.realpath(path)
    raise BuildError(f"no C compiler found on PATH ({', '.join(dict.fromkeys(candidates))} tried): {INSTALL_HINT}")


def compiler_env() -> dict:
    """The environment the compiler runs in: this one, minus a preloaded sanitizer runtime (which
    `make sanitize` gives the Python process, and which the compiler itself has no use for)."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


@functools.lru_cache(maxsize=None)
def native_macros(compiler: str) -> tuple[str, ...]:
    """The `#define` lines `compiler -march=native` predefines, sorted: what the build machine can run.
    Empty if the compiler cannot be run or knows no -march=native."""
    try:
        out = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c", os.devnull],
                             capture_output=True, text=True, timeout=60, env=compiler_env())
    except (OSError, subprocess.SubprocessError):
        return ()
    if out.returncode != 0:
        return ()
    return tuple(sorted(line for line in out.stdout.splitlines() if line.startswith("#define ")))


@functools.lru_cache(maxsize=None)
def compiler_version(compiler: str) -> str:
    """The compiler's identity as far as its output is concerned: its version line, and a digest of
    the macros it predefines under -march=native (two machines of one ISA family can differ there,
    and a binary built for the richer one would die of an illegal instruction on the other)."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60,
                             env=compiler_env())
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"cannot run the C compiler {compiler}: {exc}") from exc
    lines = (out.stdout or out.stderr).strip().splitlines()
    macros = "\n".join(native_macros(compiler)) or "no -march=native"
    return f"{lines[0] if lines else 'unknown'} [native {hashlib.sha256(macros.encode()).hexdigest()[:16]}]"
