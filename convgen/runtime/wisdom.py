"""Wisdom: the algorithm `convgen tune` measured fastest for a class of problems on this machine.

FFTW's idea: a planner that has measured the candidates on the machine it runs on remembers the
winners, and later plans reuse them. Here a class of problems is one op ("conv2d",
"conv2d_backward", ...) of one window, dtype and layout, with its batch, channels, filters and
output pixels rounded to the nearest power of two (`problem_class`); its wisdom is the algorithm
(with Winograd's tile, or a schedule variant of the direct kernels: `planner.VARIANTS`)
`algorithm="auto"` then takes, with the medians that chose it.

Wisdom is one small JSON file (`wisdom_path`: CONVGEN_WISDOM, else wisdom.json in the kernel
cache directory) stamped with what its measurements depend on (`machine`): the CPU, the
instruction set the kernels are built for, the compiler and convgen's version. A file stamped for
anything else is never used, nor imported; a file that cannot be read (truncated, edited into
something that is not wisdom) is ignored with a warning, never an error, and the next `tune`
replaces it. Entries naming an algorithm or tile this convgen does not offer are skipped. Wisdom
only ever chooses among the algorithms "auto" may take for a problem: the planner checks each
choice as it checks a forced one, and falls back to its own rule where the choice does not apply.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import tempfile
import warnings
from pathlib import Path

from .._version import __version__
from ..planning import winograd
from ..planning.planner import VARIANTS
from ..planning.problem import Problem
from .cache import cache_dir

FORMAT = 1
WISDOM_FILE = "wisdom.json"
CHOICES = ("direct", "winograd", "depthwise")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `algorithm="auto"` takes for a class of problems: an algorithm, with Winograd's tile or a
    schedule variant of the direct kernels."""

    algorithm: str
    tile: int | None = None
    variant: str = ""  # a schedule variant of the direct family (planner.VARIANTS), or its rule

    def text(self) -> str:
        if self.tile is not None:
            return f"{self.algorithm} F({self.tile}x{self.tile})"
        return f"{self.algorithm}, {self.variant}" if self.variant else self.algorithm


def wisdom_path() -> Path:
    """CONVGEN_WISDOM, else wisdom.json in the kernel cache directory."""
    if os.environ.get("CONVGEN_WISDOM"):
        return Path(os.environ["CONVGEN_WISDOM"]).expanduser()
    return cache_dir() / WISDOM_FILE


@functools.cache
def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it (model name, family, model, stepping), else platform's."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    if "model name" in fields:
        return (f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}, "
                f"stepping {fields.get('stepping', '?')})")
    return platform.processor() or platform.machine()


def machine(settings) -> dict:
    """What measured wisdom depends on, under `settings` (convgen.runtime.kernels.Settings)."""
    return {"cpu": cpu_name(), "isa": settings.schedule().isa, "compiler": settings.toolchain.version,
            "convgen": __version__}


def _bucket(value: int) -> int:
    """value rounded to the nearest power of two, as its exponent (0 for 0 and 1)."""
    return round(math.log2(value)) if value > 1 else 0


def problem_class(op: str, problem: Problem) -> str:
    """The class of problems `op` on `problem` belongs to, as wisdom keys it: the op, layout, dtype,
    window and whether the call is transposed, exactly; the kind of grouping (none, depthwise,
    other) and the batch, channels, filters and output pixels of its convolution, each rounded to
    the nearest power of two."""
    conv = problem.conv()
    grouping = "g1" if conv.groups == 1 else "dw" if conv.groups == conv.c else "grouped"
    transposed = " transposed" if problem.transpose else ""
    return (f"{op} {problem.layout} {problem.dtype} {problem.window.short()}{transposed}"
            f" {grouping} n~2^{_bucket(conv.n)} c~2^{_bucket(conv.c)} f~2^{_bucket(conv.f)}"
            f" pixels~2^{_bucket(conv.ho * conv.wo)}")


def entry_choice(entry) -> Choice | None:
    """The Choice an entry of the file names, or None when it names none this convgen offers."""
    if not isinstance(entry, dict) or entry.get("algorithm") not in CHOICES:
        return None
    tile, variant = entry.get("tile"), entry.get("variant", "")
    if entry["algorithm"] == "winograd":
        if isinstance(tile, bool) or tile not in winograd.TILES or variant:
            return None
        return Choice("winograd", tile)
    if variant and (entry["algorithm"] != "direct" or variant not in VARIANTS):
        return None
    return Choice(entry["algorithm"], None, variant)


class Wisdom:
    """The wisdom file's contents: its machine stamp and its entries (class -> entry dict)."""

    def __init__(self, stamp: dict, entries: dict):
        self.stamp = stamp
        self.entries = entries

    def choice(self, key: str) -> Choice | None:
        return entry_choice(self.entries.get(key))

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "machine": self.stamp, "entries": self.entries}, indent=1,
                          sort_keys=True) + "\n"


def read(path: Path | None = None, quiet: bool = False) -> Wisdom | None:
    """The wisdom in `path` (default `wisdom_path()`), whatever machine it is stamped for; None when
    there is none. A file that is not wisdom is ignored, with a warning unless `quiet`."""
    path = wisdom_path() if path is None else Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        if not quiet:
            warnings.warn(f"convgen: ignoring the wisdom file {path}: {exc}", RuntimeWarning, stacklevel=2)
        return None
    try:
        data = json.loads(text)
        if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("machine"), dict)
                and isinstance(data.get("entries"), dict)):
            raise ValueError("it is not convgen wisdom of format 1")
    except ValueError as exc:
        if quiet:
            return None
        warnings.warn(f"convgen: ignoring the wisdom file {path}, which cannot be read ({exc}); "
                      f"`convgen tune` writes a new one", RuntimeWarning, stacklevel=2)
        return None
    return Wisdom(data["machine"], data["entries"])


# The wisdom the planner consults, read once per process and path (`forget_loaded` drops it; `tune`
# and `record` replace it), and a count of its changes, which the ops' plan caches key on.
_loaded: dict = {}
_generation = 0


def generation() -> int:
    return _generation


def forget_loaded() -> None:
    """Read the wisdom file again at the next lookup."""
    global _generation
    _loaded.clear()
    _generation += 1


def lookup(op: str, problem: Problem, settings) -> Choice | None:
    """The measured choice for `op` on `problem` under `settings`: only from wisdom stamped for this
    machine, compiler, instruction set and convgen."""
    path = wisdom_path()
    if path not in _loaded:
        _loaded[path] = read(path)
    found = _loaded[path]
    if found is None or found.stamp != machine(settings):
        return None
    return found.choice(problem_class(op, problem))


def write(wisdom: Wisdom, path: Path | None = None) -> Path:
    """Write `wisdom` to `path` (default `wisdom_path()`) atomically: a reader sees the old file or
    the new, never part of one."""
    path = wisdom_path() if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # (the cache directory must stay private)
    fd, temporary = tempfile.mkstemp(prefix=".wisdom-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(wisdom.to_json())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    forget_loaded()
    return path


def record(entries: dict, settings) -> Path:
    """Add `entries` (class -> entry) to this machine's wisdom and write it. Wisdom stamped for
    another machine, or unreadable, is replaced."""
    stamp = machine(settings)
    found = read(quiet=True)  # (what cannot be read is replaced)
    kept = found.entries if found is not None and found.stamp == stamp else {}
    return write(Wisdom(stamp, {**kept, **entries}))


def import_file(source: Path, settings) -> int:
    """Merge the wisdom in `source` into this machine's; return how many entries it added. Wisdom
    stamped for another machine is refused (ValueError): its measurements do not hold here."""
    found = read(source)
    if found is None:
        raise ValueError(f"{source} holds no readable convgen wisdom")
    stamp = machine(settings)
    if found.stamp != stamp:
        raise ValueError(f"{source} was measured on another machine or build ({found.stamp}); this one is {stamp}")
    usable = {key: entry for key, entry in found.entries.items() if entry_choice(entry) is not None}
    record(usable, settings)
    return len(usable)


def forget(path: Path | None = None) -> bool:
    """Remove the wisdom file; whether there was one."""
    path = wisdom_path() if path is None else Path(path)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    finally:
        forget_loaded()
    return True


__all__ = ["Choice", "Wisdom", "CHOICES", "wisdom_path", "machine", "problem_class", "lookup", "read", "write",
           "record", "import_file", "forget", "forget_loaded", "generation", "cpu_name", "entry_choice"]
