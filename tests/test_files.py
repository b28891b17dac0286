"""autofit.files: every write atomic, never through a link, never over a file autofit did not write."""

from __future__ import annotations

import json
import os
import stat

import pytest

from autofit.errors import UsageError
from autofit.files import MANIFEST, append_line, make_folder, write_file, written_by_autofit


def test_a_write_lands_whole_and_is_recorded(tmp_path):
    path = write_file(tmp_path / "plan.json", '{"a": 1}\n')
    assert path.read_text() == '{"a": 1}\n' and written_by_autofit(path)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temporary left
    record = json.loads((tmp_path / MANIFEST).read_text())
    assert record["format_version"] == 1 and set(record["files"]) == {"plan.json"}
    write_file(path, "second\n")  # what autofit wrote, it may replace
    assert path.read_text() == "second\n"


def test_a_file_autofit_did_not_write_is_left_alone(tmp_path):
    mine = tmp_path / "torchrun.sh"
    mine.write_text("my own script\n")
    with pytest.raises(UsageError, match=r"torchrun.sh' exists and autofit did not write it.*force=True"):
        write_file(mine, "autofit's\n")
    assert mine.read_text() == "my own script\n"
    write_file(mine, "autofit's\n", force=True)
    assert mine.read_text() == "autofit's\n"


def test_a_file_edited_since_autofit_wrote_it_is_left_alone(tmp_path):
    path = write_file(tmp_path / "report.html", "<p>autofit</p>")
    path.write_text("<p>my notes</p>")
    assert not written_by_autofit(path)
    with pytest.raises(UsageError, match="changed since"):
        write_file(path, "<p>again</p>")


def test_a_caller_may_recognise_its_own_kind(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"format_version": 1}')
    write_file(path, "{}", ours=lambda data: b"format_version" in data)
    assert path.read_text() == "{}"


def test_a_link_is_never_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "report.html").symlink_to(outside)
    with pytest.raises(UsageError, match="is a link .*never writes through a link"):
        write_file(folder / "report.html", "report")
    write_file(folder / "report.html", "report", force=True)  # the link itself is replaced, not its target
    assert outside.read_text() == "precious\n"
    assert not (folder / "report.html").is_symlink() and (folder / "report.html").read_text() == "report"


def test_modes_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        script = write_file(tmp_path / "run.sh", "#!/bin/sh\n", executable=True)
        data = write_file(tmp_path / "data.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(script.stat().st_mode) == 0o750
    assert stat.S_IMODE(data.stat().st_mode) == 0o640


def test_a_folder_autofit_names_is_never_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "launch").symlink_to(elsewhere)
    with pytest.raises(UsageError, match="launch' is a link"):
        make_folder(tmp_path / "launch")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        make_folder(tmp_path / "file")
    assert make_folder(tmp_path / "a" / "b").is_dir()


def test_a_log_is_appended_to_but_not_through_a_link(tmp_path):
    log = tmp_path / "probes.jsonl"
    append_line(log, "one")
    append_line(log, "two")
    assert log.read_text() == "one\ntwo\n"
    target = tmp_path / "elsewhere.txt"
    target.write_text("")
    (tmp_path / "linked.jsonl").symlink_to(target)
    with pytest.raises(UsageError, match="is a link"):
        append_line(tmp_path / "linked.jsonl", "three")
    assert target.read_text() == ""


def test_a_record_that_is_not_autofit_s_is_refused_naming_it(tmp_path):
    (tmp_path / MANIFEST).write_text("[1, 2]")
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(UsageError, match=r"autofit-files.json' is not the record .*no 'files' object"):
        write_file(tmp_path / "plan.json", "{}")
