"""Compiled kernels by spec: render → build → cache → load, and the settings they are built with.

`get_kernels(spec)` is the one place that turns a spec into callable C: it renders the source under
the active schedule and toolchain, keys the cache on all of it, and keeps each loaded module for the
life of the process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import platform
import threading

from . import __version__
from .build import Toolchain, build_module, default_toolchain, python_abi
from .cache import load_or_build, module_key
from .render import Rendered, render
from .schedule import Schedule, get_schedule
from .spec import ConvSpec


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every kernel is built with: the toolchain, the ISA and any schedule overrides.

    It keys the loaded modules and the ops' call plans, so its hash is computed once.
    """

    toolchain: Toolchain
    isa: str | None = None
    schedule_overrides: tuple = ()

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.toolchain, self.isa, self.schedule_overrides))

    def __hash__(self) -> int:
        return self._hash

    def schedule(self) -> Schedule:
        return get_schedule(self.toolchain.compiler, self.isa, **dict(self.schedule_overrides))


class Kernels:
    """The C entry points of one built spec, with the Rendered source they came from."""

    def __init__(self, module, rendered: Rendered):
        self.ffi = module.ffi
        self.lib = module.lib
        self.rendered = rendered
        self.spec = rendered.spec
        self.c_type = rendered.spec.c_type
        for op, symbol in rendered.symbols.items():
            setattr(self, op, getattr(module.lib, symbol))


_lock = threading.Lock()
_settings: Settings | None = None
_loaded: dict = {}
_num_threads: int | None = None


def settings() -> Settings:
    global _settings
    if _settings is None:
        _settings = Settings(default_toolchain())
    return _settings


@contextlib.contextmanager
def configure(*, isa: str | None = None, cflags: tuple[str, ...] | None = None, **schedule_overrides):
    """Build and use kernels with another ISA, compiler flags or schedule inside a `with` block.

    >>> with configure(isa="avx2"):            # doctest: +SKIP
    ...     y = conv2d(x, w)                   # the AVX2 kernels, built on first use
    """
    global _settings
    previous = settings()
    toolchain = previous.toolchain if cflags is None else dataclasses.replace(previous.toolchain, cflags=tuple(cflags))
    candidate = Settings(toolchain, isa, tuple(sorted(schedule_overrides.items())))
    candidate.schedule()  # validate before switching
    _settings = candidate
    try:
        yield candidate
    finally:
        _settings = previous


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
    rendered = render(spec, active.schedule())
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
