import re

import pytest
import torch
from models import make_gpt2, make_mlp, make_mlp_batch, mlp_loss

from autofit import UsageError
from autofit.job.train_spec import make_spec, parse_allow, parse_optimizer


def spec(**kwargs):
    args = dict(global_batch_size=8, device="cpu", memory_budget="1GiB", loss_fn=mlp_loss)
    args.update(kwargs)
    return make_spec(args.pop("model", make_mlp), args.pop("batch", make_mlp_batch), **args)


def test_a_good_spec():
    s = spec()
    assert s.memory_budget == 2**30 and s.model.num_params == 133002 and s.model.num_blocks == 4
    assert s.fit_limit == int(2**30 * 0.9)


def test_budget_that_is_not_a_size():
    with pytest.raises(UsageError, match="'lots'"):
        spec(memory_budget="lots")


def test_global_batch_that_cannot_be_split():
    with pytest.raises(UsageError, match="global_batch_size 6 cannot be split over num_gpus=4"):
        spec(global_batch_size=6, num_gpus=4)
    with pytest.raises(UsageError, match="global_batch_size must be an integer >= 1, but got 0"):
        spec(global_batch_size=0)


def test_sample_batch_that_cannot_be_sliced():
    with pytest.raises(UsageError, match="disagree"):
        spec(batch=(torch.zeros(4, 3), torch.zeros(5)))


def test_a_batch_factory_that_takes_no_size():
    with pytest.raises(UsageError, match=r"make_batch\(\) must take the number of samples"):
        spec(batch=lambda: make_mlp_batch(8))


def test_sample_batch_without_samples():
    with pytest.raises(UsageError, match="holds 0 samples"):
        spec(batch=(torch.zeros(0, 32), torch.zeros(0)))


def test_batch_factory_that_ignores_its_argument():
    with pytest.raises(UsageError, match=r"make_batch\(3\) returned a batch of 8"):
        spec(batch=lambda n: make_mlp_batch(8))
    with pytest.raises(UsageError, match=r"make_batch\(3\) returned a batch of 2"):  # right at 2 only
        spec(batch=lambda n: make_mlp_batch(2))


def test_a_batch_factory_that_caps_its_size_stops_the_probe_that_asks_for_more():
    from autofit.config import Config
    from autofit.probe.run import run_probe
    from autofit.strategies import default_strategies

    capped = spec(batch=lambda n: make_mlp_batch(min(n, 4)))  # a dataset of 4 samples
    with pytest.raises(UsageError, match=r"make_batch\(8\) returned a batch of 4 samples"):
        run_probe(capped, Config(micro_batch_size=8), default_strategies())


def test_model_without_loss_and_no_loss_fn():
    with pytest.raises(UsageError, match=r"returned a tensor of shape \(2, 32, 10\), which has no scalar loss.*loss_fn"):
        spec(loss_fn=None)


def test_device_that_does_not_exist():
    with pytest.raises(UsageError, match=r"device='cuda:3' does not exist: \d+ CUDA device"):
        spec(device="cuda:3")
    with pytest.raises(UsageError, match="'tpu'"):
        spec(device="tpu")
    with pytest.raises(UsageError, match="device='gpu' is not a device name; use 'cpu', 'cuda' or 'cuda:N'"):
        spec(device="gpu")


def test_a_device_name_is_read_in_any_case():
    assert spec(device="CPU").device == spec(device=" cpu ").device == torch.device("cpu")  # typed in a hurry
    with pytest.raises(UsageError, match=r"device='CUDA:3' does not exist"):
        spec(device="CUDA:3")


def test_model_that_is_not_a_model():
    with pytest.raises(UsageError, match="got int"):
        spec(model=3)
    with pytest.raises(UsageError, match="returned str"):
        spec(model=lambda: "nope", batch=lambda n: torch.zeros(n, 2))


def test_no_batch_for_a_plain_model():
    with pytest.raises(UsageError, match="not a Hugging Face model"):
        spec(batch=None)


def test_hf_model_gets_a_synthesized_batch():
    s = make_spec(make_gpt2, global_batch_size=4, device="cpu", memory_budget="1GiB")
    assert s.tokens_per_sample == 64  # n_positions, under the 2048 cap
    assert set(s.batch_factory(3)) == {"input_ids", "labels"}


def test_seq_len_over_the_model_maximum():
    with pytest.raises(UsageError, match="seq_len 100 exceeds the model's maximum of 64"):
        make_spec(make_gpt2, seq_len=100, device="cpu", memory_budget="1GiB")


def test_seq_len_with_a_given_batch_is_its_length_or_refused():
    ids = torch.randint(0, 64, (2, 32))
    assert make_spec(make_gpt2, {"input_ids": ids, "labels": ids}, seq_len=32, device="cpu",
                     memory_budget="1GiB").tokens_per_sample == 32
    with pytest.raises(UsageError, match=r"seq_len=48 .* batch is given \(sample batch of 2 rows, cycled: 32 tokens"):
        make_spec(make_gpt2, {"input_ids": ids, "labels": ids}, seq_len=48, device="cpu", memory_budget="1GiB")
    with pytest.raises(UsageError, match="no sequence axis"):
        make_spec(make_mlp, make_mlp_batch, loss_fn=mlp_loss, seq_len=128, device="cpu", memory_budget="1GiB")


def test_allow():
    assert parse_allow(None) == 1 and parse_allow({"lora"}) == 2 and parse_allow(0) == 0
    with pytest.raises(UsageError, match="'everything'"):
        parse_allow("everything")
    # typed in a hurry: any case, QLoRA's name, the unknown name picked out with the one it is close to
    assert parse_allow("LoRA") == 2 and parse_allow({"qlora"}) == 2 and parse_allow(["Numerics "]) == 1
    with pytest.raises(UsageError, match=r"allow=\['lora', 'numeric'\]: 'numeric' is not a name it takes \(did you "
                                         r"mean 'numerics'\?\)"):
        parse_allow(["lora", "numeric"])
    with pytest.raises(UsageError, match=r"allow=3: the tiers are 0 \(exact\), 1 \(numerics changes\) and 2"):
        parse_allow(3)


def test_allow_reads_a_string_as_allow_on_the_command_line_does_and_says_what_a_precision_needs():
    """`--allow lora,numerics` and `--allow 2` worked on the command line, but allow="lora,numerics" and
    allow="2" were refused in Python; allow="bf16" (a precision, which the default tier opens) was "not a
    name it takes", as if bf16 were not searched."""
    assert parse_allow("lora,numerics") == 2 and parse_allow("LoRA, numerics") == 2
    assert parse_allow("2") == 2 and parse_allow(" 0 ") == 0
    with pytest.raises(UsageError, match=r"bf16 is a numerics change, which 'numerics', tier 1, opens: the default"):
        parse_allow("bf16")
    with pytest.raises(UsageError, match=r"'all' is not a name it takes \(allow=2 opens every tier\)"):
        parse_allow("all")


def test_optimizer():
    assert parse_optimizer("AdamW").explore
    kept = parse_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    assert kept.name == "user" and not kept.explore and kept.kwargs["lr"] == 0.1
    with pytest.raises(UsageError, match=r"'lion' is not known; use one of.*\(on the command line, --optimizer "
                                         r"FILE\.py:fn\)"):
        parse_optimizer("lion")
    with pytest.raises(UsageError, match=r"'Adam8bit' is not known \(did you mean 'adamw8bit' or"):  # typed in a hurry
        parse_optimizer("Adam8bit")


def test_an_optimizer_factory_is_kept_and_what_it_builds_recorded():
    def factory(params):
        return torch.optim.RMSprop(params, lr=0.01, alpha=0.9)

    spec = parse_optimizer(factory)
    assert spec.factory is factory and not spec.explore  # trained as given
    assert spec.cls is torch.optim.RMSprop and spec.kwargs["alpha"] == 0.9 and spec.describe() == \
        "user (torch.optim.rmsprop.RMSprop)"

    def needs_names(params):  # cannot be built over stand-ins: nothing recorded, the factory still kept
        raise KeyError("encoder.weight")

    opaque = parse_optimizer(needs_names)
    assert opaque.factory is needs_names and opaque.cls is None and opaque.kwargs == {} and opaque.describe() == "user"

    def with_scheduler(params):  # as a Lightning module's configure_optimizers returns them
        optimizer = torch.optim.SGD(params, lr=0.1)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 10)

    with pytest.raises(UsageError, match=r"The optimizer factory returned a tuple, not an optimizer: return the "
                                         r"torch.optim.Optimizer alone"):
        parse_optimizer(with_scheduler)  # every probe had failed in its step: "'tuple' object has no attribute"


class Recommender(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.EmbeddingBag(1000, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.table(ids)).mean()


@pytest.mark.parametrize("optimizer, refused", [
    ("adamw", "which adamw cannot step (nor the 8-bit AdamW or Adafactor"),
    (lambda ps: torch.optim.Adam(ps), "which Adam cannot step."),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), None),
    (lambda ps: torch.optim.Adagrad(ps), None),
])
def test_sparse_embeddings_need_an_optimizer_that_steps_sparse_gradients(optimizer, refused):
    """Every probe of a sparse table under AdamW failed alike in the step, reported as a fault of the model."""
    def build():
        return make_spec(Recommender, lambda n: torch.randint(0, 1000, (n, 4)), device="cpu", memory_budget="1GiB",
                         optimizer=optimizer)

    if refused is None:
        assert build().optimizer.name == "user"
        return
    with pytest.raises(UsageError, match=rf"Recommender.table is built with sparse=True: .*{re.escape(refused)}.*"
                                         r"optimizer=torch.optim.SGD\(model.parameters\(\), lr=0.1\) or Adagrad"):
        build()


class TwoArguments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x, labels):
        return torch.nn.functional.cross_entropy(self.linear(x), labels)


class OneDict(TwoArguments):
    def forward(self, batch):
        return self.linear(batch["x"]).sum()


def pairs(n):
    return torch.randn(n, 8), torch.randint(0, 4, (n,))


def named(n):
    x, labels = pairs(n)
    return {"x": x, "labels": labels}


@pytest.mark.parametrize("model", [TwoArguments, TwoArguments()], ids=["factory", "module"])
def test_a_batch_the_forward_cannot_take_is_refused_before_any_probe(model):
    with pytest.raises(UsageError, match=r"TwoArguments.forward\(x, labels\) cannot take a tuple batch's first"):
        spec(model=model, batch=pairs, loss_fn=None)
    assert spec(model=model, batch=named, loss_fn=None)  # by name it can
    with pytest.raises(UsageError, match=r"OneDict.forward\(batch\) does not take the batch's keys \['labels', 'x'\], "
                                         "and no loss_fn reads them"):
        spec(model=OneDict, batch=named, loss_fn=None)
    with pytest.raises(UsageError, match=r"OneDict.forward\(batch\) cannot be called with the batch's keys \[\]"):
        spec(model=OneDict, batch=named, loss_fn=lambda output, batch: output)


class Logits(TwoArguments):
    def forward(self, x):
        return self.linear(x)


def test_a_dict_batch_may_hold_keys_for_the_loss_alone():
    # A model of one's own with forward(x) and `labels` in the dict batch: refused before, now `labels`
    # reaches loss_fn alone; without a loss_fn reading it, the key would reach nothing: refused.
    loss_fn = lambda output, batch: torch.nn.functional.cross_entropy(output, batch["labels"])  # noqa: E731
    assert spec(model=Logits, batch=named, loss_fn=loss_fn)
    with pytest.raises(UsageError, match=r"does not take the batch's keys \['labels'\], and no loss_fn reads them"):
        spec(model=Logits, batch=named, loss_fn=None)


@pytest.mark.parametrize("loss_fn, message", [
    (lambda output: output.sum(), r"loss_fn\(output\) must take two arguments"),
    (lambda output, batch: output.sum(1), r"shape \(2, 10\), not a scalar"),
    (lambda output, batch: output.sum().detach(), "does not depend on any trainable parameter"),
])
def test_a_loss_fn_that_gives_no_loss_to_backward_is_refused(loss_fn, message):
    with pytest.raises(UsageError, match=message):
        spec(loss_fn=loss_fn)


def test_weights_on_the_meta_device_are_refused_for_probes_and_taken_by_the_dry_run():
    with torch.device("meta"):
        empty = make_mlp()
    with pytest.raises(UsageError, match="weights are on the meta device .* autofit.dry_run takes it"):
        make_spec(empty, make_mlp_batch, loss_fn=mlp_loss, device="cpu", memory_budget="1GiB")
    from autofit import dry_run

    report = dry_run(empty, make_mlp_batch, loss_fn=mlp_loss, global_batch_size=4, gpu="t4")
    assert report.fits and report.chosen.estimate.simulated
    assert all(p.is_meta for p in empty.parameters())  # the module given is left as it was


def test_a_factory_that_refuses_its_config_on_meta_is_not_built_for_real():
    """autofit's builder refuses a config transformers cannot build with a UsageError: on the meta device it
    was taken for a factory that cannot build there, and the model was built for real, every layer before the
    failing one allocated (a CohereCompass classifier's default config, 40 layers of 8192: 24 GB of RAM, and the
    dry-run's process killed by the operating system)."""
    built_on = []

    def factory():
        built_on.append(torch.get_default_device().type)
        raise UsageError("transformers cannot build XForSequenceClassification from this XConfig: KeyError")

    with pytest.raises(UsageError, match="cannot build XForSequenceClassification"):
        make_spec(factory, lambda n: torch.randn(n, 4), device="cpu", memory_budget="1GiB")
    assert built_on == ["meta"]


def test_cpu_ranks_share_the_free_ram_when_no_budget_is_given():
    """Each CPU rank's default budget was the whole free RAM, twice the machine's for two ranks."""
    spec = make_spec(make_mlp, make_mlp_batch, loss_fn=mlp_loss, device="cpu", num_gpus=2, global_batch_size=4)
    assert spec.budget_reason == "free host RAM shared by 2 ranks"
    import psutil

    assert 2 * spec.memory_budget <= psutil.virtual_memory().total


def test_each_tier_is_suggested_by_its_first_allow_name():
    from autofit.config import ALLOW_NAMES, tier_name
    from autofit.search.shortfall import tier_words

    assert (tier_name(1), tier_name(2)) == ("numerics", "lora")
    assert all(ALLOW_NAMES[tier_name(tier)] == tier for tier in (1, 2))
    assert tier_words(2) == "allow={'lora'} (LoRA adapters, quantized base weights)"
    assert tier_words(1, cli=True) == "--allow numerics (mixed precision, 8-bit optimizers)"


def test_the_loss_check_of_a_deep_hugging_face_model_runs_one_block_and_still_refuses_a_bad_loss():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    ran = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: ran.append(module) if isinstance(module, GPT2Block) else None)
    try:
        make_spec(make_gpt2, device="cpu", memory_budget="1GiB", seq_len=16)
        assert len(ran) == 1  # one of the model's 4 blocks: the shallow copy's
        with pytest.raises(UsageError, match=r"shape \(2, 16, 256\), not a scalar"):
            make_spec(make_gpt2, device="cpu", memory_budget="1GiB", seq_len=16,
                      loss_fn=lambda output, batch: output.logits)
    finally:
        hook.remove()


def test_a_given_module_has_its_loss_checked_on_a_meta_copy_and_is_left_as_it_was():
    module = make_mlp()
    before = {name: value.clone() for name, value in module.state_dict().items()}
    with pytest.raises(UsageError, match=r"shape \(2, 10\), not a scalar"):
        spec(model=module, loss_fn=lambda output, batch: output.sum(1))
    assert spec(model=module).model.num_params == 133002
    assert all(value.device.type == "cpu" and torch.equal(value, before[name])
               for name, value in module.state_dict().items())
