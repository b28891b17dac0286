"""The package's imports point one way, down the layers of docs/design.md (scripts/layers.py)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "layers.py"
spec = importlib.util.spec_from_file_location("layers", SCRIPT)
layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layers)


def test_no_import_points_up_a_layer_and_no_sub_packages_import_each_other(capsys):
    assert layers.main([]) == 0, capsys.readouterr().out


def test_the_check_finds_a_cycle_and_an_upward_import():
    edges = {"strategies": {"probe"}, "probe": {"strategies"}, "plan": {"export"}, "export": {"plan"}}
    assert layers.cycles(edges) == [["export", "plan"], ["probe", "strategies"]]
    assert layers.upward(edges) == [("strategies", "probe")]  # plan -> export is the facade
