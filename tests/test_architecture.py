"""The package's shape: its floors import one way, and its public names stay where users find them.

convgen/ is cut into subpackages by responsibility, each a floor that imports only the floors below
it (read from every import statement in the source, those inside functions included):

    tools, torch, compat   the command line and its helpers; the PyTorch and CS231n integrations (peers)
    frontend               the NumPy ops and layers: resolve, plan, call
    runtime                compiler, build, cache, loaded kernels
    codegen                the C calling convention and the rendering of templates
    planning               specs, problems, schedules, Winograd's matrices and bounds, the planner

The package root (`convgen/__init__.py`, `_version.py`) may import anything; `convgen.reference`,
the test oracle, imports nothing of convgen.
"""

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

import convgen

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "convgen"
FLOORS = {"planning": 0, "codegen": 1, "runtime": 2, "frontend": 3, "tools": 4, "torch": 4, "compat": 4}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    return _imports_of(path.read_text(), _module_name(path), path.name == "__init__.py")


def _imports_of(source: str, name: str, is_package: bool) -> set[str]:
    """Every convgen module the source of module `name` imports, as dotted names (a `from X import y`
    counts X.y when y is a module, else X)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "convgen")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "convgen":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if _is_module(submodule) else target)
    return found


def _is_module(dotted: str) -> bool:
    parts = dotted.split(".")
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _floor(dotted: str):
    parts = dotted.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_lives_on_a_floor():
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py", "_version.py",
                                                                       "reference.py")]
    assert not loose, f"modules outside the floors' subpackages: {loose}"
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} == set(FLOORS)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path):
    """A module imports from its own floor and the floors below, never from one above or a peer's."""
    _check_floors(_module_name(path), _imports(path))


def _check_floors(name: str, imports: set[str]) -> None:
    floor = _floor(name)
    if floor is None:
        return  # the package root
    for imported in imports:
        other = _floor(imported)
        if other is None:
            assert imported in ("convgen", "convgen._version"), f"{name} imports {imported} from the package root"
            continue
        same_room = imported.split(".")[1] == name.split(".")[1]
        assert other < floor or same_room, \
            f"{name} (floor {floor}) imports {imported} (floor {other}): imports must run down the floors"


def test_the_floor_check_sees_upward_and_sideways_imports():
    """The check above can fail: a planning module importing the runtime (inside a function, too),
    or the command line importing convgen.torch, is caught."""
    upward = "def f():\n    from ..runtime import kernels\n"
    assert _imports_of(upward, "convgen.planning.probe", False) == {"convgen.runtime.kernels"}
    with pytest.raises(AssertionError, match="imports must run down"):
        _check_floors("convgen.planning.probe", _imports_of(upward, "convgen.planning.probe", False))
    with pytest.raises(AssertionError, match="imports must run down"):
        _check_floors("convgen.tools.probe", _imports_of("import convgen.torch.library\n", "convgen.tools.probe", False))
    _check_floors("convgen.runtime.probe", _imports_of("from ..planning.spec import ConvSpec\n", "convgen.runtime.probe",
                                                       False))


def test_reference_imports_nothing_of_convgen():
    assert not _imports(PACKAGE / "reference.py")


# The public names, as users import them: this list is the API, written out by hand.
PUBLIC = [
    "conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward", "Conv2d", "ConvTranspose2d",
    "conv1d", "conv1d_backward", "conv_transpose1d", "conv_transpose1d_backward",
    "conv3d", "conv3d_backward", "conv_transpose3d", "conv_transpose3d_backward",
    "Conv1d", "Conv3d", "ConvTranspose1d", "ConvTranspose3d",
    "ConvSpec", "Window", "get_kernels", "build_all", "configure", "num_threads", "set_num_threads",
    "cache_info", "cache_clear", "CacheError", "BuildError", "reference",
    "prepare_conv2d", "prepare_conv_transpose2d", "PreparedConv",
]


def test_public_api_is_unchanged():
    assert sorted(convgen.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(convgen, name) is not None
    assert convgen.conv2d.__module__ == "convgen.frontend.ops"
    assert isinstance(convgen.__version__, str)
    for module in ("convgen.reference", "convgen.compat.cs231n", "convgen.torch"):
        importlib.import_module(module)


def test_cli_entry_point_resolves():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["convgen"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_every_subpackage_ships_in_the_wheel():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert {f"convgen.{room}" for room in FLOORS} <= set(packages)
