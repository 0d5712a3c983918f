"""Wisdom: what `convgen tune` measured steers algorithm="auto", only on the machine it was measured on.

Every call here runs modules the suite builds anyway (the direct k3s1p1 window and its Winograd
tiles, float32 NCHW); plans alone are checked without building anything.
"""

import json

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.frontend import ops
from convgen.planning import planner, winograd
from convgen.planning.spec import Window
from convgen.runtime import wisdom
from convgen.runtime.kernels import settings
from convgen.tools.cli import main
from convgen.tools.tune import TIE, Layer, tune
from helpers import assert_close

# k3s1p1: direct and each Winograd tile within its bound are candidates
LAYER = Layer(Window(3, 1, 1), 2, 16, 12, 12, 16)


@pytest.fixture(autouse=True)
def own_wisdom(tmp_path, monkeypatch):
    """Each test's wisdom file of its own, read afresh."""
    path = tmp_path / "wisdom.json"
    monkeypatch.setenv("CONVGEN_WISDOM", str(path))
    wisdom.forget_loaded()
    yield path
    wisdom.forget_loaded()


def _chosen(layer=LAYER, op="conv2d"):
    """(family, tile or None, variant or "") of the plan `auto` makes for `op` on the layer now."""
    plan = ops.prepare(op, layer.arrays(op, np.random.default_rng(0)), **layer.kwargs()).plan
    return plan.spec.family, plan.spec.tile if plan.spec.family == "winograd" else None, plan.variant


def _candidates(layer=LAYER):
    return planner.candidates(layer.problem(), settings().schedule())


def _write(entries, **stamp_changes):
    """Wisdom of `entries` ({(op, layer): (algorithm, tile, variant)}), stamped for this machine with
    `stamp_changes`."""
    stamp = dict(wisdom.machine(settings()), **stamp_changes)
    wisdom.write(wisdom.Wisdom(stamp, {wisdom.problem_class(op, layer.problem()): {"algorithm": a, "tile": t,
                                                                                   "variant": v}
                                       for (op, layer), (a, t, v) in entries.items()}))


def test_a_class_rounds_sizes_to_powers_of_two_and_keeps_the_rest_exact():
    key = wisdom.problem_class("conv2d", LAYER.problem())
    assert wisdom.problem_class("conv2d", Layer(Window(3, 1, 1), 2, 17, 13, 11, 15).problem()) == key
    for other in (Layer(Window(3, 1, 1), 2, 24, 12, 12, 16),                    # channels 24 round to 32
                  Layer(Window(3, 1, 1), 8, 16, 12, 12, 16),                    # batch
                  Layer(Window(3, 1, 1), 2, 16, 24, 24, 16),                    # pixels
                  Layer(Window(3, 1, 2), 2, 16, 12, 12, 16),                    # window
                  Layer(Window(3, 1, 1), 2, 16, 12, 12, 16, layout="NHWC"),
                  Layer(Window(3, 1, 1), 2, 16, 12, 12, 16, dtype="float64"),
                  Layer(Window(3, 1, 1), 2, 16, 12, 12, 16, groups=16)):
        assert wisdom.problem_class("conv2d", other.problem()) != key, other
    assert wisdom.problem_class("conv2d_backward", LAYER.problem()) != key


def test_the_candidates_are_what_can_compute_the_problem():
    direct = [("direct", None, ""), ("direct", None, "pixel rows"), ("direct", None, "phase planes")]
    tiles = [("winograd", m, "") for m in (2, 4, 6) if winograd.within_bound(m, "float32")]
    assert len(tiles) >= 2 and _candidates() == direct + tiles
    assert _candidates(Layer(Window(3, 2, 1), 2, 16, 12, 12, 16)) == direct
    assert _candidates(Layer(Window(5, 1, 2), 2, 16, 12, 12, 16)) == direct
    depthwise = Layer(Window(3, 1, 1), 2, 16, 12, 12, 16, groups=16)
    assert _candidates(depthwise) == direct + [("depthwise", None, "")]
    assert _candidates(Layer(Window(3, 1, 1), 2, 16, 12, 12, 16, groups=2)) == direct + tiles
    float64 = Layer(Window(3, 1, 1), 2, 16, 12, 12, 16, dtype="float64")
    assert [m for _, m, _ in _candidates(float64)[3:]] == [m for m in (2, 4, 6) if winograd.within_bound(m, "float64")]


def test_auto_takes_the_measured_choice_and_computes_the_same():
    rng = np.random.default_rng(3)
    x, w, _ = LAYER.arrays("conv2d", rng)
    expected = reference.conv2d(x, w, padding=1)
    ruled = _chosen()
    assert len(_candidates()) >= 3, "direct and at least two Winograd tiles"
    for candidate in _candidates():
        _write({("conv2d", LAYER): candidate})
        assert _chosen() == candidate
        schedule = ops.prepare("conv2d", (x, w, None), padding=1).kernels().settings.schedule()
        for field, value in planner.VARIANTS.get(candidate[2], ()):  # a variant's kernels are built with its fields
            assert getattr(schedule, field) == value
        assert_close(convgen.conv2d(x, w, padding=1), expected, np.float32, f"auto measured {candidate}")
        assert _chosen(op="conv2d_backward") == ruled, "wisdom of one op steers that op alone"
    wisdom.forget()
    assert _chosen() == ruled


def _other_than_ruled():
    ruled = _chosen()
    return next(choice for choice in _candidates() if choice != ruled), ruled


@pytest.mark.parametrize("field", ["cpu", "isa", "compiler", "convgen"])
def test_wisdom_of_another_machine_or_build_is_never_used_nor_imported(field, tmp_path):
    other, ruled = _other_than_ruled()
    _write({("conv2d", LAYER): other}, **{field: "something else"})
    assert _chosen() == ruled
    with pytest.raises(ValueError, match="another machine"):
        wisdom.import_file(wisdom.wisdom_path(), settings())


@pytest.mark.parametrize("damage", ["truncated", "not an object", "another format"])
def test_an_unreadable_file_is_ignored_with_a_warning_and_tune_replaces_it(damage, own_wisdom):
    other, ruled = _other_than_ruled()
    _write({("conv2d", LAYER): other})
    text = own_wisdom.read_text()
    own_wisdom.write_text({"truncated": text[:len(text) // 2], "not an object": "[1, 2]",
                           "another format": text.replace('"format": 1', '"format": 99')}[damage])
    wisdom.forget_loaded()
    with pytest.warns(RuntimeWarning, match="ignoring the wisdom file"):
        assert _chosen() == ruled
    tune([LAYER], ("conv2d",), report=lambda line: None)
    assert wisdom.read() is not None and len(wisdom.read().entries) == 1


@pytest.mark.parametrize("entry", [{"algorithm": "fft"}, {"algorithm": "winograd", "tile": 5},
                                   {"algorithm": "winograd"}, "direct", {"algorithm": "winograd", "tile": True},
                                   {"algorithm": "direct", "variant": "tiles of 7"},
                                   {"algorithm": "winograd", "tile": 4, "variant": "pixel rows"},
                                   {"algorithm": "depthwise", "variant": "pixel rows"}])
def test_an_entry_naming_no_choice_this_convgen_offers_is_skipped(entry, own_wisdom):
    _, ruled = _other_than_ruled()
    _write({})
    data = json.loads(own_wisdom.read_text())
    data["entries"][wisdom.problem_class("conv2d", LAYER.problem())] = entry
    own_wisdom.write_text(json.dumps(data))
    wisdom.forget_loaded()
    assert _chosen() == ruled


def test_a_choice_that_cannot_compute_the_problem_leaves_it_to_the_rule():
    strided = Layer(Window(3, 2, 1), 2, 16, 12, 12, 16)  # Winograd computes stride 1 only
    grouped = Layer(Window(3, 1, 1), 2, 16, 12, 12, 16, groups=2)  # depthwise: groups == channels only
    ruled = {layer: _chosen(layer) for layer in (strided, grouped)}
    _write({("conv2d", strided): ("winograd", 4, ""), ("conv2d", grouped): ("depthwise", None, "")})
    assert {layer: _chosen(layer) for layer in (strided, grouped)} == ruled
    assert ruled[strided] == ("direct", None, "")


def test_tune_records_the_fastest_candidate_unless_the_rule_ties_it(own_wisdom):
    lines = []
    outcomes, left = tune([LAYER], ("conv2d",), report=lines.append)
    assert left == 0 and len(outcomes) == 1 and len(lines) == 1
    outcome = outcomes[0]
    texts = {wisdom.Choice(*candidate).text() for candidate in _candidates()}
    assert set(outcome.seconds) == texts and min(outcome.seconds.values()) > 0
    chosen = outcome.seconds[outcome.choice.text()]
    assert chosen <= (1 + TIE) * min(outcome.seconds.values())
    entry = json.loads(own_wisdom.read_text())["entries"][outcome.key]
    choice = outcome.choice
    assert (entry["algorithm"], entry["tile"], entry["variant"]) == (choice.algorithm, choice.tile, choice.variant)
    assert _chosen() == (choice.algorithm, choice.tile, choice.variant)


def test_tune_stops_at_its_budget_and_estimate_measures_nothing(own_wisdom):
    outcomes, left = tune([LAYER, LAYER], ("conv2d", "conv2d_backward"), budget=1e-9, report=lambda line: None)
    assert (outcomes, left) == ([], 4)
    outcomes, left = tune([LAYER], ("conv2d",), mode="estimate", report=lambda line: None)
    assert left == 0 and outcomes[0].seconds == {}
    assert (outcomes[0].choice.algorithm, outcomes[0].choice.tile, outcomes[0].choice.variant) == _chosen()
    assert not own_wisdom.exists()
    with pytest.raises(ValueError, match="mode must be one of"):
        tune([LAYER], mode="exhaustive")
    with pytest.raises(ValueError, match="budget must be"):
        tune([LAYER], budget=0)


def test_training_through_pytorch_takes_only_the_accurate_winograd_tile_from_wisdom():
    """A call whose gradients are wanted plans "auto-training": wisdom's F(4×4) is passed over (its
    rounding compounds through a training step), its F(2×2) taken, as inference takes either."""
    torch = pytest.importorskip("torch")
    import convgen.torch as ct
    from convgen.torch import library
    layer = Layer(Window(3, 1, 1), 2, 4, 12, 12, 4)  # few channels: the rule takes the direct kernels
    assert _chosen(layer) == ("direct", None, "")
    x_array, w_array, _ = layer.arrays("conv2d", np.random.default_rng(5))
    expected = reference.conv2d_backward(np.ones((2, 4, 12, 12), np.float32), x_array, w_array, padding=1)[0]
    for tile, training_family in ((4, "direct"), (2, "winograd")):
        _write({(op, layer): ("winograd", tile, "") for op in ("conv2d", "conv2d_backward")})
        x, w = torch.from_numpy(x_array.copy()), torch.from_numpy(w_array)
        library._BOUND.clear()
        with torch.no_grad():
            ct.conv2d(x, w, padding=1)
        (inference,) = library._BOUND.values()
        assert (inference.forward_call.plan.spec.family, inference.forward_call.plan.spec.tile) == ("winograd", tile)
        library._BOUND.clear()
        y = ct.conv2d(x.requires_grad_(), w, padding=1)
        y.sum().backward()
        (training,) = library._BOUND.values()
        assert training.params[5] == "auto-training"
        for call in (training.forward_call, training.backward_call):
            assert call.plan.spec.family == training_family
            assert call.plan.spec.tile == (2 if training_family == "winograd" else 0)
        assert_close(x.grad.numpy(), expected, np.float32, "dx")


def test_compare_times_the_measured_plan_beside_the_estimate():
    from convgen.tools.compare import compare_layer
    other, ruled = _other_than_ruled()
    shape = (LAYER.n, LAYER.c, LAYER.h, LAYER.w, LAYER.f)
    names = [row["name"] for row in compare_layer(LAYER.window, *shape, repeat=1, with_baselines=False)]
    assert "convgen estimate" not in names, "without wisdom, auto is the estimate"
    for measured in (other, ("direct", None, "pixel rows")):
        _write({("conv2d", LAYER): measured})
        rows = {row["name"]: row["algorithm"] for row in compare_layer(LAYER.window, *shape, repeat=1,
                                                                       with_baselines=False)}
        assert rows["convgen specialized"] == wisdom.Choice(*measured).text()
        assert rows["convgen estimate"] == wisdom.Choice(*ruled).text()
        assert ("convgen spec. direct" in rows) == ("direct" not in (measured[0], ruled[0]))


def test_the_commands_tune_show_export_import_and_forget(tmp_path, capsys):
    assert main(["wisdom", "show"]) == 0 and "no wisdom" in capsys.readouterr().out
    assert main(["tune", "--layer", "k3s1p1:2,16,12,12,16", "--op", "conv2d"]) == 0
    out = capsys.readouterr().out
    assert "[1/1] conv2d k3s1p1 2x16x12x12 -> 16 NCHW float32: direct" in out
    assert main(["wisdom", "show"]) == 0
    shown = capsys.readouterr().out
    assert wisdom.problem_class("conv2d", LAYER.problem()) in shown and "NOT USED" not in shown
    exported = tmp_path / "exported.json"
    assert main(["wisdom", "export", str(exported)]) == 0
    assert main(["wisdom", "forget"]) == 0 and wisdom.read() is None
    assert main(["wisdom", "import", str(exported)]) == 0 and len(wisdom.read().entries) == 1
    data = json.loads(exported.read_text())
    data["machine"]["cpu"] = "another CPU"
    exported.write_text(json.dumps(data))
    assert main(["wisdom", "import", str(exported)]) == 1
    assert "another machine" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--layer", "k3s1p1:2,16,12"])
    assert exit_info.value.code == 2
