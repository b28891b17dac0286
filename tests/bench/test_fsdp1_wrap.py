"""bench/calibration/fsdp1_wrap.py: the allocations it replays for FSDP1's wrapping are the ones real
FSDP1 makes, recorded on the CPU as rank 1 of 2 (torch's fake process group) for a small PEFT-LoRA
Llama wrapped as fsdp_qlora wraps (each trainable LoRA leaf and each decoder layer a unit, the root last;
built on the meta device and materialized by `param_init_fn`, as rank 1 of fsdp_qlora's `low_memory`
loading is; rank 0 moves its CPU weights to the GPU in the same order)."""

import functools

import pytest
import torch

from bench.calibration.fsdp1_wrap import fsdp_qlora_policy, units, wrap_events

SMALL_BUCKET = 40_000  # bytes: a decoder layer's 82 KB of tensors goes out in several buckets, two in flight


def tiny_lora_llama(meta: bool):
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
    with torch.device("meta" if meta else "cpu"):
        model = peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(r=4, lora_alpha=8,
                                    target_modules=["q_proj", "v_proj"]), autocast_adapter_dtype=False)
    return model.to(torch.bfloat16)


def is_unit(module) -> bool:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return fsdp_qlora_policy(LlamaDecoderLayer)(module)


class Recorder:
    """Every storage made and freed while active, as ("malloc", key, bytes) / ("free", key, 0)."""

    def __init__(self):
        from autofit.devices.memory import StorageCounter

        events = self.events = []

        class Counter(StorageCounter):
            def _count(self, storage):
                before = self._live.get(id(storage))
                super()._count(storage)
                after = self._live.get(id(storage))
                if after is not None and after is not before:
                    if before is not None:
                        events.append(("free", id(storage), 0))
                    events.append(("malloc", id(storage), storage.nbytes()))

            def _forget(self, key):
                if key in self._live:
                    events.append(("free", key, 0))
                super()._forget(key)

        self.counter = Counter()


@pytest.fixture
def rank1_of_2(monkeypatch):
    """This process as rank 1 of 2 over torch's fake process group: collectives complete at once, in this
    thread, so every tensor dies when FSDP's code drops it (over gloo, its worker thread let go of a
    broadcast's tensors a few storages later, or after the wrapping)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import _init_utils
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # FSDP refuses CPU states with sync_module_states (it is meant for GPUs); the broadcast takes them
    monkeypatch.setattr(_init_utils, "_check_module_states_for_sync_module_states", lambda states: None)
    monkeypatch.setattr(_init_utils, "PARAM_BROADCAST_BUCKET_SIZE", SMALL_BUCKET)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def timeline(events):
    """The sizes of the storages made, in order (a storage resized to 0 and freed later holds nothing),
    and for each the number of storages made before it was freed (None: alive at the end)."""
    index, sizes, freed = {}, [], []
    for kind, key, size in events:
        if kind == "malloc" and size:
            index[key] = len(sizes)
            sizes.append(size)
            freed.append(None)
        elif kind == "free" and key in index:
            freed[index.pop(key)] = len(sizes)
    return sizes, freed


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_the_replayed_wrap_allocates_and_frees_what_fsdp1_does(strategy, rank1_of_2):
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    recorder = Recorder()
    model = tiny_lora_llama(meta=True)  # rank 1: built on meta, materialized unit by unit
    with recorder.counter:
        FullyShardedDataParallel(model, auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=is_unit),
                                 sharding_strategy=ShardingStrategy[strategy], use_orig_params=False,
                                 device_id=torch.device("cpu"), sync_module_states=True,
                                 param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False))
    modelled = wrap_events(units(tiny_lora_llama(meta=True), is_unit), world=2, sharded=strategy == "FULL_SHARD",
                           bucket=SMALL_BUCKET)
    sizes, freed = timeline(recorder.events)
    assert len(sizes) > 40  # 4 LoRA units and a layer per block, and the root
    assert timeline(modelled) == (sizes, freed)
