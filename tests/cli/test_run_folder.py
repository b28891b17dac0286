"""`autofit tune --out DIR` into a folder that is not empty (issue 54): another run's files are refused unless
--force, links planted in DIR are never written through, and the lock never truncates a file it did not make."""

from __future__ import annotations

import json
import os

import pytest
from test_tune import MODEL, tune  # noqa: F401 - the fixture's model and the fast tune command

from autofit.cli.tune import RunLock
from autofit.errors import UsageError


@pytest.fixture
def model_arg(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return f"{path}:make"


def test_a_folder_holding_another_runs_files_is_refused_unless_forced(tmp_path, model_arg, capsys):
    out = tmp_path / "run"
    (out / "launch").mkdir(parents=True)
    (out / "plan.json").write_text('{"mine": 1}\n')
    (out / "probes.jsonl").write_text('{"old": 1}\n')
    assert tune(model_arg, out) == 2
    err = capsys.readouterr().err
    assert "already holds a run (plan.json, probes.jsonl, launch)" in err and "--force" in err
    assert (out / "plan.json").read_text() == '{"mine": 1}\n' and not (out / "report.html").exists()
    assert tune(model_arg, out, "--force") == 0
    assert json.loads((out / "plan.json").read_text())["fits"] is True
    events = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    assert "old" not in events[0]  # a fresh log, not the old run's with this one appended


def test_links_planted_in_the_folder_are_never_written_through(tmp_path, model_arg, capsys):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(outside, out / "report.html")
    assert tune(model_arg, out) == 2
    assert "report.html is a link" in capsys.readouterr().err
    os.unlink(out / "report.html")
    os.symlink(elsewhere, out / "launch")
    assert tune(model_arg, out, "--force") == 2
    assert "launch is a link" in capsys.readouterr().err
    assert outside.read_text() == "precious\n" and list(elsewhere.iterdir()) == []


def test_the_lock_never_truncates_a_file_it_did_not_make(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(outside, out / "tune.lock")
    with pytest.raises(UsageError, match="tune.lock is a link"):
        RunLock(out)
    assert outside.read_text() == "precious\n"
    os.unlink(out / "tune.lock")
    (out / "tune.lock").write_text("my notes\n")
    with pytest.raises(UsageError, match="is not autofit's lock"):
        RunLock(out)
    assert (out / "tune.lock").read_text() == "my notes\n"
    os.unlink(out / "tune.lock")
    lock = RunLock(out)  # made exclusively; a later run takes the emptied lock again
    lock.release()
    RunLock(out).release()


@pytest.mark.parametrize("content, problem", [(b"", "it is empty (0 bytes)"),
                                              (b"garbage, not a database" * 40, "it is not a SQLite database")])
def test_resume_from_a_store_autofit_did_not_write_is_one_line_exit_2(tmp_path, model_arg, capsys, content, problem):
    out = tmp_path / "run"
    out.mkdir()
    (out / "trials.db").write_bytes(content)
    assert tune(model_arg, out, "--resume") == 2
    err = capsys.readouterr().err
    assert f"is not a trial store autofit wrote: {problem}" in err and "Traceback" not in err
    assert (out / "trials.db").read_bytes() == content  # left as it was


def test_a_foreign_sqlite_file_is_refused_and_a_corrupt_store_is_one_line_in_python(tmp_path):
    import sqlite3

    from models import make_mlp, make_mlp_batch, mlp_loss

    import autofit

    foreign = tmp_path / "trials.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
    from autofit.search.trials import check_resumable

    with pytest.raises(UsageError, match="it holds no optuna studies"):
        check_resumable(foreign)
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    with pytest.raises(UsageError) as refused:
        autofit.autofit(make_mlp, make_mlp_batch, global_batch_size=4, device="cpu", memory_budget="64MiB",
                        loss_fn=mlp_loss, allow=0, max_probes=1, storage=f"sqlite:///{corrupt}")
    assert "Cannot use the trial store" in str(refused.value) and "\n" not in str(refused.value)
