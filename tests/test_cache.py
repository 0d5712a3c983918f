"""The kernel cache: where it lives, what its key covers, and what it refuses to load.

Most tests run in a private, empty cache directory. `seed` copies SPEC's module of every op from the
session's cache (conftest builds it there) into it, so a test can damage or move a real kernel
without compiling one; `seed_linked_objects` copies the objects a module links (its core's parts,
its interface object), so a test about the module compiles the module alone;
`tiny_build` compiles a one-function cffi module through convgen.runtime.build for the cache mechanics
that need a build but not a convolution.
"""

import dataclasses
import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import convgen
from convgen.runtime import build, cache, kernels
from convgen import reference
from convgen.codegen import render
from convgen.planning.spec import ConvSpec, Window

SESSION_CACHE = Path(os.environ["CONVGEN_CACHE_DIR"])  # set by conftest before any test runs
SPEC = ConvSpec(Window((1, 1), 1, 0), "float64", "NCHW")  # in tests/grid.py: the session builds it anyway


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty cache directory of this user, mode 0700, and no kernels loaded in this process."""
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(directory))
    kernels.reset()
    yield directory
    kernels.reset()  # nothing loaded from this directory outlives the test


def module_paths(spec, directory):
    """The file and digest file of `spec`'s module of every op (under the active settings) in `directory`."""
    active = kernels.settings()
    rendered = render.render(spec, active.schedule(), split=True)
    name = cache.module_name(kernels.cache_key(rendered, active.toolchain))
    return directory / f"{name}{build.extension_suffix()}", directory / f"{name}.sha256"


@pytest.fixture(scope="module", autouse=True)
def spec_built_in_the_session_cache():
    """SPEC's module of every op in the session's cache (conftest's prebuild made it), for `seed`."""
    failures = {s: e for s, e in kernels.build_all([SPEC]).items() if isinstance(e, Exception)}
    assert not failures, failures


def seed(spec, directory):
    """Copy the session's built module of every op of `spec` into `directory`."""
    for source, target in zip(module_paths(spec, SESSION_CACHE), module_paths(spec, directory)):
        shutil.copyfile(source, target)
    return module_paths(spec, directory)


def core_paths(spec, directory):
    """The objects of the parts of the core that `spec`'s module of every op links, each with its
    digest file, in `directory`: the common part first."""
    active = kernels.settings()
    rendered = render.render(spec, active.schedule(), split=True)
    names = [cache.module_name(kernels.core_key(source, rendered, active.toolchain), cache.CORE_PREFIX)
             for source in rendered.cores]
    return [(directory / f"{name}.o", directory / f"{name}.sha256") for name in names]


def seed_core(spec, directory):
    """Copy the objects (and digests) of `spec`'s core that the session's cache holds into
    `directory`; returns the core's parts in `directory`, as `core_paths`."""
    for parts in zip(core_paths(spec, SESSION_CACHE), core_paths(spec, directory)):
        for source, target in zip(*parts):
            if source.exists():
                shutil.copyfile(source, target)
    return core_paths(spec, directory)


def seed_every_core(directory):
    """Copy every core object (and digest) of the session's cache into `directory`."""
    for source in SESSION_CACHE.glob(f"{cache.CORE_PREFIX}*"):
        if source.suffix in (".o", ".sha256"):
            shutil.copyfile(source, directory / source.name)


def interface_paths(spec, directory):
    """The interface object (and its digest) that `spec`'s module of every op links, in `directory`."""
    active = kernels.settings()
    rendered = render.render(spec, active.schedule(), split=True)
    name = cache.module_name(kernels.interface_key(rendered, active.toolchain), cache.INTERFACE_PREFIX)
    return directory / f"{name}.o", directory / f"{name}.sha256"


def seed_interface(spec, directory):
    """Copy the interface object (and digest) of `spec`'s module of every op from the session's cache
    into `directory`, if the session has built it."""
    for source, target in zip(interface_paths(spec, SESSION_CACHE), interface_paths(spec, directory)):
        if source.exists():
            shutil.copyfile(source, target)


def seed_linked_objects(spec, directory):
    """Copy the objects `spec`'s module of every op links (the parts of its core, its interface object)
    from the session's cache into `directory`, those the session has built: a test about the module
    then compiles the module alone. Returns the core's parts in `directory`, as `core_paths`."""
    seed_interface(spec, directory)
    return seed_core(spec, directory)


def load(spec):
    """(Kernels, built) for `spec`'s module of every op, from disk: nothing kept from earlier loads in
    this process."""
    kernels.reset()
    outcome = kernels.build_all([spec])[spec]
    if isinstance(outcome, Exception):
        raise outcome
    return kernels.get_kernels(spec), outcome == "built"


def check_conv(spec):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((4, 3, 1, 1))
    np.testing.assert_allclose(convgen.conv2d(x, w), reference.conv2d(x, w), rtol=1e-12)


def tiny_rendered(body="int answer(void) { return 42; }", cdef="int answer(void);"):
    schedule = kernels.settings().schedule()
    return render.Rendered(SPEC, schedule, body, cdef, {})


def tiny_build(calls=None, delay=0.0, rendered=None):
    """A build function for cache.load_or_build that compiles a one-function module."""
    def compile_it(name, build_dir):
        if calls is not None:
            calls.append(build_dir)
        time.sleep(delay)
        return build.build_module(name, rendered or tiny_rendered(), kernels.settings().toolchain, build_dir)
    return compile_it


# ------------------------------------------------------------------------------------- location
def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CONVGEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "convgen"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "convgen"
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache.cache_dir() == tmp_path / "explicit"


def test_cache_dir_is_created_private_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(tmp_path / "new" / "convgen"))
    previous = os.umask(0)  # the most permissive umask: mkdir's own mode must still make it 0700
    try:
        path = cache.checked_cache_dir()
    finally:
        os.umask(previous)
    assert path == tmp_path / "new" / "convgen"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


# ------------------------------------------------------------------------------ refused directories
@pytest.fixture
def imports(monkeypatch):
    """Every module file the cache imports, in order."""
    seen = []
    real = cache.import_extension

    def recording(name, path):
        seen.append(Path(path))
        return real(name, path)
    monkeypatch.setattr(cache, "import_extension", recording)
    return seen


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o720, 0o702, 0o777])
def test_group_or_other_writable_dir_is_refused_and_nothing_loaded(private_cache, imports, mode):
    so_path, _ = seed(SPEC, private_cache)
    load(SPEC)  # private (0700): the planted module is what gets loaded
    assert imports == [so_path]
    imports.clear()
    os.chmod(private_cache, mode)
    try:
        with pytest.raises(convgen.CacheError, match=rf"writable by group or others \(mode 0{mode:o}\).*chmod 700"):
            load(SPEC)
        with pytest.raises(convgen.CacheError):
            check_conv(SPEC)
    finally:
        os.chmod(private_cache, 0o700)
    assert imports == []


def test_dir_owned_by_someone_else_is_refused(private_cache, imports, monkeypatch):
    seed(SPEC, private_cache)
    owner = private_cache.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)  # as seen by another user
    with pytest.raises(convgen.CacheError, match=rf"owned by uid {owner}, not by this user \({owner + 1}\)"):
        load(SPEC)
    assert imports == []


def test_cache_path_that_is_a_file_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "not-a-dir"
    path.write_text("")
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(path))
    with pytest.raises(convgen.CacheError, match="cannot create|not a directory"):
        cache.checked_cache_dir()


def test_symlink_to_a_permissive_dir_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "shared"
    target.mkdir()
    os.chmod(target, 0o777)
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(tmp_path / "link"))
    with pytest.raises(convgen.CacheError, match="writable by group or others"):
        cache.checked_cache_dir()


# --------------------------------------------------------------------------------- damaged modules
@pytest.mark.parametrize("damage", ["truncated", "garbage-with-matching-digest", "foreign-elf-with-matching-digest",
                                    "digest-missing", "digest-wrong"])
def test_damaged_module_is_rebuilt_with_a_warning(private_cache, imports, damage):
    so_path, digest_path = seed(SPEC, private_cache)
    seed_linked_objects(SPEC, private_cache)
    data = so_path.read_bytes()
    if damage == "truncated":
        so_path.write_bytes(data[: len(data) // 3])
    elif damage == "garbage-with-matching-digest":
        so_path.write_bytes(b"\x7fELF" + bytes(range(256)) * 16)
        digest_path.write_text(cache.file_digest(so_path))
    elif damage == "foreign-elf-with-matching-digest":
        # An ELF header for another machine (e_machine = 0xB7, AArch64): what a cache copied from
        # another architecture would hold. The loader refuses it; convgen must rebuild, not crash.
        so_path.write_bytes(data[:18] + (0xB7).to_bytes(2, "little") + data[20:])
        digest_path.write_text(cache.file_digest(so_path))
    elif damage == "digest-missing":
        digest_path.unlink()
    else:
        digest_path.write_text("0" * 64)
    with pytest.warns(RuntimeWarning, match=rf"rebuilding the damaged cached kernel module {so_path.name}"):
        _, built = load(SPEC)
    assert built
    assert cache.file_digest(so_path) == digest_path.read_text().strip()
    check_conv(SPEC)
    _, built_again = load(SPEC)  # now intact: loaded, not rebuilt
    assert not built_again


# Making a file of another owner needs root; without it, the mode cases remain.
PLANTED = ["other-writable", "group-writable-digest"] + (["foreign-owner"] if os.geteuid() == 0 else [])


@pytest.mark.parametrize("planted", PLANTED)
def test_module_file_others_could_have_written_is_rebuilt(private_cache, imports, planted):
    """A module file not private to this user is never imported, even in a private directory
    (it could have been planted while the directory was open to others)."""
    so_path, digest_path = seed(SPEC, private_cache)
    seed_linked_objects(SPEC, private_cache)
    if planted == "other-writable":
        os.chmod(so_path, 0o646)
    elif planted == "group-writable-digest":
        os.chmod(digest_path, 0o664)
    else:
        os.chown(so_path, 65534, -1)  # nobody's
    with pytest.warns(RuntimeWarning, match=rf"rebuilding the damaged cached kernel module {so_path.name}"):
        _, built = load(SPEC)
    assert built and imports == [so_path]  # imported once: the rebuilt file
    assert so_path.stat().st_uid == os.getuid() and not so_path.stat().st_mode & 0o022
    check_conv(SPEC)


@pytest.mark.parametrize("damage", ["truncated", "digest-wrong", "other-writable"])
def test_damaged_or_foreign_core_object_is_rebuilt_with_a_warning(private_cache, damage):
    """A window module links a checked copy of its core object: one that does not match its digest,
    or that others could have written, is rebuilt, never linked."""
    o_path, digest_path = seed_linked_objects(SPEC, private_cache)[0]
    if damage == "truncated":
        o_path.write_bytes(o_path.read_bytes()[:1000])
    elif damage == "digest-wrong":
        digest_path.write_text("0" * 64)
    else:
        os.chmod(o_path, 0o646)
    with pytest.warns(RuntimeWarning, match=rf"rebuilding the damaged cached core object {o_path.name}"):
        _, built = load(SPEC)
    assert built
    assert cache.file_digest(o_path) == digest_path.read_text().strip() and not o_path.stat().st_mode & 0o022
    check_conv(SPEC)


def test_windows_of_one_dtype_layout_and_schedule_share_one_core_object(private_cache):
    """The first window module builds the core object's parts; the next window's links the same ones."""
    other = ConvSpec(Window(3, 2, 1), SPEC.dtype, SPEC.layout)
    parts = core_paths(SPEC, private_cache)
    seed_interface(SPEC, private_cache)  # (the modules compile, and the core's parts)
    assert core_paths(other, private_cache) == parts and len(parts) == 3  # the common part, the rows', the weight gradient's
    assert load(SPEC)[1]
    assert len(list(private_cache.glob(f"{cache.CORE_PREFIX}*.o"))) == 3
    before = [o_path.stat().st_mtime_ns for o_path, _ in parts]
    assert load(other)[1]
    assert [o_path.stat().st_mtime_ns for o_path, _ in parts] == before  # linked, not rebuilt
    assert len(list(private_cache.glob(f"{cache.CORE_PREFIX}*.o"))) == 3
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 3, 9, 8)), rng.standard_normal((5, 3, 3, 3))
    np.testing.assert_allclose(convgen.conv2d(x, w, stride=2, padding=1), reference.conv2d(x, w, stride=2, padding=1),
                               rtol=1e-12)


def interface_objects(directory):
    return sorted(directory.glob(f"{cache.INTERFACE_PREFIX}*.o"))


def test_modules_of_one_dtype_build_and_ops_share_one_interface_object(private_cache):
    """Every module links an interface object (the cffi wrapper of its entry points, under their
    interface names): windows and families of one dtype, build and set of ops share it, so only the
    first module compiles it; a module of other ops, or of the generic build, links its own."""
    direct, strided = ConvSpec(Window(3, 2, 1), "float64", "NCHW"), ConvSpec(Window(5, 1, 2), "float64", "NCHW")
    depthwise = ConvSpec(Window(3, 1, 1), "float64", "NCHW", "depthwise")
    seed_core(direct, private_cache)  # (the modules compile, and their interface object)
    assert load(direct)[1]
    assert len(interface_objects(private_cache)) == 1
    before = interface_objects(private_cache)[0].stat().st_mtime_ns
    assert load(strided)[1] and load(depthwise)[1]
    assert len(interface_objects(private_cache)) == 1
    assert interface_objects(private_cache)[0].stat().st_mtime_ns == before  # linked, not rebuilt
    active = kernels.settings()
    names = {build.interface_module_name(render.render(spec, active.schedule(), ops=ops, split=True))
             for spec, ops in ((direct, None), (strided, None), (depthwise, None))}
    assert len(names) == 1
    assert len({build.interface_module_name(render.render(direct, active.schedule(), ops=ops))
                for ops in (None, "fwd", "bwd_data", ("fwd", "bwd_weight"))}) == 4
    generic = render.render(ConvSpec(None, "float64", "NCHW"), active.schedule())
    float32 = render.render(ConvSpec(Window(3, 2, 1), "float32", "NHWC"), active.schedule())
    assert build.interface_module_name(generic) not in names and build.interface_module_name(float32) not in names
    # each module runs its own kernels, though all are imported under the interface's one name
    rng = np.random.default_rng(2)
    for spec, (kernel, stride, padding) in ((direct, (3, 2, 1)), (strided, (5, 1, 2))):
        x, w = rng.standard_normal((2, 3, 9, 8)), rng.standard_normal((4, 3, kernel, kernel))
        np.testing.assert_allclose(convgen.conv2d(x, w, stride=stride, padding=padding),
                                   reference.conv2d(x, w, stride=stride, padding=padding), rtol=1e-12)
    x, w = rng.standard_normal((2, 3, 9, 8)), rng.standard_normal((3, 1, 3, 3))
    np.testing.assert_allclose(convgen.conv2d(x, w, padding=1, groups=3), reference.conv2d(x, w, padding=1, groups=3),
                               rtol=1e-12)


def test_a_module_keeps_its_entry_points_names_for_cache_list(private_cache):
    """Renamed for the interface object, a module's entry points still name it in its binary."""
    seed_linked_objects(SPEC, private_cache)
    assert load(SPEC)[1]
    data = module_paths(SPEC, private_cache)[0].read_bytes()
    assert all(SPEC.symbol(entry).encode() + b"\0" in data for entry in ("fwd", "bwd_data", "bwd_weight"))


def test_module_built_but_unloadable_is_a_build_error(private_cache):
    def bad_build(name, build_dir):
        path = build_dir / f"{name}{build.extension_suffix()}"
        path.write_bytes(b"not a shared object")
        return path
    with pytest.raises(convgen.BuildError, match="was built but cannot be loaded"):
        cache.load_or_build("ab" * 32, bad_build)


# ------------------------------------------------------------------------------------ the key
def _key_inputs():
    active = kernels.settings()
    return render.render(SPEC, active.schedule(), split=True), active.toolchain


KEY_CHANGES = {
    "source": lambda r, t, mp: (dataclasses.replace(r, source=r.source + "\n/* edited */\n"), t),
    "cdef": lambda r, t, mp: (dataclasses.replace(r, cdef=r.cdef + "\n"), t),
    "core source": lambda r, t, mp: (dataclasses.replace(r, cores=(r.cores[0] + "\n/* edited */\n",) + r.cores[1:]), t),
    "compiler path": lambda r, t, mp: (r, dataclasses.replace(t, compiler="/opt/other/gcc")),
    "compiler version": lambda r, t, mp: (r, dataclasses.replace(t, version=t.version + " (patched)")),
    "flags": lambda r, t, mp: (r, dataclasses.replace(t, cflags=t.cflags + ("-ffast-math",))),
    "window flags": lambda r, t, mp: (r, dataclasses.replace(t, window_cflags=("-O1", "-ffast-math"))),
    "schedule": lambda r, t, mp: (dataclasses.replace(r, schedule=dataclasses.replace(r.schedule, kc=r.schedule.kc + 8)), t),
    "isa": lambda r, t, mp: (dataclasses.replace(r, schedule=dataclasses.replace(r.schedule, isa="other")), t),
    "convgen version": lambda r, t, mp: (mp.setattr(kernels, "__version__", "999.0"), (r, t))[1],
    "python abi": lambda r, t, mp: (mp.setattr(sys.implementation, "cache_tag", "cpython-399"), (r, t))[1],
    "cffi version": lambda r, t, mp: (mp.setattr(build.cffi, "__version__", "0.0.1"), (r, t))[1],
    "platform": lambda r, t, mp: (mp.setattr(kernels.platform, "machine", lambda: "riscv64"), (r, t))[1],
}


@pytest.mark.parametrize("change", list(KEY_CHANGES))
def test_key_changes_with_everything_that_changes_the_binary(change, monkeypatch):
    rendered, toolchain = _key_inputs()
    before = kernels.cache_key(rendered, toolchain)
    assert kernels.cache_key(rendered, toolchain) == before  # deterministic
    changed_rendered, changed_toolchain = KEY_CHANGES[change](rendered, toolchain, monkeypatch)
    assert kernels.cache_key(changed_rendered, changed_toolchain) != before


@pytest.mark.parametrize("change", [change for change in KEY_CHANGES
                                    if change not in ("source", "cdef", "core source", "flags", "schedule", "isa")])
def test_interface_key_changes_with_everything_that_changes_the_object(change, monkeypatch):
    """The interface object reads neither the kernels nor the schedule, and compiles with the window
    code's flags (no ISA flags): the rest of the module's key is its key."""
    rendered, toolchain = _key_inputs()
    before = kernels.interface_key(rendered, toolchain)
    assert kernels.interface_key(dataclasses.replace(rendered, source="", cdef="", cores=()), toolchain) == before
    changed_rendered, changed_toolchain = KEY_CHANGES[change](rendered, toolchain, monkeypatch)
    assert kernels.interface_key(changed_rendered, changed_toolchain) != before


@pytest.mark.parametrize("change", [change for change in KEY_CHANGES
                                    if change not in ("source", "cdef", "window flags")])
def test_core_key_changes_with_everything_that_changes_the_object(change, monkeypatch):
    rendered, toolchain = _key_inputs()
    before = kernels.core_key(rendered.cores[0], rendered, toolchain)
    # the window's own source is not the core's: every window of a dtype, layout and schedule shares it
    assert kernels.core_key(rendered.cores[0], dataclasses.replace(rendered, source="", cdef=""), toolchain) == before
    changed_rendered, changed_toolchain = KEY_CHANGES[change](rendered, toolchain, monkeypatch)
    assert kernels.core_key(changed_rendered.cores[0], changed_rendered, changed_toolchain) != before


def test_window_code_and_core_compile_at_their_own_optimization_levels(monkeypatch, tmp_path):
    """By default a split module's own code compiles at -O1 (its CG_HOT functions at -O2: the
    compile defines CG_HOT_O2) and the core object it links at -O3; whole modules at -O3.
    CONVGEN_CFLAGS, or configure(cflags=), sets every part's flags (and no CG_HOT_O2)."""
    split = render.render(SPEC, kernels.settings().schedule(), split=True)
    whole = render.render(SPEC, kernels.settings().schedule(), split=False)
    c, o = tmp_path / "m.c", tmp_path / "m.o"

    def levels(toolchain):
        """-O flags of the window's compile and link, the core's compile, a whole module's compile and
        the interface object's."""
        commands = (build.object_command(toolchain, split, c, o), build.link_command(toolchain, split, [o], o),
                    build.object_command(toolchain, split, c, o, core=True),
                    build.object_command(toolchain, whole, c, o), build.interface_command(toolchain, c, o))
        return tuple([flag for flag in command if flag.startswith("-O")] for command in commands)

    monkeypatch.delenv("CONVGEN_CFLAGS", raising=False)
    default = build.default_toolchain()
    assert levels(default) == (["-O1"], ["-O1"], ["-O3"], ["-O3"], ["-O1"])
    hot = "-DCG_HOT_O2"
    assert hot in build.object_command(default, split, c, o) and hot not in build.object_command(default, whole, c, o)
    assert hot not in build.object_command(default, split, c, o, core=True)
    without_window_flags = dataclasses.replace(default, window_cflags=None)
    assert kernels.core_key(split.cores[0], split, default) == kernels.core_key(split.cores[0], split, without_window_flags)
    assert kernels.interface_key(split, default) != kernels.interface_key(split, without_window_flags)
    monkeypatch.setenv("CONVGEN_CFLAGS", "-O1 -g")
    assert levels(build.default_toolchain()) == (["-O1"],) * 5
    assert hot not in build.object_command(build.default_toolchain(), split, c, o)
    with convgen.configure(cflags=("-Os",)):
        assert levels(kernels.settings().toolchain) == (["-Os"],) * 5


def test_compiler_identity_covers_what_native_means_here():
    """Two machines of one ISA family can differ in what -march=native enables; the key must too."""
    version = build.compiler_version(kernels.settings().toolchain.compiler)
    assert "[native " in version and len(version.split("[native ")[1].rstrip("]")) == 16


def test_key_parts_cannot_run_together():
    """("ab", "c") and ("a", "bc") are different inputs and must give different keys."""
    assert cache.module_key("ab", "c") != cache.module_key("a", "bc")
    assert cache.module_key("a", "") != cache.module_key("a")


def test_edited_template_is_rebuilt_never_loaded_stale(private_cache, tmp_path):
    """Copy the templates, edit the copy, and load SPEC with it: the module must be a new build whose
    source has the edit (an old binary could not), beside the old module."""
    seed(SPEC, private_cache)
    seed_linked_objects(SPEC, private_cache)
    original, built = load(SPEC)
    assert not built
    edited = tmp_path / "templates"
    shutil.copytree(render.TEMPLATE_DIR, edited)
    probe = "/* an edit to the direct family's module template */"
    module = edited / SPEC.family / "module.c.j2"
    module.write_text(module.read_text() + "\n" + probe + "\n")
    with convgen.configure(templates=edited):
        fresh, built = load(SPEC)
        assert built
        assert probe in fresh.rendered("fwd").source and probe not in original.rendered("fwd").source
        check_conv(SPEC)
    assert len(list(private_cache.glob(f"*{build.extension_suffix()}"))) == 2


def test_edited_core_function_rebuilds_the_core_and_the_module(private_cache, tmp_path):
    """An edit inside a CG_CORE function's body reaches the window module only through its core
    object: the module's key covers the core source, so it is rebuilt, linked with a new object of the
    core's part that holds the function (the common part), and the other parts' objects as they were."""
    seed(SPEC, private_cache)
    parts = seed_linked_objects(SPEC, private_cache)
    original, built = load(SPEC)
    assert not built
    edited = tmp_path / "templates"
    shutil.copytree(render.TEMPLATE_DIR, edited)
    pack = edited / "common" / "pack.c.j2"
    text = pack.read_text()
    probe = "    /* an edit inside a core function */\n"
    start = text.index("CG_CORE void pack_b_rows(")
    body = text.index("\n{\n", start) + 3
    pack.write_text(text[:body] + probe + text[body:])
    with convgen.configure(templates=edited):
        fresh, built = load(SPEC)
        assert built
        rendered = fresh.rendered("fwd")
        assert probe in rendered.cores[0] and probe not in rendered.source + "".join(rendered.cores[1:])
        check_conv(SPEC)
    assert len(list(private_cache.glob(f"{cache.CORE_PREFIX}*.o"))) == len(parts) + 1


def test_configure_refuses_a_templates_path_that_is_no_directory(tmp_path):
    with pytest.raises(ValueError, match="templates must be a directory of convgen templates"):
        with convgen.configure(templates=tmp_path / "missing"):
            pass


# ------------------------------------------------------------------------------- publication
def test_build_happens_in_a_private_temp_dir_and_publishes_atomically(private_cache):
    calls = []
    key = "cd" * 32
    final = private_cache / f"{cache.module_name(key)}{build.extension_suffix()}"

    def watched_build(name, build_dir):
        calls.append(build_dir)
        assert build_dir.parent == private_cache and build_dir != private_cache
        assert stat.S_IMODE(build_dir.stat().st_mode) == 0o700
        assert not final.exists(), "the module is visible before its build finished"
        return tiny_build()(name, build_dir)

    module, built = cache.load_or_build(key, watched_build)
    assert built and module.lib.answer() == 42
    assert final.exists() and not calls[0].exists(), "the temporary build dir is left behind"
    assert cache.load_or_build(key, watched_build)[1] is False and len(calls) == 1


def test_published_files_are_private_whatever_the_umask(private_cache):
    """Under a permissive umask (002 is common) the published module must still be private,
    or the next load would refuse it and rebuild, every time."""
    previous = os.umask(0)
    try:
        module, built = cache.load_or_build("89" * 32, tiny_build())
    finally:
        os.umask(previous)
    assert built
    for path in private_cache.iterdir():
        if not path.name.endswith(".lock"):
            assert not path.stat().st_mode & 0o077, f"{path.name} has mode {stat.S_IMODE(path.stat().st_mode):o}"
    assert cache.load_or_build("89" * 32, tiny_build())[1] is False


def test_failed_build_leaves_nothing_behind(private_cache):
    rendered = tiny_rendered(body="int answer(void) { return }")
    with pytest.raises(convgen.BuildError):
        cache.load_or_build("ef" * 32, tiny_build(rendered=rendered))
    leftovers = [p.name for p in private_cache.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_threads_asking_for_one_new_module_build_it_once(private_cache):
    calls, results, errors = [], [], []
    builder = tiny_build(calls, delay=0.3)

    def worker():
        try:
            results.append(cache.load_or_build("01" * 32, builder))
        except Exception as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(calls) == 1
    assert sorted(built for _, built in results) == [False, False, False, True]
    assert all(module.lib.answer() == 42 for module, _ in results)


# --------------------------------------------------------------------------------- info and clear
def test_cache_info_and_clear(private_cache, fresh_environments):
    assert convgen.cache_info() == {"dir": str(private_cache), "modules": 0, "bytes": 0}
    seeded = [seed(SPEC, private_cache)[0], seed(ConvSpec(None, "float64", "NCHW"), private_cache)[0]]
    seed_core(SPEC, private_cache)  # core objects are not modules, and are cleared too
    (private_cache / f"{cache.MODULE_PREFIX}stale.x.build").mkdir()  # left by a killed build
    # the runtime's render keeps the templates it compiles in the cache directory (in a process that
    # has compiled none yet: the renders above compiled them in this one)
    fresh_environments()
    render.render(SPEC, kernels.settings().schedule(), split=True, compiled_templates=cache.compiled_templates())
    assert any(cache.compiled_templates_dir().iterdir())
    info = convgen.cache_info()
    assert info == {"dir": str(private_cache), "modules": 2, "bytes": sum(p.stat().st_size for p in seeded)}
    assert convgen.cache_clear() == 2
    assert list(private_cache.iterdir()) == []
    assert convgen.cache_info()["modules"] == 0
    check_conv(SPEC)  # works again after a clear: the kernel is rebuilt
    assert convgen.cache_info()["modules"] == 1


@pytest.fixture
def fresh_environments():
    """No Jinja environment (and no template it loaded) from before the test, and none left after it."""
    render._environment.cache_clear()
    yield render._environment.cache_clear
    render._environment.cache_clear()


def test_a_process_loads_the_templates_the_last_compiled(private_cache, tmp_path, monkeypatch, fresh_environments):
    """The runtime keeps the templates compiled in the cache: the next process (here, a fresh
    environment) renders without compiling one, and renders exactly what compiling them renders; an
    edited template is compiled afresh, never taken from the cache stale."""
    spec = ConvSpec(Window(3, 1, 1), "float32", "NHWC", "winograd", 4)
    schedule = kernels.settings().schedule()
    compiled = cache.compiled_templates_dir()
    store = cache.compiled_templates(compiled)
    edited = tmp_path / "templates"
    shutil.copytree(render.TEMPLATE_DIR, edited)
    fresh = render.render(spec, schedule, split=True, compiled_templates=store)
    edited_fresh = render.render(spec, schedule, templates=edited, split=True, compiled_templates=store)
    assert edited_fresh == fresh and len(list(compiled.iterdir())) >= 20
    fresh_environments()  # as a new process would start

    def refuse(*args, **kwargs):
        raise AssertionError("a template was compiled although the cache holds it")

    with monkeypatch.context() as patch:
        patch.setattr(render.jinja2.Environment, "compile", refuse)
        assert render.render(spec, schedule, split=True, compiled_templates=store) == fresh
    transforms = edited / "winograd" / "transforms.c.j2"
    transforms.write_text(transforms.read_text() + "/* edited */\n")
    fresh_environments()
    again = render.render(spec, schedule, templates=edited, split=True, compiled_templates=store)
    assert "/* edited */" in again.source and "/* edited */" not in fresh.source


def test_a_process_that_moves_to_another_cache_keeps_its_compiled_templates(tmp_path, monkeypatch,
                                                                          fresh_environments):
    spec = ConvSpec(Window(3, 1, 1), "float32", "NCHW")
    schedule = kernels.settings().schedule()
    first = render.render(spec, schedule, split=True, compiled_templates=cache.compiled_templates(tmp_path / "one"))

    def refuse(*args, **kwargs):
        raise AssertionError("a template this process compiled was compiled again")

    with monkeypatch.context() as patch:
        patch.setattr(render.jinja2.Environment, "compile", refuse)
        assert render.render(spec, schedule, split=True, compiled_templates=cache.compiled_templates(tmp_path / "other")) == first
        assert render.render(spec, schedule, split=True) == first


def test_compiled_templates_others_could_have_written_are_not_loaded(private_cache, monkeypatch, fresh_environments):
    """A compiled template is Python code: like a module, it is loaded only from this user's own file
    that nobody else may write (one planted while the directory was open to others is compiled anew)."""
    spec = ConvSpec(Window(3, 1, 1), "float32", "NCHW")
    schedule = kernels.settings().schedule()
    compiled = cache.compiled_templates_dir()
    store = cache.compiled_templates(compiled)
    fresh = render.render(spec, schedule, split=True, compiled_templates=store)
    files = list(compiled.iterdir())
    assert files
    for path in files:
        path.chmod(0o666)
    fresh_environments()
    compiles = []
    original = render.jinja2.Environment.compile
    monkeypatch.setattr(render.jinja2.Environment, "compile",
                        lambda self, *args, **kwargs: compiles.append(1) or original(self, *args, **kwargs))
    assert render.render(spec, schedule, split=True, compiled_templates=store) == fresh
    assert len(compiles) == len(files)


def test_templates_render_where_their_compiled_copies_cannot_be_kept(tmp_path, fresh_environments):
    """Keeping the compiled templates is an optimization: a directory that cannot be made is skipped."""
    (tmp_path / "file").write_text("")
    spec = ConvSpec(Window(3, 1, 1), "float32", "NCHW")
    schedule = kernels.settings().schedule()
    kept = render.render(spec, schedule, split=True, compiled_templates=cache.compiled_templates(tmp_path / "file" / "below"))
    assert kept == render.render(spec, schedule, split=True)


def test_clear_spares_a_build_in_progress(private_cache):
    """A clear while another build holds its lock leaves that build's directory and lock alone,
    and the build still publishes its module."""
    key = "67" * 32
    started, release, outcome = threading.Event(), threading.Event(), []

    def slow_build(name, build_dir):
        started.set()
        release.wait(30)
        return tiny_build()(name, build_dir)

    builder = threading.Thread(target=lambda: outcome.append(cache.load_or_build(key, slow_build)))
    builder.start()
    assert started.wait(30)
    seed(SPEC, private_cache)
    assert convgen.cache_clear() == 1  # the seeded module, not the one being built
    assert [p for p in private_cache.iterdir() if p.name.endswith(".build")], "the build's directory was removed"
    release.set()
    builder.join()
    module, built = outcome[0]
    assert built and module.lib.answer() == 42
    assert convgen.cache_info()["modules"] == 1


def test_cache_info_of_a_missing_dir_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(tmp_path / "absent"))
    assert convgen.cache_info() == {"dir": str(tmp_path / "absent"), "modules": 0, "bytes": 0}
    assert convgen.cache_clear() == 0
    assert not (tmp_path / "absent").exists()


# --------------------------------------------------------------------------- compilers and errors
def test_no_compiler_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no cc, gcc or clang
    monkeypatch.delenv("CC", raising=False)
    kernels.reset()  # settings are read afresh: the compiler is looked for on the new PATH
    with pytest.raises(convgen.BuildError, match=r"no C compiler found.*apt-get install gcc.*set CC"):
        convgen.conv2d(np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3)))


def test_cc_naming_a_missing_compiler_is_reported(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/bin/cc-42 -O2")
    kernels.reset()  # settings are read afresh: CC names the compiler
    with pytest.raises(convgen.BuildError, match=r"CC='/nonexistent/bin/cc-42 -O2' names no compiler.*install gcc"):
        convgen.conv2d(np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3)))


def test_compiler_rejecting_a_flag_shows_its_own_message(private_cache):
    with convgen.configure(cflags=("-fconvgen-no-such-option",)):
        with pytest.raises(convgen.BuildError) as error:
            convgen.conv2d(np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3)))
    message = str(error.value)
    assert "failed (exit 1)" in message and "-fconvgen-no-such-option" in message
    assert "unrecognized command-line option" in message or "unknown argument" in message  # gcc / clang


def test_compile_error_shows_the_compiler_message_with_the_line(private_cache):
    rendered = tiny_rendered(body="int answer(void)\n{\n    return undeclared_name;\n}\n")
    with pytest.raises(convgen.BuildError, match=r"(?s)failed \(exit 1\).*undeclared_name.*undeclared"):
        cache.load_or_build("23" * 32, tiny_build(rendered=rendered))


def test_unreadable_declarations_are_a_build_error(private_cache):
    rendered = tiny_rendered(cdef="int answer(void")
    with pytest.raises(convgen.BuildError, match="cffi cannot read the declarations"):
        cache.load_or_build("45" * 32, tiny_build(rendered=rendered))


def test_sanitizer_builds_need_the_runtime_preloaded():
    """Loading an ASan module into a process without the runtime would end the interpreter; with the
    runtime preloaded (as `make sanitize` runs these tests) it is allowed."""
    if "libasan" in Path("/proc/self/maps").read_text():
        build.check_sanitizer_runtime(("-O1", "-fsanitize=address,undefined"))
    else:
        with pytest.raises(convgen.BuildError, match=r"LD_PRELOAD=.*libasan"):
            build.check_sanitizer_runtime(("-O1", "-fsanitize=address,undefined"))
    build.check_sanitizer_runtime(("-O1", "-fsanitize=undefined"))  # UBSan alone needs no preload


def test_configured_sanitizer_build_needs_the_runtime_too(private_cache):
    """The same check for flags given to configure(): refused without the runtime, built with it."""
    x, w = np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3))
    with convgen.configure(cflags=("-O1", "-fsanitize=address")):
        if "libasan" in Path("/proc/self/maps").read_text():
            assert convgen.conv2d(x, w).tolist() == [[[[9.0]]]]
            return
        with pytest.raises(convgen.BuildError, match="AddressSanitizer runtime preloaded"):
            convgen.conv2d(x, w)
    assert not list(private_cache.glob(f"*{build.extension_suffix()}"))


def test_a_call_compiles_only_the_modules_of_its_op(private_cache, monkeypatch):
    """A forward call builds the forward module alone; the first backward call adds its two, and a
    transposed call after them builds nothing (it runs the input gradient's module)."""
    monkeypatch.delenv("CONVGEN_MODULES", raising=False)  # the default, as a user has it
    kernels.reset()
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((4, 3, 1, 1))
    modules = lambda: sorted(private_cache.glob(f"*{build.extension_suffix()}"))  # noqa: E731
    assert kernels.settings().modules == "per-op"
    seed_core(SPEC, private_cache)  # (the per-op modules link the parts of the core the whole one does)
    y = convgen.conv2d(x, w)
    assert len(modules()) == 1
    dx, dw, _ = convgen.conv2d_backward(np.ones_like(y), x, w)
    assert len(modules()) == 3
    np.testing.assert_allclose(dx, reference.conv2d_backward(np.ones_like(y), x, w)[0], rtol=1e-12)
    convgen.conv_transpose2d(y, w)  # weights (C_in, C_out, KH, KW): the conv's own
    assert len(modules()) == 3
    assert {kernels.get_kernels(SPEC).rendered(op).ops for op in ("fwd", "bwd_data", "bwd_weight")} == \
        {("fwd",), ("bwd_data",), ("bwd_weight",)}


def test_a_module_of_every_op_serves_every_op(private_cache):
    """build_all (what `convgen build` runs) compiles one module of every op; the calls after it, in a
    new process as here after reset(), load that module and compile nothing."""
    seed_linked_objects(SPEC, private_cache)
    assert kernels.build_all([SPEC])[SPEC] == "built"
    kernels.reset()
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((4, 3, 1, 1))
    y = convgen.conv2d(x, w)
    convgen.conv2d_backward(np.ones_like(y), x, w)
    assert len(list(private_cache.glob(f"*{build.extension_suffix()}"))) == 1
    assert {kernels.get_kernels(SPEC).rendered(op).ops for op in ("fwd", "bwd_data", "bwd_weight")} == \
        {("fwd", "bwd_data", "bwd_weight")}


def test_whole_modules_compile_every_op_on_the_first_call(private_cache, monkeypatch):
    """CONVGEN_MODULES=whole (or configure(modules="whole")): an op's first call compiles the module of
    every op, and the other ops' calls compile nothing more."""
    monkeypatch.setenv("CONVGEN_MODULES", "whole")
    kernels.reset()
    seed_linked_objects(SPEC, private_cache)
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((4, 3, 1, 1))
    y = convgen.conv2d(x, w)
    assert len(list(private_cache.glob(f"*{build.extension_suffix()}"))) == 1
    dx, dw, _ = convgen.conv2d_backward(np.ones_like(y), x, w)
    assert len(list(private_cache.glob(f"*{build.extension_suffix()}"))) == 1
    np.testing.assert_allclose(dw, reference.conv2d_backward(np.ones_like(y), x, w)[1], rtol=1e-12)
    assert kernels.get_kernels(SPEC).rendered("bwd_data").ops == ("fwd", "bwd_data", "bwd_weight")
    with convgen.configure(modules="per-op"):  # a block can ask for the default back
        convgen.conv2d(x[:, :, :3], w, padding=1)
    assert len(list(private_cache.glob(f"*{build.extension_suffix()}"))) == 2


@pytest.mark.parametrize("where", ["environment", "configure"])
def test_unknown_module_policy_is_refused(private_cache, monkeypatch, where):
    if where == "environment":
        monkeypatch.setenv("CONVGEN_MODULES", "some")
        kernels.reset()
        with pytest.raises(ValueError, match="CONVGEN_MODULES must be one of"):
            convgen.conv2d(np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3)))
    else:
        with pytest.raises(ValueError, match="modules must be one of"):
            with convgen.configure(modules="some"):
                pass
    assert not list(private_cache.glob(f"*{build.extension_suffix()}"))


@pytest.mark.parametrize("family, layout", [("direct", "NCHW"), ("direct", "NHWC"), ("winograd", "NCHW"),
                                            ("winograd", "NHWC"), ("depthwise", "NCHW"), ("depthwise", "NHWC")])
def test_modules_of_one_op_compute_every_op(private_cache, family, layout):
    """What a user's first calls load: each op from a module of its own, in every family and layout,
    against the reference (the rest of the suite mostly runs the modules of every op that conftest
    builds). The stride-1 "same" window takes the depthwise input gradient through the forward pass."""
    from helpers import to_layout
    rng = np.random.default_rng(3)
    groups = 8 if family == "depthwise" else 1
    x = rng.standard_normal((2, 8, 9, 10))
    w = rng.standard_normal((8, 8 // groups, 3, 3))
    kw = dict(padding=1, groups=groups, layout=layout, algorithm=family)
    xl, wl = to_layout(x, w, layout)
    ref = dict(padding=1, groups=groups, layout=layout)
    seed_every_core(private_cache)
    with convgen.configure(modules="per-op"):
        y = convgen.conv2d(xl, wl, **kw)
        dy = rng.standard_normal(y.shape)
        dx, dw, _ = convgen.conv2d_backward(dy, xl, wl, **kw)
    np.testing.assert_allclose(y, reference.conv2d(xl, wl, **ref), rtol=1e-9, atol=1e-9)
    for got, want in zip((dx, dw), reference.conv2d_backward(dy, xl, wl, **ref)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    assert len(list(private_cache.glob(f"*{build.extension_suffix()}"))) == 3  # a module per op
