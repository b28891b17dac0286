"""The spec of a CUDA run in the CUDA test double (tests/cuda_double.py): bf16 by the chosen card's
capability, a user's module already on the card, the dtype a Hugging Face config builds in, and what
the spec summary says about other processes' memory. Nothing here ran on a GPU."""


import torch
from torch import nn

from cuda_double import GiB, FakeCuda, FakeGpu, OnFakeCuda, on_fake_cuda  # noqa: E402

from autofit.config import Precision  # noqa: E402
from autofit.devices.memory import CudaBudget  # noqa: E402
from autofit.job.train_spec import make_spec  # noqa: E402
from autofit.strategies import MixedPrecision as PrecisionStrategy  # noqa: E402

TWO_CARDS = [FakeGpu(name="NVIDIA H100 80GB HBM3", capability=(9, 0)),
             FakeGpu(name="Tesla V100-SXM2-32GB", total=32 * GiB, capability=(7, 0), pci=(0, 0x3B, 0))]


def _batch(n):
    return torch.randn(n, 8)


def _loss(output, batch):
    return output.float().pow(2).mean()


def test_bf16_is_decided_by_the_chosen_cards_capability_not_the_current_one():
    # Defect 6 (fixed on main in 383c441, autofit/devices/device.py bf16_support): the current device is an
    # H100; the chosen one a V100 (SM 7.0), where is_bf16_supported() would say True (emulation).
    with FakeCuda(TWO_CARDS) as cuda:
        cuda.current = 0
        spec = make_spec(nn.Linear(8, 8), _batch, device="cuda:1", loss_fn=_loss)
        options = {o.value: o for o in PrecisionStrategy().options(spec)}
    assert not spec.target.bf16 and "SM 7.0" in spec.target.bf16_reason
    assert not options[Precision.BF16].available and options[Precision.FP16].available


def test_a_module_on_the_card_is_snapshot_to_the_cpu_and_not_charged():
    # Defect 10: the user's module on the GPU was deep-copied on the GPU for every probe (and unpickled
    # onto GPU 0 in children), and its bytes counted in every in-process peak.
    with FakeCuda() as cuda:
        model = on_fake_cuda(nn.Linear(8, 8))
        sample = OnFakeCuda(torch.randn(4, 8))
        spec = make_spec(model, sample, device="cuda", loss_fn=_loss)
        built = spec.model_factory()
        assert {p.device.type for p in built.parameters()} == {"cpu"}
        assert spec.batch_factory(2).device.type == "cpu"
        assert model.weight.device.type == "cuda"  # the user's module is untouched
        assert spec.resident_bytes == (8 * 8 + 8 + 4 * 8) * 4
        with CudaBudget(GiB, torch.device("cuda", 0), spec.resident_bytes) as budget:
            cuda.max_reserved[0] = spec.resident_bytes + 1000  # the user's tensors + what the probe added
        assert budget.peak == 1000 + budget.outside_allocator()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_the_cpu_snapshot_keeps_tied_weights_tied():
    with FakeCuda():
        spec = make_spec(on_fake_cuda(Tied()), _batch, device="cuda", loss_fn=_loss)
        built = spec.model_factory()
    assert built.a.weight is built.b.weight and built.a.weight.device.type == "cpu"


def test_a_bf16_hugging_face_config_builds_fp32_weights():
    # Defect 16: transformers 5 `from_config` reads config.dtype, so "fp32" probes trained bf16 weights.
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    config.dtype = torch.bfloat16  # as a checkpoint's config.json often says
    spec = make_spec(config, device="cpu", seq_len=8)
    assert {p.dtype for p in spec.model_factory().parameters()} == {torch.float32}


def test_the_summary_reports_other_processes_memory_and_how_this_one_is_measured():
    # Defect 1: foreign memory is reported in the plan's spec summary.
    with FakeCuda([FakeGpu(foreign=12 * GiB)]):
        summary = make_spec(nn.Linear(8, 8), _batch, device="cuda", loss_fn=_loss).summary()
    assert summary["foreign_memory"] == 12 * GiB
    assert summary["memory_accounting"] == "this process's own memory (NVML)"
