"""Compiled kernels by spec: render → build → cache → load, the settings they are built with, and
the one way to call them.

`get_kernels(spec)` is the one place that turns a spec into callable C. Its `Kernels` load on an op's
first call the module that carries it: the module of every op if the cache holds one (`build_all`
makes them), else a module of that op alone, rendered with only its kernels under the active
schedule and toolchain. Every module is keyed in the cache on all of that, and stays loaded for the
life of the process (or until `reset()`). `Kernels.call(entry, problem, arrays)` calls an entry
point with the arguments `convgen.codegen.abi` declares for it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import contextlib
import dataclasses
import os
import platform
import threading

import numpy as np

from ..codegen import abi
from .._version import __version__
from .build import (Toolchain, build_core_object, build_interface_object, build_module, default_toolchain,
                    interface_cflags, interface_module_name, python_abi)
from .cache import INTERFACE_PREFIX, compiled_templates, core_object, load_if_cached, load_or_build, module_key
from ..planning.problem import Problem
from ..codegen.render import Rendered, render
from ..planning.schedule import Schedule, get_schedule
from ..planning.spec import ConvSpec, cached_hash, state_without_hash


# What an op's first call compiles when the cache has nothing for it: "per-op", a module of that op
# alone (the shortest wait for a first call); "whole", one module of every op of the spec (the fewest
# compile seconds for a program that will call them all, as training does: one compile instead of three).
MODULES = ("per-op", "whole")


def check_modules(modules, name: str = "modules") -> str:
    if modules not in MODULES:
        raise ValueError(f"{name} must be one of {MODULES}, got {modules!r}")
    return modules


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every kernel is built with: the toolchain, the ISA, any schedule overrides and the
    template directory (None: convgen's own); and which module an op's first call builds
    (`modules`, one of MODULES).

    It keys the loaded modules and the ops' call plans, so its hash is computed once.
    """

    toolchain: Toolchain
    isa: str | None = None
    schedule_overrides: tuple = ()
    templates: str | None = None
    modules: str = "per-op"

    __hash__ = cached_hash
    __getstate__ = state_without_hash

    def schedule(self) -> Schedule:
        return get_schedule(self.toolchain.supported_isas(), self.isa, **dict(self.schedule_overrides))


class Kernels:
    """The C entry points of one spec under one set of settings, loaded as they are first needed.

    An op's first call loads the module that carries it: a module of every op when the cache holds
    one (`build_all` and `convgen build` make those: one compile per spec), else the op's own module,
    built now if need be, so a forward pass never waits for the compile of its gradients (under
    modules="whole" it builds the module of every op instead: one compile for all three ops).
    """

    def __init__(self, spec: ConvSpec, active: Settings):
        self.spec = spec
        self.settings = active
        self._modules: dict = {}    # op -> (loaded module, its Rendered)
        # entry -> (C function, its module's ffi.from_buffer, NULL and ffi.cast), as modules load
        self._entries: dict = {}
        self._queries: dict = {}    # op -> {query: C function}
        self._whole_looked_up = False
        self._whole: Rendered | None = None  # the module of every op, rendered once
        self._c_array = spec.c_type + "[]"
        self._c_pointer = spec.c_type + " *"
        self._arguments: dict = {}  # id(problem) -> (problem, its size arguments), computed once per problem
        self._address_forms: dict = {}  # op -> (its address form, its module's ffi), as modules load
        # (id(problem), op) -> (problem, the address form, its size arguments as a C array, the epilogue's scalars)
        self._address_calls: dict = {}

    def _render(self, ops=None) -> Rendered:
        return render(self.spec, self.settings.schedule(), self.settings.templates, ops=ops, split=True,
                      compiled_templates=compiled_templates())

    def _render_whole(self) -> Rendered:
        if self._whole is None:
            self._whole = self._render()
        return self._whole

    def _register(self, module, rendered: Rendered) -> None:
        """Take the entry points of `module` for every op it carries that none loaded before."""
        with _lock:
            for op in rendered.ops:
                if op in self._modules:
                    continue
                lib = module.lib
                self._queries[op] = {query: getattr(lib, abi.interface_symbol(query)) for query in abi.QUERIES}
                self._entries[op] = (getattr(lib, abi.interface_symbol(op)), module.ffi.from_buffer, module.ffi.NULL,
                                     module.ffi.cast)
                self._address_forms[op] = (getattr(lib, abi.address_symbol(op)), module.ffi)
                self._modules[op] = (module, rendered)

    def _build(self, rendered: Rendered) -> bool:
        """Load the module of `rendered`, compiling it if the cache lacks it; True if compiled now. The
        compile runs outside the process-wide lock, so different modules build in parallel; the
        cache's file lock makes concurrent requests for the same module compile it once. A module
        links its interface object, and a split module the parts of its core object, each built first
        if the cache lacks it."""
        toolchain = self.settings.toolchain

        def build(name, build_dir):
            cores = tuple(functools.partial(_core_object, rendered, source, toolchain, build_dir)
                          for source in rendered.cores)
            interface = functools.partial(_interface_object, rendered, toolchain, build_dir)
            return build_module(name, rendered, toolchain, build_dir, cores, interface)

        module, built = load_or_build(cache_key(rendered, toolchain), build, interface_module_name(rendered))
        self._register(module, rendered)
        return built

    def load(self, op: str, whole: bool | None = None) -> bool:
        """Load the module that carries `op`: every op's when the cache holds it, else build one, of
        every op if `whole` (default: the settings' modules == "whole"), else of `op` alone. True if a
        module was compiled now."""
        if op in self._modules or self._take_whole_if_cached():
            return False
        if whole is None:
            # An epilogue is the forward pass's alone: its spec's gradients would be those of the spec
            # without one, so a fused call never waits for their compile.
            whole = self.settings.modules == "whole" and not self.spec.epilogue.active
        if whole:
            return self.load_whole()
        return self._build(self._render(ops=(op,)))

    def _take_whole_if_cached(self) -> bool:
        """Load the module of every op if the cache holds it (looked up once); True if it did."""
        if self._whole_looked_up:
            return False
        self._whole_looked_up = True
        if self.spec.epilogue.active:
            return False  # (a fused forward pass builds its own module: see load)
        whole = self._render_whole()
        module = load_if_cached(cache_key(whole, self.settings.toolchain), interface_module_name(whole))
        if module is not None:
            self._register(module, whole)
        return module is not None

    def load_whole(self) -> bool:
        """Load the module of every op, building it if the cache lacks it (what `build_all` does ahead
        of time); True if it was compiled now. Ops loaded before keep their own modules."""
        if all(op in self._modules for op in abi.OPS):
            return False
        self._whole_looked_up = True
        return self._build(self._render_whole())

    def prepare(self, ops) -> None:
        """Load the modules of `ops` now, compiling those the cache lacks side by side (the first
        backward pass of a window needs two)."""
        self._take_whole_if_cached()
        missing = [op for op in abi.as_ops(ops) if op not in self._modules]
        if len(missing) > 1 and self.settings.modules == "per-op":
            with concurrent.futures.ThreadPoolExecutor(len(missing)) as pool:
                list(pool.map(self.load, missing))
        elif missing:
            self.load(missing[0])

    def module(self, op: str):
        """The loaded cffi module of `op` (its `lib` and `ffi`), loading it first: for callers that
        call the C functions themselves (the overhead benchmark)."""
        self.load(op)
        return self._modules[op][0]

    def rendered(self, op: str = "fwd") -> Rendered:
        """The rendered source of `op`'s module, as built (loading it first)."""
        self.load(op)
        return self._modules[op][1]

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
        (`convgen.frontend.resolve`). A transposed problem runs as its `conv()`. MemoryError if the
        kernel could not allocate its workspace.
        """
        function, from_buffer, null, _ = self._entry(entry)
        c_array = self._c_array
        pointers = [null if a is None else from_buffer(c_array, a, False) for a in arrays]
        if entry == "fwd":  # its scalars: the epilogue's parameters
            pointers += problem.epilogue.arguments
        self._run(function, pointers, problem, nthreads)

    def call_addresses(self, entry: str, problem: Problem, addresses, nthreads: int | None = None) -> None:
        """`call` with the arrays given by the addresses of their first elements (ints, 0 for NULL):
        for callers whose arrays are not NumPy's (PyTorch tensors). The memory must be what `call`
        requires of its arrays: C-contiguous, of the spec's dtype and of the problem's shapes."""
        found = self._address_calls.get((id(problem), entry))
        if found is None or found[0] is not problem:
            found = self._address_call(entry, problem)
        _, function, sizes, scalars = found
        if function(*addresses, *scalars, sizes, nthreads or num_threads()) != 0:
            raise MemoryError(f"convgen kernel {self.spec} could not allocate its workspace")

    def _address_call(self, entry: str, problem: Problem) -> tuple:
        """What `call_addresses` calls for `entry` and `problem`, made once per problem (keyed by
        identity, as `_sizes`; the entry holds the problem, so its id is not reused meanwhile)."""
        self._entry(entry)  # (loads the module)
        function, ffi = self._address_forms[entry]
        scalars = tuple(problem.epilogue.arguments) if entry == "fwd" else ()  # the epilogue's parameters
        found = (problem, function, ffi.new("int64_t[]", list(self._sizes(problem))), scalars)
        if len(self._address_calls) >= 1024:
            self._address_calls.clear()
        self._address_calls[(id(problem), entry)] = found
        return found

    def _entry(self, entry: str) -> tuple:
        """(C function, ffi.from_buffer, NULL, ffi.cast) of `entry`, its module loaded first if need be."""
        found = self._entries.get(entry)
        if found is None:
            self.load(entry)
            found = self._entries[entry]
        return found

    def _run(self, function, pointers, problem: Problem, nthreads: int | None) -> None:
        status = function(*pointers, *self._sizes(problem), nthreads or num_threads())
        if status != 0:
            raise MemoryError(f"convgen kernel {self.spec} could not allocate its workspace")

    def _query(self, query: str, entry: str, problem: Problem, nthreads: int | None) -> int:
        self.load(entry)
        return int(self._queries[entry][query](abi.OP_IDS[entry], *self._sizes(problem), nthreads or num_threads()))

    def workspace_bytes(self, entry: str, problem: Problem, nthreads: int | None = None) -> int:
        """Bytes of workspace entry point `entry` allocates for `problem`."""
        return self._query("workspace", entry, problem, nthreads)

    def threads(self, entry: str, problem: Problem, nthreads: int | None = None) -> int:
        """Threads entry point `entry` runs on for `problem` (at most nthreads, default `num_threads()`)."""
        return self._query("threads", entry, problem, nthreads)

    def prepared_size(self, entry: str, problem: Problem) -> int:
        """Elements of `entry`'s prepared weights for `problem`; 0 if it reads the weights as they are."""
        return self._query("prepared_size", entry, problem, 1)

    def prepare_weights(self, entry: str, problem: Problem, weight, nthreads: int | None = None):
        """The weights laid out once as entry point `entry` ("fwd" or "bwd_data") reads them for
        `problem` (its packed panels, or Winograd's transformed filters): an aligned array to pass as
        the entry's `prepared` argument (`call`, `call_addresses`) instead of laying them out on every
        call, valid while the weights keep their values; None when the entry reads them as they are.

        weight: as `call` takes it (C-contiguous, the spec's dtype, the problem's weight shape), or
        the address of such memory (an int). MemoryError if the kernel's scratch could not be had.
        """
        size = self.prepared_size(entry, problem)
        if size == 0:
            return None
        _, from_buffer, _, cast = self._entry(entry)
        dtype = np.dtype(self.spec.dtype)
        raw = np.empty(size * dtype.itemsize + abi.PREPARED_ALIGN, np.uint8)
        start = -raw.ctypes.data % abi.PREPARED_ALIGN
        prepared = raw[start:start + size * dtype.itemsize].view(dtype)  # (holds `raw`, its base)
        weight_pointer = cast(self._c_pointer, weight) if isinstance(weight, int) else from_buffer(self._c_array, weight, False)
        status = self._queries[entry]["prepare"](abi.OP_IDS[entry], weight_pointer, from_buffer(self._c_array, prepared, True),
                                                 *self._sizes(problem), nthreads or num_threads())
        if status != 0:
            raise MemoryError(f"convgen kernel {self.spec} could not allocate the scratch to prepare its weights")
        return prepared


_lock = threading.Lock()
_default_settings: Settings | None = None  # from the environment, made on first use
_configured: list = []                     # the settings of the configure() blocks being run, innermost last
_loaded: dict = {}
_num_threads: int | None = None


def settings() -> Settings:
    """The settings kernels are built and loaded with now: the innermost configure() block's, else
    the defaults read from the environment (CC, CONVGEN_CFLAGS, CONVGEN_ISA, CONVGEN_MODULES)."""
    global _default_settings
    if _configured:
        return _configured[-1]
    if _default_settings is None:
        modules = check_modules(os.environ.get("CONVGEN_MODULES") or "per-op", "CONVGEN_MODULES")
        _default_settings = Settings(default_toolchain(), modules=modules)
    return _default_settings


@contextlib.contextmanager
def configure(*, isa: str | None = None, cflags: tuple[str, ...] | None = None, templates=None,
              modules: str | None = None, **schedule_overrides):
    """Build and use kernels with another ISA, compiler flags, schedule or templates inside a `with` block.

    `cflags` replace the default optimization flags (-O3, and -O1 with CG_HOT functions at -O2 for a
    split module's window code) in every part of every module. `templates` is a directory laid out
    as convgen's templates/ (e.g. an edited copy of it); the cache keys on the rendered source, so an
    edit always builds new modules. `modules` is what an op's first call compiles: "per-op" (its own
    module) or "whole" (one module of every op).

    >>> with configure(isa="avx2"):            # doctest: +SKIP
    ...     y = conv2d(x, w)                   # the AVX2 kernels, built on first use
    """
    previous = settings()
    toolchain = (previous.toolchain if cflags is None
                 else dataclasses.replace(previous.toolchain, cflags=tuple(cflags), window_cflags=None))
    if templates is not None and not os.path.isdir(templates):
        raise ValueError(f"templates must be a directory of convgen templates, got {templates!r}")
    candidate = Settings(toolchain, isa, tuple(sorted(schedule_overrides.items())),
                         None if templates is None else os.path.abspath(templates),
                         previous.modules if modules is None else check_modules(modules))
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
    return module_key(rendered.source, *rendered.cores, rendered.cdef, toolchain.compiler, toolchain.version,
                      " ".join(toolchain.cflags), " ".join(toolchain.module_cflags(rendered)),
                      repr(rendered.schedule), __version__, python_abi(), platform.machine(),
                      interface_key(rendered, toolchain))


def interface_key(rendered: Rendered, toolchain: Toolchain) -> str:
    """Hash of everything that changes the interface object a module links."""
    return module_key("interface object", interface_module_name(rendered), abi.interface_source(rendered.spec, rendered.ops),
                      toolchain.compiler, toolchain.version, " ".join(interface_cflags(toolchain)), __version__,
                      python_abi(), platform.machine())


def _interface_object(rendered: Rendered, toolchain: Toolchain, into):
    """A checked copy, in the directory `into`, of the interface object the module `rendered` links,
    built first if the cache lacks it."""
    return core_object(interface_key(rendered, toolchain),
                       lambda name, build_dir: build_interface_object(name, rendered, toolchain, build_dir), into,
                       prefix=INTERFACE_PREFIX)


def core_key(source: str, rendered: Rendered, toolchain: Toolchain) -> str:
    """Hash of everything that changes the part `source` of the core object the split module
    `rendered` links."""
    return module_key("core object", source, toolchain.compiler, toolchain.version, " ".join(toolchain.cflags),
                      repr(rendered.schedule), __version__, python_abi(), platform.machine())


def _core_object(rendered: Rendered, source: str, toolchain: Toolchain, into):
    """A checked copy, in the directory `into`, of the object of the part `source` of the core object
    the split module `rendered` links, built first if the cache lacks it."""
    return core_object(core_key(source, rendered, toolchain),
                       lambda name, build_dir: build_core_object(name, rendered, source, toolchain, build_dir), into)


@functools.lru_cache(maxsize=64)
def with_schedule(active: Settings, overrides: tuple) -> Settings:
    """`active` with the schedule fields `overrides` ((field, value) pairs) set as well: what a plan
    of a measured schedule variant builds its kernels with. The same object for the same pair, so
    the kernels keyed on it are found again."""
    merged = tuple(sorted({**dict(active.schedule_overrides), **dict(overrides)}.items()))
    replaced = dataclasses.replace(active, schedule_overrides=merged)
    replaced.schedule()  # validate
    return replaced


def get_kernels(spec: ConvSpec, active: Settings | None = None) -> Kernels:
    """The kernels of `spec` under `active` (default: the active settings); each op's module is
    built on its first call (or ahead of time by `build_all`)."""
    active = settings() if active is None else active
    found = _loaded.get((spec, active))
    if found is not None:
        return found
    with _lock:
        return _loaded.setdefault((spec, active), Kernels(spec, active))


def build_all(specs, jobs: int | None = None, on_done=None, ops=None) -> dict:
    """Build (or load from the cache) the kernels of every spec, `jobs` compiles at a time.

    By default each spec is one module of every op, compiled once (what a program about to use
    every op of a spec wants; a spec with an epilogue, its forward module alone); `ops` ("fwd",
    "bwd_data", "bwd_weight") builds those ops' own modules instead. Returns {spec: "built" | "cached" | exception}: "built" if any of its modules was compiled
    now, the first exception if one failed. on_done(spec, outcome) is called as each spec is done.
    """
    specs = list(dict.fromkeys(specs))
    loaded = {spec: get_kernels(spec) for spec in specs}
    # (a spec with an epilogue is the forward pass's alone: its module carries that op)
    jobs_of = {spec: [loaded[spec].load_whole] if ops is None and not spec.epilogue.active else
               [functools.partial(loaded[spec].load, op, whole=False) for op in abi.as_ops(ops or "fwd")]
               for spec in specs}
    remaining = {spec: len(jobs_of[spec]) for spec in specs}
    outcomes: dict = {}

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or num_threads()) as pool:
        futures = {pool.submit(job): spec for spec in specs for job in jobs_of[spec]}
        for future in concurrent.futures.as_completed(futures):
            spec = futures[future]
            try:
                outcome = "built" if future.result() else "cached"
            except Exception as exc:  # reported per spec; the caller decides what a failure means
                outcome = exc
            previous = outcomes.get(spec, "cached")
            outcomes[spec] = previous if isinstance(previous, Exception) or outcome == "cached" else outcome
            remaining[spec] -= 1
            if remaining[spec] == 0 and on_done is not None:
                on_done(spec, outcomes[spec])
    return outcomes
