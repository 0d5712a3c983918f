"""Kernel-set files: TOML lists of specs to build ahead of time or render into generated/.

    # kernels.toml
    [[set]]
    windows = ["k3s1p1", "k3s2p1"]   # the compact window text of ConvSpec.parse
    dtypes = ["float32", "float64"]  # default ["float32"]
    layouts = ["NCHW"]               # default ["NCHW"] (["NCDHW"] for a window like k3x3x3s1p1); the
                                     # layout sets the rank: NCL/NLC 1-D, NCHW/NHWC 2-D, NCDHW/NDHWC 3-D
    generic = true                   # also the generic build of each dtype × layout (default true)
    algorithms = ["direct", "winograd"]  # default both; winograd only for the windows it computes

Each [[set]] stands for every window × dtype × layout × algorithm combination. A Winograd module
gets the tile the active schedule uses (`planner.winograd_tile`), the one `algorithm="auto"` calls.
A 1-D or 3-D window lists the 2-D module that runs it (`ndspec.lowered_spec`): k9s1p4 in NCL is
the 1 × 9 window k1x9s1p0x4, k3x3x3s1p1 the 3 × 3 window k3s1p1 (its depth taps become channels).
"depthwise" (not among the defaults) adds the depthwise family's module of every window, and with
`generic = true` its generic build beside the direct one.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from ..planning.ndspec import lowered_spec, window_rank
from ..planning.spec import ConvSpec, winograd_computes

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
        layouts = entry.get("layouts")
        algorithms = entry.get("algorithms", list(_DEFAULT_ALGORITHMS))
        for name, value in (("windows", windows), ("dtypes", dtypes), ("layouts", layouts), ("algorithms", algorithms)):
            if value is None and name == "layouts":
                continue
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"spec file {path}, set {number}: {name} must be a list of strings")
        if layouts is None:  # a window with three values (k3x3x3s1p1) is 3-D, the others 2-D
            layouts = list(dict.fromkeys(_default_layout(text) for text in windows)) or ["NCHW"]
        unknown = set(algorithms) - set(_ALGORITHMS)
        if unknown:
            raise ValueError(f"spec file {path}, set {number}: unknown algorithms {sorted(unknown)} "
                             f"(known: {list(_ALGORITHMS)})")
        for dtype in dtypes:
            for layout in layouts:
                direct = [lowered_spec(text, dtype, layout) for text in windows
                          if "layouts" in entry or layout == _default_layout(text)]
                if "direct" in algorithms:
                    specs += direct
                if "winograd" in algorithms:
                    specs += _winograd_specs(direct)
                if "depthwise" in algorithms:
                    specs += [dataclasses.replace(spec, family="depthwise") for spec in direct]
                if entry.get("generic", True):
                    specs.append(lowered_spec("generic", dtype, layout))
                    if "depthwise" in algorithms:
                        specs.append(dataclasses.replace(lowered_spec("generic", dtype, layout), family="depthwise"))
    return list(dict.fromkeys(specs))


def _default_layout(text: str) -> str:
    return "NCDHW" if window_rank(text) == 3 else "NCHW"


def _winograd_specs(direct_specs) -> list[ConvSpec]:
    """The Winograd twins of the specs whose window Winograd computes, with the schedule's tile."""
    from ..runtime.kernels import settings
    from ..planning.planner import winograd_tile
    found = []
    for spec in direct_specs:
        if winograd_computes(spec.window):
            tile = winograd_tile(spec.dtype, settings().schedule())
            found.append(dataclasses.replace(spec, family="winograd", tile=tile))
    return found
