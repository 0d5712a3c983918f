"""The on-disk cache of built kernel modules: where it is, what a module is called, and how one is
built, published, loaded, listed and cleared there. Every path inside the cache directory comes
from here. The other writers: build.py (a module's C and binary, into the private build directory
handed to it from here) and export.py and the CLI (rendered and exported C, where the user asks).

A module is named after a hash of everything that changes its binary, so a changed template,
compiler, flag, schedule or interpreter can never load an old binary. Builds happen in a private
temporary directory under an inter-process lock and are published with an atomic rename, next to
a digest of the published file; a module whose digest does not match, that fails to import, or
that someone else could have written, is rebuilt with a warning. The directory itself must be
private to the user (a planted module would run as them): anything else is refused before
anything is loaded. The templates compiled to Python are kept here too (`CompiledTemplates`), under
the same rule: only this user's files that nobody else may write are loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import jinja2

from .build import BuildError, extension_suffix

MODULE_PREFIX = "_cg_"
# The core objects that split modules link (see convgen.codegen.render): `_cg_core_<key>.o`.
CORE_PREFIX = MODULE_PREFIX + "core_"
# The interface objects every module links (see convgen.runtime.build): `_cg_interface_<key>.o`.
INTERFACE_PREFIX = MODULE_PREFIX + "interface_"
# The templates compiled to Python (see convgen.codegen.render), a directory `convgen cache clear` removes.
COMPILED_TEMPLATES = MODULE_PREFIX + "templates"


class CacheError(RuntimeError):
    """The cache directory cannot be used safely."""


def cache_dir() -> Path:
    """CONVGEN_CACHE_DIR, else $XDG_CACHE_HOME/convgen, else ~/.cache/convgen."""
    if os.environ.get("CONVGEN_CACHE_DIR"):
        return Path(os.environ["CONVGEN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "convgen"


def checked_cache_dir(create: bool = True) -> Path:
    """The cache directory, created 0700 if missing, refused unless private to this user.

    A directory that others can write to could hold a planted module that would run as this user.
    """
    path = cache_dir()
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create the convgen cache directory {path}: {exc}") from exc
    try:
        info = path.stat()
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"the convgen cache path {path} is not a directory")
    if info.st_uid != os.getuid():
        raise CacheError(f"refusing the convgen cache directory {path}: it is owned by uid {info.st_uid}, "
                         f"not by this user ({os.getuid()}); set CONVGEN_CACHE_DIR to a private directory")
    if info.st_mode & 0o022:
        raise CacheError(f"refusing the convgen cache directory {path}: it is writable by group or others "
                         f"(mode {stat.S_IMODE(info.st_mode):04o}); run `chmod 700 {path}` or set CONVGEN_CACHE_DIR")
    return path


def module_key(*parts: str) -> str:
    """Hash of everything that changes a module's binary."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def module_name(key: str, prefix: str = MODULE_PREFIX) -> str:
    """The file name (without suffix) of the module for `key`, or with prefix=CORE_PREFIX or
    INTERFACE_PREFIX of the object for it. (cffi bakes a module's name into the binary, so the name
    carries the key.)"""
    return prefix + key[:32]


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def import_extension(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _locked(lock_path: Path):
    """An exclusive inter-process lock (fcntl.flock) held for the duration of the block."""
    try:
        handle = open(lock_path, "a")
    except OSError as exc:
        raise CacheError(f"cannot lock {lock_path} in the convgen cache: {exc}") from exc
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _private(info: os.stat_result) -> bool:
    """Whether a file is this user's and nobody else may write it: the only files loaded (one planted
    while the directory was still open to others would survive a later chmod of the directory)."""
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _check_private_file(path: Path) -> None:
    """Raise ImportError unless `path` is private to this user (`_private`)."""
    info = path.stat()
    if not _private(info):
        raise ImportError(f"{path.name} is owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):04o}; "
                          f"only this user's files, writable by nobody else, are loaded")


def _check_published(path: Path, digest_path: Path, used: Path) -> None:
    """Raise ImportError unless the published file `path` and its digest are private to this user
    and `used` (the file itself, or the copy of it that will be used) matches the digest."""
    try:
        _check_private_file(path)
        _check_private_file(digest_path)
        recorded = digest_path.read_text().strip()
        if used != path:
            shutil.copyfile(path, used)
        actual = file_digest(used)
    except OSError as exc:
        raise ImportError(f"cannot read {path.name} or its digest: {exc}") from exc
    if recorded != actual:
        raise ImportError(f"{path.name} does not match its recorded digest (truncated or modified)")


def _try_load(name: str, so_path: Path, digest_path: Path):
    """The published module, or None if it is absent; raises ImportError if it is damaged or foreign."""
    if not so_path.exists():
        return None
    _check_published(so_path, digest_path, so_path)
    return import_extension(name, so_path)


def _publish(build: Callable[[str, Path], Path], name: str, directory: Path, so_path: Path, digest_path: Path):
    """Build in a private temporary directory, then move the module and its digest into place.

    os.replace is atomic within one file system, so a reader sees the old file or the new one,
    never a partial write; the digest goes second, so a reader between the two sees a mismatch
    and waits for the lock rather than loading.
    """
    try:
        build_dir = Path(tempfile.mkdtemp(prefix=f"{name}.", suffix=".build", dir=directory))
    except OSError as exc:
        raise CacheError(f"cannot write to the convgen cache directory {directory}: {exc}") from exc
    try:
        built = build(name, build_dir)
        digest = build_dir / "digest"
        digest.write_text(file_digest(built) + "\n")
        # Private whatever the umask: a group-writable module would be refused by the next load.
        os.chmod(built, 0o700)
        os.chmod(digest, 0o600)
        os.replace(built, so_path)
        os.replace(digest, digest_path)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def load_if_cached(key: str, import_name: str | None = None):
    """The module for `key` if the cache holds a sound copy of it, else None: never builds and never
    waits (a missing, damaged or foreign copy is left for load_or_build to replace). `import_name`
    as load_or_build's."""
    directory = checked_cache_dir()
    name = module_name(key)
    try:
        return _try_load(import_name or name, directory / f"{name}{extension_suffix()}", directory / f"{name}.sha256")
    except ImportError:
        return None


def _use_or_build(name: str, path: Path, digest_path: Path, use: Callable[[], object],
                  build: Callable[[str, Path], Path], what: str, used_as: str):
    """`use()` of the published file `path` (it returns None if the file is absent, raises ImportError
    if it is damaged or foreign), building and publishing the file first, once across processes, if
    there is no sound one. Returns (what use() returned, whether this call built the file)."""
    directory = path.parent
    # The common case, a file built earlier, needs no lock.
    with contextlib.suppress(ImportError):
        used = use()
        if used is not None:
            return used, False
    with _locked(directory / f"{name}.lock"):
        # Another process may have published it while this one waited for the lock.
        try:
            used = use()
            if used is not None:
                return used, False
        except ImportError as exc:
            warnings.warn(f"convgen: rebuilding the damaged cached {what} {path.name}: {exc}",
                          RuntimeWarning, stacklevel=4)
        _publish(build, name, directory, path, digest_path)
        try:
            used = use()
        except ImportError as exc:
            raise BuildError(f"the {what} {path.name} was built but cannot be {used_as}: {exc}") from exc
        if used is None:
            raise BuildError(f"the {what} {path.name} was built but is not in the cache")
        return used, True


def load_or_build(key: str, build: Callable[[str, Path], Path], import_name: str | None = None):
    """Import the module for `key`, building it first (once, across processes) if needed.

    `build(module_name, build_dir)` compiles the module into build_dir and returns the .so path.
    `import_name`: the extension module name its binary carries, if not `module_name(key)` (the
    modules that link an interface object carry its name: see convgen.runtime.build).
    Returns (module, built) where built says whether this call compiled it.
    """
    directory = checked_cache_dir()
    name = module_name(key)
    so_path = directory / f"{name}{extension_suffix()}"
    digest_path = directory / f"{name}.sha256"
    return _use_or_build(name, so_path, digest_path, lambda: _try_load(import_name or name, so_path, digest_path),
                         build, "kernel module", "loaded")


def core_object(key: str, build: Callable[[str, Path], Path], into: Path, prefix: str = CORE_PREFIX) -> Path:
    """A checked copy, in the directory `into`, of the object for `key` that modules link (a core
    object, or with prefix=INTERFACE_PREFIX an interface object), building and publishing it first
    (once, across processes) if the cache lacks a sound copy. The copy is what gets linked, so the
    file checked against its digest is the file used.

    `build(name, build_dir)` compiles the object into build_dir and returns its path. Called while
    the lock of the module that links it is held: the locks are always taken module first.
    """
    directory = checked_cache_dir()
    name = module_name(key, prefix)
    path, digest_path, copy = directory / f"{name}.o", directory / f"{name}.sha256", into / f"{name}.o"

    def copy_if_sound():
        if not path.exists():
            return None
        _check_published(path, digest_path, copy)
        return copy

    what = "interface object" if prefix == INTERFACE_PREFIX else "core object"
    return _use_or_build(name, path, digest_path, copy_if_sound, build, what, "read back")[0]


def compiled_templates_dir() -> Path:
    """Where the runtime keeps the templates compiled between processes: inside the checked cache
    directory, so that, like the modules, only this user's own files are ever loaded from it."""
    return checked_cache_dir() / COMPILED_TEMPLATES


class CompiledTemplates(jinja2.FileSystemBytecodeCache):
    """The templates compiled to Python, kept on disk between processes: a process's first render
    then loads them (about 0.03 s) instead of parsing and compiling them (about 0.35 s). Jinja keys
    each on the template's name and path and checks its source's digest before use, so an edited
    template is compiled afresh. Compiled templates are Python code: as with the kernel modules, only
    this user's own files that nobody else may write are loaded (`_private`). A cache, nothing more:
    what cannot be read or written is skipped."""

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            if _private(os.stat(self._get_cache_filename(bucket))):
                super().load_bytecode(bucket)
        except (OSError, ValueError, EOFError):
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            super().dump_bytecode(bucket)
        except OSError:
            pass


@functools.lru_cache(maxsize=8)
def _compiled_templates_in(directory: Path) -> CompiledTemplates:
    return CompiledTemplates(str(directory))


def compiled_templates(directory: Path | None = None) -> CompiledTemplates:
    """The store of compiled templates `render` takes: in `directory`, by default the cache's
    (`compiled_templates_dir`); one object per directory for the process."""
    return _compiled_templates_in(Path(directory) if directory is not None else compiled_templates_dir())


def list_modules() -> list[Path]:
    """The published kernel modules in the cache, sorted by file name (none if it does not exist yet)."""
    directory = cache_dir()
    return sorted(directory.glob(f"{MODULE_PREFIX}*{extension_suffix()}")) if directory.is_dir() else []


def cache_info() -> dict:
    """Where the cache is, how many modules it holds and their total size in bytes."""
    modules = list_modules()
    return {"dir": str(cache_dir()), "modules": len(modules), "bytes": sum(p.stat().st_size for p in modules)}


def _building(directory: Path, name: str) -> bool:
    """Whether some process holds the build lock of module `name` right now."""
    try:
        with open(directory / f"{name}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def cache_clear() -> int:
    """Delete every cached module, core and interface object (and their digests and locks) and the
    compiled templates; return how many modules were removed.

    A build in progress in another process keeps its lock and temporary directory, and publishes
    its module when it finishes.
    """
    directory = cache_dir()
    if not directory.is_dir():
        return 0
    modules, removed = set(list_modules()), 0
    busy = {path.name.split(".")[0] for path in directory.glob(f"{MODULE_PREFIX}*.lock")
            if _building(directory, path.name.split(".")[0])}
    for path in directory.glob(f"{MODULE_PREFIX}*"):  # modules, their digests and locks, build directories
        if path.name.split(".")[0] in busy and (path.is_dir() or path.suffix == ".lock"):
            continue
        if path.is_dir():  # the compiled templates, or the temporary directory of a build that was killed
            shutil.rmtree(path, ignore_errors=True)
            continue
        if path in modules:
            removed += 1
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return removed
