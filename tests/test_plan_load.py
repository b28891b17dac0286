"""A plan file is data from anyone (issue 54): `Plan.load` checks it against the schema and says, in one line,
what is wrong; the CLI exits 2 on it instead of exporting a plan whose figures cannot be true."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofit import Plan, UsageError
from autofit.cli.main import main

FIXTURE = Path(__file__).parent / "fixtures" / "plan-v0.1.json"


def good() -> dict:
    return json.loads(FIXTURE.read_text())


def changed(**fields) -> dict:
    data = good()
    for name, value in fields.items():
        if value is KeyError:
            del data[name]
        else:
            data[name] = value
    return data


BAD = {
    "a list": ([good()], "JSON list, not a plan"),
    "null": (None, "JSON null, not a plan"),
    "a string": ("plan", "JSON string, not a plan"),
    "a newer format": (changed(format_version=2), "format_version 2, written by a newer autofit"),
    "no format": (changed(format_version=KeyError), "format_version is None"),
    "fits as a string": (changed(fits="yes"), "'fits' is 'yes', not true/false"),
    "a negative peak": (changed(peak_memory=-1), "peak_memory is -1"),
    "an unknown field": (changed(run="import os"), "fields no plan has: run"),
    "fits without a configuration": (changed(config=None), "fits=true but has no configuration"),
    "a batch that contradicts": ({**good(), "spec": {**good()["spec"], "global_batch_size": 16},
                                  "config": {**good()["config"], "grad_accum_steps": 3}},
                                 "4 x 3 x 2 = 24 samples a step"),
    "an unknown knob value": ({**good(), "config": {**good()["config"], "precision": "bf61"}}, "bf61"),
}


@pytest.mark.parametrize("data,words", BAD.values(), ids=BAD.keys())
def test_a_bad_plan_is_one_line_naming_what_is_wrong(tmp_path, data, words):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError) as refused:
        Plan.load(path)
    message = str(refused.value)
    assert words in message and "\n" not in message and str(path) in message


def test_the_cli_refuses_a_bad_plan_with_exit_2_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(changed(peak_memory=-5)))
    assert main(["export", str(path), "--format", "deepspeed", "--out", str(tmp_path / "out")]) == 2
    assert "peak_memory is -5" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_good_plan_still_loads_and_saving_never_replaces_a_file_that_is_not_a_plan(tmp_path):
    plan = Plan.load(FIXTURE)
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}\n')
    with pytest.raises(UsageError, match="autofit did not write it"):
        plan.save(mine)
    assert mine.read_text() == '{"mine": true}\n'
    assert Plan.load(plan.save(mine, force=True)) == plan
    assert Plan.load(plan.save(mine)) == plan  # a plan there: replaced
