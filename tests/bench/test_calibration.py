"""The calibration harness (bench/calibration): rows are expressed as the source ran them, and the
committed results are what the script computes now."""

import copy
import json
from pathlib import Path

import pytest
import torch

from autofit.models.info import meta_model
from bench.calibration import calibrate, measured_code

RESULTS = json.loads((Path(calibrate.__file__).parent / "results" / "calibration.json").read_text())
ROWS = {row["id"]: row for row in json.loads(calibrate.ROWS.read_text())}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_every_row_is_predicted_or_listed_apart_with_what_is_missing():
    predicted = {row["id"] for row in RESULTS["rows"]}
    apart = {row["id"]: row["missing"] for row in RESULTS["not_expressible"]}
    assert predicted | set(apart) == set(ROWS) and not predicted & set(apart)
    assert all(apart.values())
    assert "op-level selective" in apart["torchtitan-llama31-8b-fsdp8-bs2-seq8192"]
    excluded = ("perf_train_gpu_one", "optimizer_step_in_backward", "fabric")  # kept out: an independent check
    assert not any(word in row["source"].lower() for row in ROWS.values() for word in excluded)


def test_a_row_is_expressed_as_its_source_ran_it():
    row = ROWS["fsdpqlora-llama2-7b-qlora-ctx2048-bs4"]
    spec, config, strategies = calibrate.setup(row)
    assert (config.sharding.value, config.num_gpus, config.quantization.value, config.lora) == ("fsdp_full", 2, "nf4", 64)
    assert config.checkpointing.value == "full" and not config.half_precision  # bf16 weights, no autocast
    assert strategies[0].target_modules == ("k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj")
    assert calibrate.targets(ROWS["litgpt-hub-phi2-lora-mb4"], "PhiConfig") == [
        "q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2", "lm_head"]


def _reproduced(row_id: str) -> None:
    committed = next(r for r in RESULTS["rows"] if r["id"] == row_id)
    again = calibrate.run_row(ROWS[row_id])
    assert again["model_code"] == committed["model_code"]
    assert again["predicted_bytes"] == committed["predicted_bytes"]
    assert again["error"] == committed["error"]


def test_committed_result_is_reproduced():
    # transformers 4.38's loss, bitsandbytes 0.43.0's NF4 layers, re-entrant checkpointing, FSDP over 2 GPUs,
    # a reserved figure (the caching allocator replayed)
    _reproduced("fsdpqlora-llama2-7b-qlora-ctx512-bs1")


@pytest.mark.skipif(bool(measured_code.litgpt_missing()), reason="litgpt is not installed in bench/calibration/vendor "
                    "(bench/calibration/install_measured_code.sh installs it)")
def test_committed_litgpt_result_is_reproduced_with_litgpts_own_code():
    assert calibrate.model_code(ROWS["litgpt-hub-tinyllama-full-mb4"]) == "litgpt"
    _reproduced("litgpt-hub-tinyllama-full-mb4")
    assert calibrate.model_code(ROWS["litgpt-hub-stablelm3b-qlora-mb1"]) == "litgpt_qlora"
    _reproduced("litgpt-hub-stablelm3b-qlora-mb1")  # litgpt's model and LoRA, NF4 under its adapters


def test_litgpt_rows_fall_back_to_transformers_without_litgpt_and_say_so(monkeypatch):
    monkeypatch.setattr(measured_code, "litgpt_missing", lambda: "not installed")
    row = ROWS["litgpt-hub-tinyllama-full-mb4"]
    assert calibrate.model_code(row) == "transformers"
    spec, config, strategies = calibrate.setup(row)
    assert type(meta_model(spec.model_factory)).__name__ == "LlamaForCausalLM"
    assert spec.loss_fn is calibrate.bf16_cross_entropy


def test_a_lora_row_of_peft_010_trains_bf16_adapters_built_into_the_model():
    row = ROWS["fsdpqlora-llama2-7b-lora-ctx2048-bs4"]
    spec, config, strategies = calibrate.setup(row)
    assert calibrate.model_code(row) == "fsdp_qlora" and config.lora == 0 and not strategies
    model = meta_model(spec.model_factory)
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    assert trainable == {torch.bfloat16} and sum(p.numel() for p in model.parameters() if p.requires_grad) == \
        32 * 64 * (3 * (4096 + 4096) + 3 * (4096 + 11008))  # rank 64 on q, k, v, gate, up, down


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64)


def test_upcast_logits_computes_transformers_438s_loss_on_fp32_logits():
    torch.manual_seed(0)
    model = measured_code.upcast_logits("LlamaConfig")(_tiny_llama_config()).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 9))
    output = model(input_ids=ids, labels=ids)
    assert output.logits.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(output.logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    assert torch.allclose(output.loss, expected)
    assert torch.allclose(measured_code.torchtune_loss(output, (ids, ids)), expected)


def test_bf16_adapters_are_bf16_and_alone_trainable_even_when_built_on_meta():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = measured_code.bf16_adapters(LlamaForCausalLM(_tiny_llama_config()).to(torch.bfloat16),
                                            {"rank": 4, "alpha": 16, "dropout": 0.1}, ["q_proj", "v_proj"])
    trainable = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert set(trainable.values()) == {torch.bfloat16}


def test_quantized_rows_are_simulated_with_the_bitsandbytes_release_their_source_ran():
    from autofit.strategies.quantization import SimulatedLinear4bit

    quantized = [r for r in RESULTS["rows"] if "quant=nf4" in r["config"]]
    assert len(quantized) == 10
    assert all(f"bitsandbytes {measured_code.bitsandbytes_of(r['id'])}" in r["model_code"] for r in quantized)
    assert "bitsandbytes 0.41.1" in next(r for r in quantized if r["id"].startswith("litgpt-rt-"))["model_code"]
    with measured_code.bitsandbytes_release("0.43.0"):
        assert SimulatedLinear4bit.keeps_input  # before the fix of bitsandbytes#1270
        with measured_code.bitsandbytes_release("0.43.2"):
            assert not SimulatedLinear4bit.keeps_input
    assert not SimulatedLinear4bit.keeps_input  # autofit's own default, restored
    with measured_code.bitsandbytes_release("0.42.0"):  # Params4bit.cuda quantized from fp16
        assert SimulatedLinear4bit.quantized_from is torch.float16
    with measured_code.bitsandbytes_release("0.43.0"):  # 0.43's _quantize keeps the weight's dtype
        assert SimulatedLinear4bit.quantized_from is None


def test_torchtunes_model_holds_a_rope_cache_per_layer_and_its_init_peak_the_template_layer():
    row = ROWS["torchtune-tut-llama2-7b-lora-qv-r8-init"]
    spec, _, _ = calibrate.setup(row)
    model = meta_model(spec.model_factory)
    caches = [b for name, b in model.named_buffers() if name.endswith("torchtune_rope")]
    assert len(caches) == row["model"]["layers"]
    assert {b.numel() * b.element_size() for b in caches} == {measured_code.rope_cache_bytes(128)}
    assert measured_code.rope_cache_bytes(128) == 4 * 64 * (1 + 2 * 4096)  # theta + [4096, 64, 2] cos / sin
    _reproduced(row["id"])  # the model states, its caches among them, and the template layer


def test_fsdp1s_root_unit_is_one_flat_parameter_whose_views_the_modules_use():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    plain = LlamaForCausalLM(_tiny_llama_config())
    flat = measured_code.fsdp1_flat_root(copy.deepcopy(plain), "model.layers")
    root = [n for n, _ in plain.named_parameters() if not n.startswith("model.layers.")]
    assert [n for n, _ in flat.named_parameters() if not n.startswith("model.layers.")] == ["fsdp1_flat_root"]
    assert flat.fsdp1_flat_root.numel() == sum(plain.get_parameter(n).numel() for n in root)
    ids = torch.randint(0, 50, (2, 9))
    plain(input_ids=ids, labels=ids).loss.backward()
    flat(input_ids=ids, labels=ids).loss.backward()  # the same math: the flat gradient is the views' gradients
    assert torch.allclose(flat.fsdp1_flat_root.grad, torch.cat([plain.get_parameter(n).grad.reshape(-1) for n in root]))


def test_fsdp1s_flat_root_reproduces_its_measured_excess_over_fsdp2():
    from bench.calibration import fsdp1_vs_fsdp2

    measured = json.loads(fsdp1_vs_fsdp2.RESULT.read_text())["peaks"]
    predicted = fsdp1_vs_fsdp2.predicted_peaks()
    gap = predicted["fsdp1, every micro-batch"] - predicted["fsdp2, every micro-batch"]
    # two CPU ranks, the same loop: FSDP1 peaked 6.51 MiB above FSDP2 (83% of the root unit's weights)
    assert gap == pytest.approx(measured["fsdp1, every micro-batch"] - measured["fsdp2, every micro-batch"], rel=0.1)


def test_litgpts_step_hands_back_fp32_logits_as_lightning_fabric_does():
    class Chunked(torch.nn.Module):  # litgpt's GPT: bf16 logits, a list of chunks when asked
        def forward(self, ids, lm_head_chunk_size=0):
            logits = torch.nn.functional.one_hot(ids, 8).to(torch.bfloat16).requires_grad_()
            return list(logits.split(lm_head_chunk_size, dim=1)) if lm_head_chunk_size else logits

    ids = torch.randint(0, 8, (2, 5))
    chunks = measured_code.LitgptStep(Chunked(), 2)(ids)
    assert [c.dtype for c in chunks] == [torch.float32] * 3 and torch.equal(torch.cat(chunks, 1).argmax(-1), ids)
    assert measured_code.LitgptStep(Chunked(), 0)(ids).dtype == torch.float32  # finetune/full.py: whole logits


def test_litgpts_step_holds_the_previous_iterations_logits_and_kept_inputs_through_the_forward(monkeypatch):
    from types import SimpleNamespace

    from autofit.devices.memory import StorageCounter
    from autofit.strategies.quantization import SimulatedLinear4bit

    monkeypatch.setattr(SimulatedLinear4bit, "keeps_input", True)  # bitsandbytes before 0.43.2

    class Gpt(torch.nn.Module):  # litgpt's GPT in miniature: NF4 layers, two of them sharing their input
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(padded_vocab_size=16)
            self.wte, self.adapter = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)  # the adapter trains
            self.up, self.gate, self.head = (SimulatedLinear4bit(torch.nn.Linear(8, n)) for n in (8, 8, 16))

        def forward(self, ids, lm_head_chunk_size=0):
            x = self.adapter(self.wte(ids))
            return self.head(self.up(x) * self.gate(x))

    gpt, ids, live = Gpt().to(torch.bfloat16), torch.randint(0, 16, (2, 5)), []
    gpt.register_forward_hook(lambda *_: live.append(counter.current))
    for previous in (False, True):
        with StorageCounter() as counter:
            logits = measured_code.LitgptStep(gpt, 0, previous_step=previous)(ids)
            live.append(counter.current)
        del logits
    (model_returns, step_returns), (model_returns_held, step_returns_held) = live[:2], live[2:]
    # the previous fp32 logits, the input up and gate share (once) and the head's input, all bf16 [2, 5, 8]
    assert model_returns_held - model_returns == 2 * 5 * 16 * 4 + 2 * (2 * 5 * 8 * 2)
    assert step_returns_held == step_returns  # all freed when the model returns
    assert "previous_step=True" in repr(measured_code.LitgptStep(gpt, 0, previous_step=True))  # cached apart
