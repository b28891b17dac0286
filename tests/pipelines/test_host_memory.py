"""Host memory is part of fitting (issue 54): a dry-run given the node's RAM rules out what needs more and
names host memory when nothing is left; without it, a plan needing an unusual node says so; a tune skips an
offload probe this machine cannot hold. The whole dry-run of the issue (llama-2-70b on an 8 GiB card with
--host-memory 64GiB, exit 3 naming host memory) is minutes of simulation: its command is in docs/security.md."""

from __future__ import annotations

from autofit import Config
from autofit.devices.gpus import get_gpu
from autofit.estimate.prediction import Estimate
from autofit.pipelines.dry_run import Candidate
from autofit.pipelines.host_memory import host_note, host_shortfall, over_host, typical_host_bytes
from autofit.strategies.memory import Breakdown

TIB = 2**40
OFFLOADED = Config(micro_batch_size=1, grad_accum_steps=8, precision="bf16", sharding="zero3", offload="cpu")
ON_CARD = Config(micro_batch_size=1, grad_accum_steps=8, precision="bf16", sharding="zero3")


def candidate(config: Config, cpu_bytes: int, fits: bool = True) -> Candidate:
    estimate = Estimate(Breakdown(1, 1, 1, 1, 1), 5 * 2**30, cpu_bytes, "simulated")
    return Candidate(config, estimate, fits, "fits", 0, 1.0, 8.0, 7 * 2**30)


def test_candidates_needing_more_host_ram_than_given_are_ruled_out_naming_it():
    rows = [candidate(OFFLOADED, int(1.26 * TIB)), candidate(ON_CARD, 0, fits=False)]
    kept, over = over_host(rows, 64 * 2**30)
    assert [c.fits for c in kept] == [False, False] and over == [kept[0]]
    assert "over the 64.00 GiB given (host_memory)" in kept[0].reason
    words = host_shortfall(over, 64 * 2**30)
    assert words.startswith("No candidate fits in 64.00 GiB of host memory per node") and "1.26 TiB" in words
    assert over_host(rows, None) == (rows, [])  # nothing given: nothing ruled out


def test_a_chosen_plan_needing_an_unusual_node_says_so_in_its_summary():
    gpu = get_gpu("h100-80gb").with_memory(8 * 2**30)
    note = host_note(candidate(OFFLOADED, int(1.26 * TIB)), gpu, 1)
    assert "needs 1.26 TiB of host RAM per node" in note and "--host-memory" in note
    assert host_note(candidate(OFFLOADED, 2**30), gpu, 1) == ""  # a typical node holds it
    assert typical_host_bytes(get_gpu("h100-80gb"), 8) > 1.5 * TIB


def test_an_offload_probe_this_machine_cannot_hold_is_skipped_with_the_reason(tmp_path):
    from autofit.strategies import MicroBatch, StateOffloading

    def room(config, need_bytes, nvme_path):
        return StateOffloading().host_room(config, lambda: need_bytes, nvme_path)

    assert "of host RAM for what it offloads, and this machine has" in room(OFFLOADED, 2**60, None)
    assert room(OFFLOADED, 2**20, None) is None
    assert room(ON_CARD, 2**60, None) is None  # nothing offloaded: nothing to check
    nvme = OFFLOADED.replace(offload="nvme")
    assert "does not exist" in room(nvme, 2**20, str(tmp_path / "missing"))
    assert "free" in room(nvme, 2**62, str(tmp_path))
    assert MicroBatch().host_room(OFFLOADED, lambda: 2**60, None) is None  # moves nothing off the GPU


def test_the_tuner_asks_before_an_offload_probe_only():
    from models import make_mlp, make_mlp_batch, mlp_loss

    from autofit.job.train_spec import make_spec
    from autofit.pipelines.host_memory import offload_skip

    spec = make_spec(make_mlp, make_mlp_batch, global_batch_size=8, device="cpu", memory_budget="1GiB",
                     loss_fn=mlp_loss)
    assert offload_skip(spec, Config(micro_batch_size=8)) is None  # nothing offloaded: not even predicted
    small = Config(micro_batch_size=8, activation_offload="cpu")
    assert offload_skip(spec, small) is None  # a small MLP's offloaded activations fit any machine
