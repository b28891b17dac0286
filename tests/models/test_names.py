"""`--model` resolution: presets, local configs, FILE.py:factory; each with its errors."""

from __future__ import annotations

import json
import pickle
import textwrap

import pytest
import torch
from transformers import GPT2Config

from autofit import UsageError, make_spec
from autofit.models.names import factory_loss_fn, resolve_loss_fn, resolve_model

TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)


def test_preset_builds_its_architecture():
    factory, batch, description = resolve_model("gpt2")
    assert batch is None and "preset gpt2" in description
    with torch.device("meta"):
        model = factory()
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert sum(p.numel() for p in model.parameters()) > 100e6  # gpt2 small: 124M


@pytest.mark.parametrize("config, built, batch", [
    ("BertConfig", "BertForMaskedLM", "input_ids and labels of 16 tokens"),  # was BertLMHeadModel (a decoder)
    ("DistilBertConfig", "DistilBertForMaskedLM", "input_ids and labels of 16 tokens"),  # was the bare model
    ("BartConfig", "BartForConditionalGeneration", "input_ids and decoder labels of 16 tokens each"),
    ("WhisperConfig", "WhisperForConditionalGeneration", "input_features 80x3000 and decoder labels of 16 tokens"),
    ("GPT2Config", "GPT2LMHeadModel", "input_ids and labels of 16 tokens"),
    ("CLIPConfig", "CLIPModel", None),  # was CLIPForImageClassification, its vision tower alone
    ("Wav2Vec2Config", "Wav2Vec2ForCTC", None),  # was the bare Wav2Vec2Model: no batch, no loss
])
def test_a_config_naming_no_architecture_builds_what_its_kind_trains(tmp_path, config, built, batch):
    # Before, the causal-LM mapping came first for every config: Whisper and BART trained their decoders
    # alone on token ids, BERT a causal head that warns without is_decoder=True.
    import transformers

    small = dict(max_position_embeddings=64, num_hidden_layers=1, hidden_size=32,
                 num_attention_heads=2, intermediate_size=64, n_layers=1, dim=32, n_heads=2, hidden_dim=64,
                 encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=0,
                 bos_token_id=0, eos_token_id=0, decoder_start_token_id=0, **TINY)
    data = getattr(transformers, config)(**small).to_dict() if batch else getattr(transformers, config)().to_dict()
    data.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(data))
    factory, _, description = resolve_model(str(tmp_path / "config.json"))
    assert description.startswith(f"{built} from ")
    with torch.device("meta"):
        assert type(factory()).__name__ == built
    if batch:  # the others' batches are their modality's (tests/estimate/test_architectures.py)
        spec = make_spec(factory, global_batch_size=2, seq_len=16, device="cpu", memory_budget="1GiB")
        assert spec.batch_description == batch


def test_a_distilled_classifier_for_inference_only_trains_as_its_classifier(tmp_path):
    """facebook/deit-base-distilled-patch16-224 names DeiTForImageClassificationWithTeacher, whose forward
    takes no labels (transformers runs it for inference only): it trains as DeiTForImageClassification, and
    the description says so (it was 'no scalar loss' on every candidate)."""
    from transformers import DeiTConfig

    config = DeiTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        image_size=32, patch_size=16, architectures=["DeiTForImageClassificationWithTeacher"])
    config.save_pretrained(tmp_path)
    factory, _, description = resolve_model(str(tmp_path))
    assert description.startswith("DeiTForImageClassification (the config's DeiTForImageClassificationWithTeacher "
                                  "runs inference only) from ")
    spec = make_spec(factory, global_batch_size=2, device="cpu", memory_budget="1GiB")
    assert factory()(**spec.batch_factory(2)).loss.requires_grad
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["NoSuchForCausalLM"]).save_pretrained(tmp_path)
    assert resolve_model(str(tmp_path))[2].startswith(  # a class transformers lacks is never called inference-only
        "GPT2LMHeadModel (the config's NoSuchForCausalLM is not a transformers class) from ")


def test_a_config_naming_no_architecture_that_maps_to_several_classes_builds_the_first(tmp_path):
    """transformers maps DeiT's config to its classifier and the ...WithTeacher one (Perceiver's to three):
    with no architectures named, the first is built, as its auto factory does (was: AttributeError, exit 1)."""
    from transformers import DeiTConfig, FunnelConfig

    DeiTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
               patch_size=16).save_pretrained(tmp_path)
    factory, _, description = resolve_model(str(tmp_path))
    assert description.startswith("DeiTForImageClassification from ")
    spec = make_spec(factory, global_batch_size=2, device="cpu", memory_budget="1GiB")
    assert factory()(**spec.batch_factory(2)).loss.requires_grad
    FunnelConfig(vocab_size=64, block_sizes=[1, 1], d_model=32, n_head=2, d_head=16, d_inner=64).save_pretrained(
        tmp_path)  # its bare model maps to two (FunnelModel, FunnelBaseModel): read when looking for a contrastive loss
    assert resolve_model(str(tmp_path))[2].startswith("FunnelForMaskedLM from ")


def test_a_config_with_floats_json_lacks_reads_as_transformers_wrote_it(tmp_path):
    """transformers 5 saves Mamba2's time_step_limit (0, inf) as [0.0, {"__float__": "Infinity"}] and decodes
    it when it reads the file: so does autofit (was: StrictDataclassFieldValidationError, exit 1). transformers
    4 writes JSON's bare Infinity, which Python's json reads as it is."""
    import transformers
    from transformers import Mamba2Config

    Mamba2Config(num_hidden_layers=1, hidden_size=32, num_heads=4, head_dim=16, vocab_size=64,
                 time_step_limit=(0.0, float("inf"))).save_pretrained(tmp_path)
    wrote = '{"__float__":"Infinity"}' if int(transformers.__version__.split(".")[0]) >= 5 else "Infinity"
    assert f'"time_step_limit":[0.0,{wrote}]' in "".join((tmp_path / "config.json").read_text().split())
    factory, _, description = resolve_model(str(tmp_path))
    assert description.startswith("Mamba2ForCausalLM from ")
    assert list(factory().config.time_step_limit) == [0.0, float("inf")]


def test_unknown_preset_lists_close_names():
    with pytest.raises(UsageError, match="gpt2"):
        resolve_model("gtp2")


@pytest.mark.parametrize("as_folder", [True, False])
def test_local_config(tmp_path, as_folder):
    GPT2Config(**TINY).save_pretrained(tmp_path)
    factory, batch, description = resolve_model(str(tmp_path if as_folder else tmp_path / "config.json"))
    model = factory()
    assert model.config.n_embd == 32 and "random weights" in description
    spec = make_spec(factory, batch, global_batch_size=2, device="cpu", memory_budget="1GiB")
    assert spec.tokens_per_sample == 16  # the batch is synthesized from the config
    pickle.dumps(factory)  # probes in child processes rebuild it


def test_bad_local_configs(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UsageError, match="Cannot read .*broken.json"):
        resolve_model(str(tmp_path / "broken.json"))
    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "nonesuch"}))
    with pytest.raises(UsageError, match="model_type='nonesuch'"):
        resolve_model(str(tmp_path / "odd.json"))
    with pytest.raises(UsageError, match="holds no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(UsageError, match="no such file"):
        resolve_model(str(tmp_path / "missing.json"))


FILE = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x, y):
            return (self.body(x) - y).pow(2).mean()

    def make():
        return Net()

    def make_pair():
        return Net(), lambda n: {"x": torch.randn(n, 8), "y": torch.randn(n, 1)}

    def not_a_model():
        return 3
""")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(FILE)
    return path


def test_file_factory_returning_a_model(model_file):
    factory, batch, description = resolve_model(f"{model_file}:make")
    assert batch is None and "make() from" in description
    assert isinstance(factory(), torch.nn.Module)
    pickle.loads(pickle.dumps(factory))()


def test_file_factory_returning_model_and_batch(model_file):
    factory, batch, description = resolve_model(f"{model_file}:make_pair")
    sample = batch(3)
    assert sample["x"].shape == (3, 8) and not sample["x"].is_meta
    assert factory()(**sample).dim() == 0
    pickle.loads(pickle.dumps(batch))(2)


@pytest.mark.parametrize("suffix,message", [
    (":not_a_model", "returned int"),
    (":nope", "has no function 'nope'.*make_pair"),
    ("", "names a file but no factory"),
])
def test_file_errors(model_file, suffix, message):
    with pytest.raises(UsageError, match=message):
        resolve_model(f"{model_file}{suffix}")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        resolve_model(f"{tmp_path}/absent.py:make")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UsageError, match="Importing .*broken.py failed: RuntimeError: boom"):
        resolve_model(f"{tmp_path}/broken.py:make")


# -- Hugging Face hub ids (ORG/NAME), resolved through a real hub-cache layout ----------------------------
COMMIT = "a09a35458c702b33eeacc393d103063234e8bc28"


def _cache_repo(home, repo_id: str, config: dict) -> None:
    """Lay out a repository as huggingface_hub's cache does: blobs by hash, a snapshot per commit whose
    files link to the blobs, and refs/main naming the commit."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / "0f3e1c2b9a8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f"
    blob.write_text(json.dumps(config))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 128}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 128}


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.mark.parametrize("repo_id, config, cls", [("Qwen/Qwen2.5-7B-Instruct", QWEN, "Qwen2ForCausalLM"),
                                                  ("mistralai/Mixtral-8x7B-v0.1", MIXTRAL, "MixtralForCausalLM")])
def test_hub_id_from_the_local_cache_offline(hf_home, repo_id, config, cls):
    _cache_repo(hf_home, repo_id, config)
    factory, batch, description = resolve_model(repo_id)
    with torch.device("meta"):
        model = factory()
    assert type(model).__name__ == cls and model.config.hidden_size == 64  # the cached config, not a preset
    assert batch is None and repo_id in description and "local Hugging Face cache" in description


def test_cached_config_wins_over_a_preset_alias(hf_home):
    _cache_repo(hf_home, "meta-llama/Llama-2-7b-hf", {**QWEN, "architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"})
    factory, _, description = resolve_model("meta-llama/Llama-2-7b-hf")
    with torch.device("meta"):
        assert factory().config.hidden_size == 64 and "cache" in description


def test_a_bare_name_the_cache_holds_under_an_org_is_named_with_it(hf_home):
    _cache_repo(hf_home, "Qwen/Qwen2.5-7B-Instruct", QWEN)
    with pytest.raises(UsageError, match=r"'qwen2.5-7b-instruct' is not a preset; the local Hugging Face cache holds "
                                         r"'Qwen/Qwen2.5-7B-Instruct': pass it as --model Qwen/Qwen2.5-7B-Instruct"):
        resolve_model("qwen2.5-7b-instruct")
    with pytest.raises(UsageError, match="Unknown model preset 'qwen2.5-7b-instructt'"):  # no such name cached
        resolve_model("qwen2.5-7b-instructt")


def test_preset_alias_is_the_offline_shortcut(hf_home):
    factory, _, description = resolve_model("meta-llama/Llama-2-7b-hf")  # nothing cached, offline
    assert "preset llama-2-7b" in description


def test_hub_id_found_nowhere_says_where_it_looked(hf_home):
    with pytest.raises(UsageError) as error:
        resolve_model("mistralai/Mixtral-8x7B-v0.1")
    message = str(error.value)
    assert str(hf_home / "hub") in message and "presets" in message and "HF_HUB_OFFLINE" in message
    assert "mistral-7b" not in message  # no misleading preset suggestion


def test_hub_id_online_with_the_hub_unreachable(hf_home, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    # one request, no retries: hf_hub_download alone retried five times with backoff (half a minute)
    # the transport's error by its name: httpx's ConnectError (huggingface_hub 1.x), requests' ConnectionError (0.x)
    with pytest.raises(UsageError, match=r"the hub \(http://127.0.0.1:9\) did not answer \(Connect(ion)?Error") as error:
        resolve_model("Qwen/Qwen2.5-7B-Instruct")
    assert str(hf_home / "hub") in str(error.value) and "HF_HUB_OFFLINE=1" in str(error.value)


LLAMA_31_HINT = (r"The preset llama-3-8b matches its name \(as llama-3.1-8b\): --model llama-3-8b plans it without "
                 r"the hub, but it differs from meta-llama/Llama-3.1-8B in its maximum length: 8,192 tokens "
                 r"\(max_position_embeddings\) where meta-llama/Llama-3.1-8B has 131,072")


def test_a_hub_id_found_nowhere_names_the_preset_of_its_name_and_how_it_differs(hf_home, monkeypatch):
    with pytest.raises(UsageError, match=LLAMA_31_HINT):  # offline
        resolve_model("meta-llama/Llama-3.1-8B")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # online, the hub unreachable
    with pytest.raises(UsageError, match=LLAMA_31_HINT):
        resolve_model("meta-llama/Llama-3.1-8B")
    # a variant suffix is dropped; a preset that is the same model says no difference
    with pytest.raises(UsageError, match=r"The preset qwen2.5-7b matches its name \(less its -Instruct suffix\): "
                                         r"--model qwen2.5-7b plans it without the hub\.$"):
        resolve_model("Qwen/Qwen2.5-7B-Instruct")


def test_dry_run_takes_a_cached_hub_id(hf_home):
    import autofit
    from autofit.strategies import MicroBatch, MixedPrecision

    _cache_repo(hf_home, "Qwen/Qwen2.5-7B-Instruct", QWEN)
    report = autofit.dry_run("Qwen/Qwen2.5-7B-Instruct", seq_len=32, global_batch_size=2, gpu="l4",
                             strategies=[MixedPrecision(), MicroBatch()])
    assert report.fits and "Qwen/Qwen2.5-7B-Instruct" in report.model


def test_factory_returning_a_triple_gives_its_loss(tmp_path):
    (tmp_path / "helpers.py").write_text("import torch\nSHIFT = 1.0\n")
    (tmp_path / "triple.py").write_text(textwrap.dedent("""
        import torch
        from helpers import SHIFT   # a module beside the factory's file

        def make():
            model = torch.nn.Linear(4, 2)
            return model, lambda n: (torch.randn(n, 4), torch.randn(n, 2)), loss
        def loss(output, batch):
            return (output - batch[1] + SHIFT).pow(2).mean()
    """))
    factory, batch, description = resolve_model(f"{tmp_path}/triple.py:make")
    loss = factory_loss_fn(f"{tmp_path}/triple.py:make")
    assert "make_batch and loss_fn" in description
    sample = batch(3)
    value = pickle.loads(pickle.dumps(loss))(factory()(sample[0]), sample)
    assert value.dim() == 0
    direct = resolve_loss_fn(f"{tmp_path}/triple.py:loss")
    assert pickle.loads(pickle.dumps(direct))(factory()(sample[0]), sample).dim() == 0


def test_a_factory_that_raises_names_file_factory_and_fix(tmp_path):
    (tmp_path / "bad.py").write_text("def make():\n    raise ValueError('no weights here')\n")
    with pytest.raises(UsageError, match=r"bad.py:make: make\(\) raised ValueError: no weights here. Fix the factory"):
        resolve_model(f"{tmp_path}/bad.py:make")
    with pytest.raises(UsageError, match="--loss-fn .* names a file but no function"):
        resolve_loss_fn(f"{tmp_path}/bad.py")
    with pytest.raises(UsageError, match="a tuple of 4"):
        (tmp_path / "four.py").write_text("import torch\ndef make():\n    f = lambda *a: None\n"
                                          "    return torch.nn.Linear(1, 1), f, f, f\n")
        resolve_model(f"{tmp_path}/four.py:make")
