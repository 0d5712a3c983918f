"""1-D and 3-D windows: their text form, the 2-D kernel module each runs on, and how the CLI and spec
files name them (the layout sets the rank; a window with three values is 3-D)."""

import numpy as np
import pytest

import convgen
from convgen.runtime import kernels
from convgen.tools.cli import main
from convgen.planning.ndspec import NdWindow, lowered_spec, window_rank
from convgen.planning.spec import ConvSpec, Window
from convgen.tools.specfile import load_spec_file

ROUND_TRIPS = [
    ("k9s2p4", 1, NdWindow((9,), (2,), ((4, 4),), (1,))),
    ("k9s1p3_4d2", 1, NdWindow((9,), (1,), ((3, 4),), (2,))),
    ("k3x3x3s1p1", 3, NdWindow((3, 3, 3), (1, 1, 1), ((1, 1),) * 3, (1, 1, 1))),
    ("k3x5x5s1x2x2p1x2_3x2d2x1x1", 3, NdWindow((3, 5, 5), (1, 2, 2), ((1, 1), (2, 3), (2, 2)), (2, 1, 1))),
    ("k1x3x3s1p0", 3, NdWindow((1, 3, 3), 1, 0, 1)),
    ("k9s1p4reflect", 1, NdWindow((9,), 1, 4, 1, "reflect")),
    ("k3x3x3s1p1_0x0x1circular", 3, NdWindow((3, 3, 3), 1, ((1, 0), 0, 1), 1, "circular")),
]


@pytest.mark.parametrize("text, rank, window", ROUND_TRIPS, ids=[t for t, _, _ in ROUND_TRIPS])
def test_text_form_reads_back(text, rank, window):
    assert NdWindow.parse(text, rank) == window
    assert window.short() == text
    assert NdWindow.parse(window.short(), rank) == window
    if rank == 3:  # three values say the rank alone
        assert window_rank(text) == 3 and NdWindow.parse(text) == window


def test_padding_modes_in_the_text_and_the_lowered_window():
    assert NdWindow((3,), 1, 0, 1, "reflect").padding_mode == "zeros"  # nothing to pad: the same kernel
    assert lowered_spec("k9s1p4replicate", layout="NCL").window == Window((1, 9), 1, ((0, 0), (4, 4)), 1, "replicate")
    # 3-D: the mode goes to the height × width window only where it has padding (depth is the fold's).
    depth, planar = NdWindow.parse("k3x3x3s1p1x0x0reflect").lower()
    assert planar == Window((3, 3)) and depth.padding_mode == "reflect"
    assert NdWindow.parse("k3x3x3s1p1circular").lower()[1].short() == "k3s1p1circular"
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        NdWindow((3,), 1, 1, 1, "mirror")


def test_short_forms_expand_to_every_axis():
    assert NdWindow.parse("k3s1p1", 3) == NdWindow.parse("k3x3x3s1x1x1p1x1x1", 3)
    assert NdWindow.parse("K5", 1) == NdWindow((5,), 1, 0, 1)
    assert NdWindow.parse("k3x3x3p0_1", 3).padding == ((0, 1),) * 3


@pytest.mark.parametrize("text, rank, match", [
    ("k3x3s1", 3, "not a 3-D window"),
    ("k3x3x3", 1, "not a 1-D window: each part needs one value"),
    ("k9", None, "does not say its rank"),
    ("k3s1q1", 3, "cannot read"),
    ("k0", 1, "kernel_size\\[0\\] must be >= 1"),
])
def test_bad_text_is_refused(text, rank, match):
    with pytest.raises(ValueError, match=match):
        NdWindow.parse(text, rank)


def test_windows_lower_to_the_2d_window_that_computes_them():
    assert lowered_spec("k9s1p4", layout="NCL") == ConvSpec(Window((1, 9), 1, ((0, 0), (4, 4))), "float32", "NCHW")
    assert lowered_spec("k9s2p3_4d2", "float64", "nlc") == ConvSpec(
        Window((1, 9), (1, 2), ((0, 0), (3, 4)), (1, 2)), "float64", "NHWC")
    assert lowered_spec("k3x3x3s1p1", layout="NDHWC") == ConvSpec(Window((3, 3), 1, 1), "float32", "NHWC")
    assert lowered_spec("k5x3x3s2x1x1p2x1x1d3x1x1", layout="NCDHW") == ConvSpec(Window((3, 3), 1, 1))
    assert lowered_spec("k3s1p1", layout="NCDHW", family="winograd", tile=4).family == "winograd"
    assert lowered_spec("generic", "float64", "NLC") == ConvSpec(None, "float64", "NHWC")
    assert lowered_spec("k3s2p1", layout="NHWC") == ConvSpec.parse("k3s2p1", layout="NHWC")
    with pytest.raises(ValueError, match="3-D window; layout NCHW is 2-D"):
        lowered_spec("k3x3x3s1p1", layout="NCHW")
    with pytest.raises(ValueError, match="layout must be one of"):
        lowered_spec("k3", layout="NCWH")


def test_the_op_runs_the_module_the_spec_names():
    x, w = np.ones((1, 2, 20), np.float32), np.ones((3, 2, 9), np.float32)
    convgen.conv1d(x, w, padding=4)
    convgen.conv3d(np.ones((1, 2, 3, 4, 4)), np.ones((3, 2, 3, 3, 3)), padding=1, algorithm="direct")
    loaded = {spec for spec, _ in kernels._loaded}
    assert lowered_spec("k9s1p4", layout="NCL") in loaded
    assert lowered_spec("k3x3x3s1p1", "float64", "NCDHW") in loaded


# ------------------------------------------------------------------------------------- the CLI
def test_show_says_which_2d_module_runs_a_3d_window(capsys):
    assert main(["show", "k3x3x3s1p1", "--op", "forward", "--algorithm", "direct"]) == 0
    shown = capsys.readouterr().out
    assert main(["show", "k3s1p1", "--op", "forward", "--algorithm", "direct"]) == 0
    planar = capsys.readouterr().out
    note, rest = shown.split("\n", 1)
    assert "k3x3x3s1p1 NCDHW: a 3-D window runs on the 2-D kernels of k3s1p1" in note
    assert rest == planar


def test_show_a_1d_window_with_its_layout(capsys):
    assert main(["show", "k9s1p4", "--layout", "nlc", "--op", "forward"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("/* k9s1p4 NLC: a 1-D window runs on the 2-D kernels of k1x9s1p0x4, with a unit height")
    assert "cg_conv2d_fwd_k1x9s1p0x4_nhwc_float32" in out


@pytest.mark.parametrize("args, message", [
    (["show", "k3x3x3s1p1", "--layout", "NCHW"], "3-D window; layout NCHW is 2-D"),
    (["show", "k3x3x3", "--layout", "NCL"], "not a 1-D window"),
    (["export", "k3x3x3s1p1", "-o", "unused"], "export writes 2-D kernels"),
    (["show", "k3x3x3s1p1", "--algorithm", "winograd", "--layout", "NCDHW", "--tile", "5"], "invalid choice"),
])
def test_cli_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_export_of_a_1d_window(tmp_path, capsys):
    assert main(["export", "k9s2p4", "--layout", "NCL", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "conv2d_k1x9s1x2p0x4_nchw_float32.c").is_file()
    assert "a 1-D window runs as the 2-D window k1x9s1x2p0x4 with h = 1" in out


# -------------------------------------------------------------------------------- spec files
def test_spec_files_list_the_modules_of_1d_and_3d_windows(tmp_path):
    path = tmp_path / "kernels.toml"
    path.write_text('[[set]]\nwindows = ["k9s1p4"]\nlayouts = ["NCL", "NLC"]\ngeneric = false\n\n'
                    '[[set]]\nwindows = ["k3x3x3s1p1", "k3s2p1"]\nalgorithms = ["direct"]\n')
    assert load_spec_file(path) == [
        ConvSpec.parse("k1x9s1p0x4"), ConvSpec.parse("k1x9s1p0x4", layout="NHWC"),
        ConvSpec.parse("k3s1p1"), ConvSpec(None), ConvSpec.parse("k3s2p1")]


def test_spec_file_layout_must_fit_the_window(tmp_path):
    path = tmp_path / "kernels.toml"
    path.write_text('[[set]]\nwindows = ["k3x3x3s1p1"]\nlayouts = ["NHWC"]\n')
    with pytest.raises(ValueError, match="3-D window; layout NHWC is 2-D"):
        load_spec_file(path)


def test_the_default_kernel_set_builds_the_bench_windows():
    specs = load_spec_file(__import__("pathlib").Path(__file__).resolve().parent.parent / "kernels.toml")
    assert lowered_spec("k9s1p4", layout="NLC") in specs
    assert lowered_spec("k3x3x3s1p1", layout="NDHWC", family="winograd",
                        tile=next(s.tile for s in specs if s.family == "winograd")) in specs
