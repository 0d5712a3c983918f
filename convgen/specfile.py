"""Kernel-set files: TOML lists of specs to build ahead of time or render into generated/.

    # kernels.toml
    [[set]]
    windows = ["k3s1p1", "k3s2p1"]   # the compact window text of ConvSpec.parse
    dtypes = ["float32", "float64"]  # default ["float32"]
    layouts = ["NCHW"]               # default ["NCHW"]
    generic = true                   # also the generic build of each dtype × layout (default true)
    algorithms = ["direct", "winograd"]  # default both; winograd only for the windows it computes

Each [[set]] stands for every window × dtype × layout × algorithm combination. A Winograd module
gets the tile the active schedule uses (`planner.winograd_tile`), the one `algorithm="auto"` calls.
"depthwise" (not among the defaults) adds the depthwise family's module of every window, and with
`generic = true` its generic build beside the direct one.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from .spec import ConvSpec, winograd_computes

_KEYS = {"windows", "dtypes", "layouts", "generic", "algorithms"}
_ALGORITHMS = ("direct", "winograd", "depthwise")
_DEFAULT_ALGORITHMS = ["direct", "winograd"]


def load_spec_file(path) -> list[ConvSpec]:
    """The specs a kernel-set file lists, in file order, without repeats."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"spec file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"spec file {path} is not valid TOML: {exc}") from None
    sets = data.get("set")
    if not isinstance(sets, list) or not sets:
        raise ValueError(f"spec file {path} must contain at least one [[set]] table")
    specs = []
    for number, entry in enumerate(sets, 1):
        unknown = set(entry) - _KEYS
        if unknown:
            raise ValueError(f"spec file {path}, set {number}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
        windows = entry.get("windows", [])
        dtypes = entry.get("dtypes", ["float32"])
        layouts = entry.get("layouts", ["NCHW"])
        algorithms = entry.get("algorithms", list(_DEFAULT_ALGORITHMS))
        for name, value in (("windows", windows), ("dtypes", dtypes), ("layouts", layouts), ("algorithms", algorithms)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"spec file {path}, set {number}: {name} must be a list of strings")
        unknown = set(algorithms) - set(_ALGORITHMS)
        if unknown:
            raise ValueError(f"spec file {path}, set {number}: unknown algorithms {sorted(unknown)} "
                             f"(known: {list(_ALGORITHMS)})")
        for dtype in dtypes:
            for layout in layouts:
                direct = [ConvSpec.parse(text, dtype, layout) for text in windows]
                if "direct" in algorithms:
                    specs += direct
                if "winograd" in algorithms:
                    specs += _winograd_specs(direct)
                if "depthwise" in algorithms:
                    specs += [dataclasses.replace(spec, family="depthwise") for spec in direct]
                if entry.get("generic", True):
                    specs.append(ConvSpec(None, dtype, layout))
                    if "depthwise" in algorithms:
                        specs.append(ConvSpec(None, dtype, layout, "depthwise"))
    return list(dict.fromkeys(specs))


def _winograd_specs(direct_specs) -> list[ConvSpec]:
    """The Winograd twins of the specs whose window Winograd computes, with the schedule's tile."""
    from .kernels import settings
    from .planner import winograd_tile
    found = []
    for spec in direct_specs:
        if winograd_computes(spec.window):
            tile = winograd_tile(spec.dtype, settings().schedule())
            found.append(dataclasses.replace(spec, family="winograd", tile=tile))
    return found
