"""Compiled kernels by spec: render → build → cache → load, the settings they are built with, and
the one way to call them.

`get_kernels(spec)` is the one place that turns a spec into callable C: it renders the source under
the active schedule and toolchain, keys the cache on all of it, and keeps each loaded module for the
life of the process (or until `reset()`). `Kernels.call(entry, problem, arrays)` calls an entry
point with the arguments `convgen.abi` declares for it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import platform
import threading

from . import abi
from ._version import __version__
from .build import Toolchain, build_module, default_toolchain, python_abi
from .cache import load_or_build, module_key
from .problem import Problem
from .render import Rendered, render
from .schedule import Schedule, get_schedule
from .spec import ConvSpec, cached_hash, state_without_hash


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every kernel is built with: the toolchain, the ISA, any schedule overrides and the
    template directory (None: convgen's own).

    It keys the loaded modules and the ops' call plans, so its hash is computed once.
    """

    toolchain: Toolchain
    isa: str | None = None
    schedule_overrides: tuple = ()
    templates: str | None = None

    __hash__ = cached_hash
    __getstate__ = state_without_hash

    def schedule(self) -> Schedule:
        return get_schedule(self.toolchain.compiler, self.isa, **dict(self.schedule_overrides))


class Kernels:
    """The C entry points of one built spec, with the Rendered source they came from."""

    def __init__(self, module, rendered: Rendered):
        self.ffi = module.ffi
        self.lib = module.lib
        self.rendered = rendered
        self.spec = rendered.spec
        self._entries = {entry: getattr(module.lib, symbol) for entry, symbol in rendered.symbols.items()}
        self._c_array = rendered.spec.c_type + "[]"
        self._arguments: dict = {}  # id(problem) -> (problem, its size arguments), computed once per problem

    def _sizes(self, problem: Problem) -> tuple:
        # Keyed by identity, which costs no hashing on every call; the entry holds the problem, so its
        # id cannot be reused by another object while the entry exists.
        found = self._arguments.get(id(problem))
        if found is None or found[0] is not problem:
            if len(self._arguments) >= 1024:
                self._arguments.clear()
            found = self._arguments[id(problem)] = (problem, abi.size_arguments(problem, self.spec.specialized))
        return found[1]

    def call(self, entry: str, problem: Problem, arrays, nthreads: int | None = None) -> None:
        """Run entry point `entry` ("fwd", "bwd_data" or "bwd_weight") of `problem` on `arrays`.

        `arrays` are the entry's array arguments in `abi.ENTRY_POINTS` order, C-contiguous and of
        the spec's dtype (None for a NULL bias); the kernels trust them, so check them first
        (`convgen.resolve`). A transposed problem runs as its `conv()`. MemoryError if the kernel
        could not allocate its workspace.
        """
        from_buffer, c_array, null = self.ffi.from_buffer, self._c_array, self.ffi.NULL
        pointers = [null if a is None else from_buffer(c_array, a, False) for a in arrays]
        status = self._entries[entry](*pointers, *self._sizes(problem), nthreads or num_threads())
        if status != 0:
            raise MemoryError(f"convgen kernel {self.spec} could not allocate its workspace")

    def _query(self, query: str, entry: str, problem: Problem, nthreads: int | None) -> int:
        return int(self._entries[query](abi.OP_IDS[entry], *self._sizes(problem), nthreads or num_threads()))

    def workspace_bytes(self, entry: str, problem: Problem, nthreads: int | None = None) -> int:
        """Bytes of workspace entry point `entry` allocates for `problem`."""
        return self._query("workspace", entry, problem, nthreads)

    def threads(self, entry: str, problem: Problem, nthreads: int | None = None) -> int:
        """Threads entry point `entry` runs on for `problem` (at most nthreads, default `num_threads()`)."""
        return self._query("threads", entry, problem, nthreads)


_lock = threading.Lock()
_default_settings: Settings | None = None  # from the environment, made on first use
_configured: list = []                     # the settings of the configure() blocks being run, innermost last
_loaded: dict = {}
_num_threads: int | None = None


def settings() -> Settings:
    """The settings kernels are built and loaded with now: the innermost configure() block's, else
    the defaults read from the environment (CC, CONVGEN_CFLAGS, CONVGEN_ISA)."""
    global _default_settings
    if _configured:
        return _configured[-1]
    if _default_settings is None:
        _default_settings = Settings(default_toolchain())
    return _default_settings


@contextlib.contextmanager
def configure(*, isa: str | None = None, cflags: tuple[str, ...] | None = None, templates=None,
              **schedule_overrides):
    """Build and use kernels with another ISA, compiler flags, schedule or templates inside a `with` block.

    `templates` is a directory laid out as convgen's templates/ (e.g. an edited copy of it); the
    cache keys on the rendered source, so an edit always builds new modules.

    >>> with configure(isa="avx2"):            # doctest: +SKIP
    ...     y = conv2d(x, w)                   # the AVX2 kernels, built on first use
    """
    previous = settings()
    toolchain = previous.toolchain if cflags is None else dataclasses.replace(previous.toolchain, cflags=tuple(cflags))
    if templates is not None and not os.path.isdir(templates):
        raise ValueError(f"templates must be a directory of convgen templates, got {templates!r}")
    candidate = Settings(toolchain, isa, tuple(sorted(schedule_overrides.items())),
                         None if templates is None else os.path.abspath(templates))
    candidate.schedule()  # validate before switching
    _configured.append(candidate)
    try:
        yield candidate
    finally:
        _configured.remove(candidate)


def num_threads() -> int:
    """Threads per kernel call: CONVGEN_NUM_THREADS, else every core this process may use."""
    global _num_threads
    if _num_threads is None:
        value = os.environ.get("CONVGEN_NUM_THREADS")
        if value:
            try:
                _num_threads = int(value)
            except ValueError:
                raise ValueError(f"CONVGEN_NUM_THREADS must be a positive integer, got {value!r}") from None
            if _num_threads < 1:
                raise ValueError(f"CONVGEN_NUM_THREADS must be a positive integer, got {value!r}")
        else:
            _num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return _num_threads


def reset() -> None:
    """Forget every loaded module and the default settings, as a new process would.

    Later calls load their kernels again (from the disk cache, or building them); the defaults are
    read afresh from the environment (CC, CONVGEN_CFLAGS, CONVGEN_ISA), and a configure() block
    being run stays in force. For tests and for programs that clear or move the cache.
    """
    global _default_settings
    with _lock:
        _loaded.clear()
        _default_settings = None


def set_num_threads(n: int) -> None:
    """Set the number of threads each kernel call uses."""
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_threads must be a positive int, got {n!r}")
    _num_threads = n


def cache_key(rendered: Rendered, toolchain: Toolchain) -> str:
    return module_key(rendered.source, rendered.cdef, toolchain.compiler, toolchain.version,
                      " ".join(toolchain.cflags), repr(rendered.schedule), __version__, python_abi(),
                      platform.machine())


def get_kernels(spec: ConvSpec) -> Kernels:
    """The loaded kernels of `spec` under the active settings, building them on first use."""
    active = settings()
    found = _loaded.get((spec, active))
    if found is not None:
        return found
    return _load(spec, active)[0]


def _load(spec: ConvSpec, active: Settings) -> tuple[Kernels, bool]:
    """Load the kernels of `spec` (building them if the cache lacks them); returns (kernels, built).

    The compile runs outside the process-wide lock, so different specs build in parallel; the
    cache's file lock makes concurrent requests for the same spec compile it once.
    """
    rendered = render(spec, active.schedule(), active.templates)
    key = cache_key(rendered, active.toolchain)
    module, built = load_or_build(key, lambda name, build_dir: build_module(name, rendered, active.toolchain,
                                                                           build_dir))
    with _lock:
        return _loaded.setdefault((spec, active), Kernels(module, rendered)), built


def build_all(specs, jobs: int | None = None, on_done=None) -> dict:
    """Build (or load from the cache) every spec, `jobs` compiles at a time.

    Returns {spec: "built" | "cached" | exception}. on_done(spec, outcome) is called as each finishes.
    """
    active = settings()
    specs = list(dict.fromkeys(specs))
    outcomes = {}

    def one(spec):
        return "built" if _load(spec, active)[1] else "cached"

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or num_threads()) as pool:
        futures = {pool.submit(one, spec): spec for spec in specs}
        for future in concurrent.futures.as_completed(futures):
            spec = futures[future]
            try:
                outcome = future.result()
            except Exception as exc:  # reported per spec; the caller decides what a failure means
                outcome = exc
            outcomes[spec] = outcome
            if on_done is not None:
                on_done(spec, outcome)
    return outcomes
