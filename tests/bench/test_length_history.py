"""The length-history experiment (bench/calibration/length_history.py): a row's step replayed after shorter
ones through one allocator model."""

import copy
import json

import pytest
import torch

from bench.calibration import calibrate, length_history


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _tiny_torchtune_row() -> dict:
    row = copy.deepcopy(next(r for r in json.loads(calibrate.ROWS.read_text())
                             if r["id"] == "torchtune-tut-llama2-7b-lora-qv-r8"))
    # fp32 logits over 10 MB at every length: the allocator gives such blocks segments of their own size
    # (below 10 MB they share 20 MB segments, which any shorter step's blocks fit)
    row["model"].update(hidden=256, layers=2, heads=4, kv_heads=4, intermediate=688, vocab=16000)
    row["seq_len"] = 128
    return row


def test_histories_are_seeded_draws_of_shorter_lengths():
    assert length_history.history(3) == length_history.history(3) != length_history.history(4)
    assert len(length_history.history(0)) == length_history.HISTORY
    assert set(length_history.history(0)) <= set(length_history.LENGTHS)


def test_a_history_of_other_lengths_leaves_the_longest_step_blocks_it_cannot_use(monkeypatch):
    monkeypatch.setattr(length_history, "LENGTHS", (64, 96))
    monkeypatch.setattr(length_history, "SEEDS", range(3))
    result = length_history.predict(_tiny_torchtune_row())
    # the cache never shrinks: a history only adds, here at least a segment
    assert min(result["after_history_bytes"].values()) >= result["full_depth_alone_bytes"] + 2**20
    assert result["after_history_median_error"] == sorted(result["after_history_error"].values())[1]
