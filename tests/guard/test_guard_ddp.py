"""Two CPU ranks over gloo: when one rank runs out of memory both step down together, and a non-OOM
error on one rank stops the other instead of leaving it in a collective."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from guard_helpers import assert_same_weights, ddp_worker, make_batch, reference_ranks

STEPS = 7


def test_two_ranks_step_down_together_and_match_ddp(tmp_path):
    context = mp.spawn(ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), STEPS), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError("a rank is still running after 120 s: it waits in a collective")
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))

    quarters, halves = (4, 4, 4, 4), (2,) * 8
    assert rank1["sizes"] == [(8, 8), (8, 8), (8, 4, 4), quarters, quarters, (4, 4, 2, 2, 2, 2), halves]
    # Rank 0 stepped down with rank 1 at step 2; at step 5 its backward failed after adding some
    # gradients, so those parameters sat out the replay of samples 4..8.
    assert rank0["sizes"] == [(8, 8), (8, 8), (8, 8), quarters, quarters, (4, 2, 2, 2, 2, 2, 2), halves]
    assert "on this rank" in rank1["recoveries"][0] and "on another rank" in rank0["recoveries"][0]
    assert "held out" in rank0["recoveries"][1] and "on another rank" in rank1["recoveries"][1]
    assert rank0["samples_seen"] == rank1["samples_seen"] == STEPS * 16
    for name, tensor in rank0["state"].items():
        torch.testing.assert_close(tensor, rank1["state"][name])
    expected = reference_ranks([[make_batch(100 * r + s, 16, 8) for r in (0, 1)] for s in range(STEPS)])
    model = type(expected)()
    model.load_state_dict(rank0["state"])
    assert_same_weights(model, expected, atol=1e-5)

    assert rank0["error"][0] == "ValueError" and "labels are malformed" in rank0["error"][1]
    assert "in loss" in rank0["error"][2]  # the original traceback, down to the user's loss function
    assert rank1["error"][0] == "OtherRankFailed"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join(context, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"a rank is still running after {seconds} s: it waits in a collective")


def test_two_accelerate_ranks_split_together_and_match_the_global_mean(tmp_path):
    from guard_helpers import accelerate_data, accelerate_worker, fresh, loss_fn

    _join(mp.spawn(accelerate_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False), 120)
    rank0, rank1 = (torch.load(tmp_path / f"accelerate{r}.pt", weights_only=False) for r in (0, 1))
    assert rank1["sizes"] == [(8,), (8,), (4, 4), (4, 4)]
    assert rank0["sizes"] == [(8,), (8,), (8,), (4, 4)]  # its batch had gone in; it stepped down with rank 1
    assert "on this rank" in rank1["recoveries"][0] and "on another rank" in rank0["recoveries"][0]
    for name, tensor in rank0["state"].items():
        torch.testing.assert_close(tensor, rank1["state"][name])
    # DDP + accumulation 2 over 2 ranks: each optimizer step averages the means of 4 loader batches.
    data = accelerate_data().tensors
    model, optimizer = fresh()
    for step in range(2):
        for b in range(4):
            rows = slice(8 * (4 * step + b), 8 * (4 * step + b + 1))
            batch = (data[0][rows], data[1][rows])
            (loss_fn(model(batch[0]), batch) / 4).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    guarded = type(model)()
    guarded.load_state_dict(rank0["state"])
    assert_same_weights(guarded, model, atol=1e-5)


@pytest.mark.slow  # two Trainer runs in each of two spawned ranks: about a minute on 2 cores
def test_two_trainer_ranks_recover_together_and_match_the_plain_trainer(tmp_path):
    from guard_helpers import trainer_worker

    _join(mp.spawn(trainer_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False), 180)
    ranks = [torch.load(tmp_path / f"trainer{r}.pt", weights_only=False) for r in (0, 1)]
    assert "on this rank" in ranks[1]["recoveries"][0] and "on another rank" in ranks[0]["recoveries"][0]
    assert ranks[0]["config"]["micro_batch_size"] == ranks[1]["config"]["micro_batch_size"] == 4
    for name, tensor in ranks[0]["state"].items():
        torch.testing.assert_close(tensor, ranks[1]["state"][name])
        torch.testing.assert_close(tensor, ranks[0]["reference"][name], atol=2e-5, rtol=1e-4)
