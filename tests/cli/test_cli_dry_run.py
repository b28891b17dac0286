"""`autofit dry-run`, `autofit gpus` and `autofit models`: the tables, --json, and the exit codes (0 / 3 / 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autofit.cli.main import main, sizes_joined
from autofit.cli.tune import COUNT, LENGTH

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512}


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY))
    return path


def dry_run(*args):
    return main(["dry-run", "--seq-len", "128", "--global-batch-size", "8", *args])


def test_table_marks_the_chosen_candidate(config_json, capsys):
    assert dry_run("--model", str(config_json.parent), "--gpu", "rtx-4090", "--top", "0") == 0
    out = capsys.readouterr().out
    assert "is read as" not in out  # a card of one size
    # a 2-layer model at 128 tokens is bound by kernel launches: fp32 launches no autocast casts
    assert "★ fp32" in out and "Chosen:" in out and "peak/GPU" in out and "activations" in out
    assert "RAM" in out and "offload" in out  # offload rows show their host RAM (cells may wrap)
    # which memory the peaks are and what the bounds rest on, once under the table; a bound per row
    flat = " ".join(out.split())
    assert "peak/GPU: the predicted reserved + context per GPU" in flat and "decoder/fused" in flat
    assert "bound" in out and "+4%" in out


@pytest.mark.parametrize("gpus, hint", [(("--gpu", "a100", "--num-gpus", "2"), "--gpu a100-80gb"),
                                        (("--gpu", "2xa100"), "--gpu 2xa100-80gb")])  # as people write a machine
def test_json_is_one_document_with_every_candidate(config_json, capsys, gpus, hint):
    assert dry_run("--model", str(config_json), *gpus, "--json") == 0
    captured = capsys.readouterr()
    assert f"--gpu {gpus[1]} is read as a100-40gb (another of that name: {hint})" in captured.err
    data = json.loads(captured.out)
    assert data["chosen"]["fits"] and data["gpu"] == "a100-40gb" and data["num_gpus"] == 2
    for candidate in data["candidates"]:
        assert {"config", "peak_bytes", "fits", "reason", "breakdown"} <= set(candidate)
        assert candidate["config"]["micro_batch_size"] * candidate["config"]["grad_accum_steps"] * 2 == 8
    assert {"none", "zero1", "zero2", "zero3", "fsdp_grad_op", "fsdp_full"} <= {
        c["config"]["sharding"] for c in data["candidates"]}


def test_your_own_optimizer_from_a_file_is_predicted_as_measured(config_json, tmp_path, capsys):
    """`--optimizer FILE.py:fn`: SGD with momentum keeps one copy of the weights and makes no temporary on
    CUDA's foreach path (AdamW's formula would have said two copies and one)."""
    (tmp_path / "opt.py").write_text("import torch\ndef sgd(params):\n"
                                     "    return torch.optim.SGD(params, lr=0.1, momentum=0.9)\n")
    assert dry_run("--model", str(config_json), "--gpu", "rtx-4090", "--optimizer", f"{tmp_path}/opt.py:sgd",
                   "--json") == 0
    rows = [c for c in json.loads(capsys.readouterr().out)["candidates"]
            if c["config"]["precision"] == "fp32" and c["config"]["sharding"] == "none" and not c["config"]["lora"]]
    assert rows and all(c["config"]["optimizer"] == "user" for c in rows)
    assert all(abs(c["breakdown"]["optimizer"] / c["breakdown"]["params"] - 1) < 0.01 for c in rows)  # + buffers
    assert "your optimizer's states 1x the trained weights, measured on stand-ins" in rows[0]["reason"]


@pytest.mark.parametrize("args, message", [(("--seq-len", "0"), "--seq-len 0: must be an integer >= 1"),
                                           (("--top", "-1"), "'--top': -1 is not in the range x>=0"),
                                           (("--gpu", "8xh100", "--num-gpus", "4"),
                                            "--gpu '8xh100' says 8 GPUs but --num-gpus 4: give the count once")])
def test_bad_values_exit_2_and_json_still_gets_its_document(config_json, capsys, args, message):
    assert main(["dry-run", "--model", str(config_json), *args, "--json"]) == 2
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert set(document) == {"error", "exit_code"} and document["exit_code"] == 2
    assert message in document["error"] and message in captured.err


def test_nothing_fits_exits_3_naming_the_closest(config_json, capsys):
    # exact levels alone (--allow 0) say it: at 8 MiB every level's floor is within its activations of the least
    # need, so every level allowed is predicted (all of them: 980 rows in 16 s, the same smallest and remedy)
    assert dry_run("--model", str(config_json), "--gpu", "rtx-4090", "--gpu-memory", "8MiB", "--allow", "0",
                   "--json") == 3
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["chosen"] is None and "the smallest needs" in data["reason"]
    assert "exceeds the limit: use a GPU with more memory" in data["reason"]  # 8 MiB: the CUDA context alone
    assert data["shortfall"]["remedy"] == "larger-gpu" and "cuda_context" in data["shortfall"]["overhead_terms"]
    assert "Nothing fits." in captured.err


def test_what_to_allow_is_said_in_each_ones_words():
    """One shortfall, two sentences: the plan's reason in Python's words, the command line's in its own."""
    from autofit.config import Config
    from autofit.search.shortfall import Basis, Remedy, Shortfall

    shortfall = Shortfall(limit=2**30, capacity=2**30 * 10 // 9, margin=0.1, smallest=Config(micro_batch_size=1),
                          need=3 * 2**30, basis=Basis.PREDICTED, remedy=Remedy.ALLOW, tier=1)
    assert "Pass allow={'numerics'} (mixed precision, 8-bit optimizers) to go further." in shortfall.words()
    assert "Pass --allow numerics (mixed precision, 8-bit optimizers) to go further." in shortfall.words(cli=True)
    assert "the smallest needs 3.00 GiB by the estimator's prediction" in shortfall.words(cli=True)
    more = Shortfall(limit=2**30, capacity=2**30, margin=0.1, gpu="t4", smallest=Config(), need=2**31,
                     basis=Basis.PREDICTED, remedy=Remedy.MORE_MEMORY)
    assert "Use more GPUs (num_gpus) with ZeRO-3" in more.words()
    assert "Use more GPUs (--num-gpus) with ZeRO-3" in more.words(cli=True)


def test_a_rows_reason_is_read_from_the_estimates_fields():
    """The table leaves the activation method out of each row (it is said once under the table) by reading
    the estimate's fields, not by cutting it out of the sentence (a method holding "; " or a note
    holding the method's words once broke that)."""
    from autofit.cli.dry_run import short_reason
    from autofit.config import Config
    from autofit.estimate.prediction import Estimate
    from autofit.pipelines.dry_run import Candidate
    from autofit.strategies.memory import Breakdown

    method = "simulated under fake tensors; CPU kernels stand in"
    estimate = Estimate(Breakdown(1, 1, 1, 1, 0), 4, 0, method, ("simulated under fake tensors twice", "LoRA"))
    assert estimate.reason == f"{method}; simulated under fake tensors twice; LoRA"
    assert estimate.to_dict()["notes"] == ["simulated under fake tensors twice", "LoRA"]
    row = Candidate(Config(), estimate, True, "fits: 4 B of 8 B (50%), ~1.0 samples/s", 0, 1.0, 1.0)
    assert row.reason == f"fits: 4 B of 8 B (50%), ~1.0 samples/s; {estimate.reason}"
    assert short_reason(row) == "fits: 4 B of 8 B (50%), ~1.0 samples/s; simulated under fake tensors twice; LoRA"


def test_a_usage_error_names_its_parameters_in_each_ones_words():
    from autofit.errors import Param, UsageError

    error = UsageError("{given} sets the length of {{synthesized}} batches; or leave {name} out",
                       given=Param("seq_len", 512), name=Param("seq_len"))
    assert str(error) == "seq_len=512 sets the length of {synthesized} batches; or leave seq_len out"
    assert error.words(cli=True) == "--seq-len 512 sets the length of {synthesized} batches; or leave --seq-len out"
    assert Param("allow", {"numerics", "lora"}).words(cli=True) == "--allow lora,numerics"
    assert Param("optimizer", "adam9").words() == "optimizer='adam9'"
    assert Param("optimizer", "adam9").words(cli=True) == "--optimizer 'adam9'"


def test_seq_len_beside_a_batch_of_yours_is_refused_in_the_command_lines_words(tmp_path, capsys):
    (tmp_path / "mlp.py").write_text(
        "import torch\n"
        "def setup():\n"
        "    model = torch.nn.Linear(8, 2)\n"
        "    return model, lambda n: torch.randn(n, 8), lambda out, batch: out.pow(2).mean()\n")
    code = main(["dry-run", "--model", f"{tmp_path / 'mlp.py'}:setup", "--seq-len", "512", "--gpu", "t4"])
    assert code == 2 and "--seq-len 512 sets the length of the batch autofit synthesizes" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--model", "llama2-7"], "did you mean llama-2-7b"),
    (["--model", "gpt2", "--gpu", "a100-90gb"], "Known GPUs: a10, a100-40gb"),
    (["--model", "gpt2", "--seq-len", "4096"], "exceeds the model's maximum of 1024"),
    (["--model", "gpt2", "--seq-len", "4k"], "seq_len 4096 exceeds the model's maximum of 1024"),  # k = 1,024
    (["--model", "gpt2", "--seq-len", "2.5k"], "'2.5k' is not a length: pass a whole number, e.g. 4096, or 4k"),
    (["--model", "gpt2", "--gpu-memory", "lots"], "gpu_memory must be a size"),
    # a size typed with a space and no quotes is read whole: the next check speaks, not click's
    # "unexpected extra argument (GiB)"
    (["--model", "gpt2", "--gpu-memory", "24", "GiB", "--seq-len", "4096"], "exceeds the model's maximum"),
    (["--model", "gpt2", "--gpu-memory=24", "GB", "--seq-len", "4096"], "exceeds the model's maximum"),
    # a factory of the model alone: no batch can be synthesized for a plain module; the fix is the factory's
    (["--model", f"{EXAMPLES}/classifier.py:make_model", "--gpu", "t4"], "returning (model, make_batch)"),
    # a name typed in a hurry, picked out in the command line's words (was "allow={'numeric'} is not understood")
    (["--model", "gpt2", "--allow", "numeric"], "--allow numeric: 'numeric' is not a name it takes (did you mean "
                                                "'numerics'?)"),
])
def test_bad_usage_exits_2(args, message, capsys):
    assert main(["dry-run", "--global-batch-size", "8", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["dry-run", "tune"])
@pytest.mark.parametrize("args, message", [
    (["--global-batch-size", "1k"], "'1k': pass the number of samples, 1024 or 1000"),  # k is not one reading
    (["--global-batch-size", "0"], "--global-batch-size 0: must be an integer >= 1 (samples per optimizer step"),
    (["--seq-len", "0"], "--seq-len 0: must be an integer >= 1 (tokens per sample"),
])
def test_counts_typed_in_a_hurry_name_the_option(command, args, message, capsys):
    assert main([command, "--model", "gpt2", *args]) == 2
    assert message in capsys.readouterr().err


def test_counts_are_read_as_people_type_them():
    assert [COUNT.convert(v, None, None) for v in ("1024", "1,024", "1_024", " 64 ", 8)] == [1024, 1024, 1024, 64, 8]


def test_lengths_are_read_as_people_type_them():
    assert [LENGTH.convert(v, None, None) for v in ("4096", "4,096", "4k", "8K", "128k", " 2k ", 512)] == \
        [4096, 4096, 4096, 8192, 131072, 2048, 512]


def test_a_unit_after_a_space_joins_only_a_size_option():
    assert sizes_joined(["dry-run", "--gpu-memory", "24", "GiB"]) == ["dry-run", "--gpu-memory", "24GiB"]
    assert sizes_joined(["tune", "--memory-budget=4", "GB"]) == ["tune", "--memory-budget=4GB"]
    assert sizes_joined(["tune", "--model", "GB"]) == ["tune", "--model", "GB"]  # a value, not a unit
    assert sizes_joined(["dry-run", "--gpu-memory", "24GiB", "--model", "GiB"])[-1] == "GiB"
    # a count of GPUs typed apart from the name
    assert sizes_joined(["dry-run", "--gpu", "8x", "a100"]) == ["dry-run", "--gpu", "8x a100"]
    assert sizes_joined(["dry-run", "--gpu=8", "x", "a100", "--json"]) == ["dry-run", "--gpu=8 x a100", "--json"]
    assert sizes_joined(["dry-run", "--gpu", "a100", "x"]) == ["dry-run", "--gpu", "a100", "x"]  # no count first
    assert sizes_joined(["dry-run", "--gpu", "8x", "--json"]) == ["dry-run", "--gpu", "8x", "--json"]
    assert sizes_joined(["dry-run", "--gpu", "8", "x", "a100"]) == ["dry-run", "--gpu", "8 x a100"]
    assert sizes_joined(["dry-run", "--gpu", "8", "a100"]) == ["dry-run", "--gpu", "8", "a100"]  # no "x": click says


def test_a_gpu_count_typed_with_a_space_is_read_as_the_count(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE", str(tmp_path))
    assert dry_run("--model", "gpt2", "--seq-len", "128", "--global-batch-size", "16", "--gpu", "2x", "a100",
                   "--top", "1", "--json") == 0
    assert json.loads(capsys.readouterr().out)["num_gpus"] == 2


def test_unreadable_config_exits_2(tmp_path, capsys):
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    assert dry_run("--model", str(broken)) == 2
    assert "Cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("columns", ["200", "80", "60"])
def test_gpus_lists_profiles(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("a100-80gb", "rtx-4090", "v100-32gb"))  # names whole
    assert max(len(line.rstrip()) for line in out.splitlines()) <= int(columns)
    assert ("a100-sxm4-80gb" in out) == (int(columns) >= 130)  # aliases where there is room, else --json
    assert main(["gpus", "--json"]) == 0
    names = [g["name"] for g in json.loads(capsys.readouterr().out)["gpus"]]
    assert {"h100-80gb", "t4", "v100-32gb"} <= set(names)


@pytest.mark.parametrize("columns", ["80", "60"])
def test_narrow_terminal_and_pipes_fit_columns_with_whole_numbers(config_json, capsys, monkeypatch, columns):
    """Piped output (capsys is no terminal) honours COLUMNS; no line is wider and no figure is split."""
    from autofit.units import format_size

    monkeypatch.setenv("COLUMNS", columns)
    assert dry_run("--model", str(config_json), "--gpu", "rtx-4090", "--num-gpus", "2", "--top", "8") == 0
    out = capsys.readouterr().out
    assert max(len(line.rstrip()) for line in out.splitlines()) <= int(columns)
    assert main(["dry-run", "--seq-len", "128", "--global-batch-size", "8", "--model", str(config_json),
                 "--gpu", "rtx-4090", "--num-gpus", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for candidate in data["candidates"][:8]:
        assert format_size(candidate["peak_bytes"]) in out  # each peak whole, on one line
        assert f"{candidate['samples_per_s']:,.1f}" in out
    assert "activations" in out and "peak" in out  # the chosen row's parts, listed vertically
    assert len(out.splitlines()) < 120


@pytest.mark.parametrize("columns", ["150", "200"])
def test_wide_terminal_shows_every_part_per_row(config_json, capsys, monkeypatch, columns):
    """Every part of each row's peak from 150 columns; each row's reason from 200, where it has room (at
    150 it would fold to a word a line), without the activation method printed once below."""
    monkeypatch.setenv("COLUMNS", columns)
    assert dry_run("--model", str(config_json), "--gpu", "rtx-4090", "--top", "3") == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "configuration" in line)
    assert all(name in header for name in ("params", "grads", "optimizer", "activations", "overhead"))
    assert ("reason" in header) == (columns == "200")
    assert max(len(line.rstrip()) for line in lines) <= int(columns)
    table = lines[:next(i for i, line in enumerate(lines) if line.startswith("Chosen"))]
    assert not any("simulated under fake tensors" in line for line in table)
    assert len(table) < 3 * 8  # three rows of a few lines each


def test_the_simulation_prints_no_transformers_warnings(config_json):
    # a fresh process: transformers warns once per process, and this file's other tests simulate the same model
    code = textwrap.dedent(f"""
        import autofit
        from autofit.strategies import ActivationCheckpointing, MicroBatch
        autofit.dry_run({str(config_json)!r}, seq_len=128, global_batch_size=2, gpu="rtx-4090",
                        strategies=[MicroBatch(), ActivationCheckpointing()])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "use_cache" not in done.stderr and "[transformers]" not in done.stderr, done.stderr[-2000:]


def test_a_memory_size_without_a_card_says_whose_speeds_are_used(config_json, capsys):
    assert dry_run("--model", str(config_json), "--gpu-memory", "20GiB", "--top", "1") == 0
    assert "--gpu-memory 20GiB without --gpu: speeds are the h100-80gb profile's" in capsys.readouterr().out


@pytest.mark.parametrize("columns", ["200", "80", "60"])
def test_models_lists_every_preset_by_the_names_model_takes(capsys, monkeypatch, columns):
    from autofit.models.presets import get_preset, list_presets

    monkeypatch.setenv("COLUMNS", columns)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in list_presets()) and "128,256" in out  # names and figures whole
    assert max(len(line.rstrip()) for line in out.splitlines()) <= int(columns)
    assert ("meta-llama/Llama-2-7b-hf" in out) == (int(columns) >= 120)  # aliases where there is room
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    assert [r["name"] for r in rows] == list_presets()
    for row in rows:  # each alias is taken by --model, and the shape is the preset's own
        assert all(get_preset(alias).name_or_path == row["name"] for alias in row["aliases"])
    llama = next(r for r in rows if r["name"] == "llama-3-8b")
    assert (llama["layers"], llama["hidden"], llama["vocab"], llama["max len"]) == (32, 4096, 128256, 8192)
    vit = next(r for r in rows if r["name"] == "vit-base")
    assert vit["vocab"] is None and vit["architecture"] == "ViTForImageClassification"


def test_candidates_predicted_alike_are_one_row_naming_the_others():
    """Twins (every figure the same: SDPA and flash attention, most often) are one row at the first one's
    place; a candidate differing in any figure keeps its own row, and the JSON keeps every candidate."""
    from rich.console import Console

    from autofit.cli.dry_run import candidate_table
    from autofit.config import Config
    from autofit.devices.gpus import get_gpu
    from autofit.estimate.prediction import Estimate
    from autofit.pipelines.dry_run import Candidate, DryRunReport
    from autofit.strategies.memory import Breakdown

    def row(config, peak, seconds=1.0):
        estimate = Estimate(Breakdown(1, 1, 1, peak, 0), peak + 3, 0, "simulated")
        return Candidate(config, estimate, True, "fits", 0, seconds, 8 / seconds, 1 << 30)

    sdpa = Config(attention="sdpa", micro_batch_size=2)
    flash = sdpa.replace(attention="flash_attention_2")
    candidates = (row(sdpa, 10), row(sdpa.replace(micro_batch_size=1), 10), row(flash, 10),
                  row(flash.replace(micro_batch_size=1), 10, seconds=2.0), row(sdpa.replace(checkpointing="full"), 9))
    report = DryRunReport("m", get_gpu("h100-80gb"), 1, 8, 1 << 30, candidates, candidates[0], "why", 1.0)
    assert [[candidates.index(c) for c in group] for group in report.rows] == [[0, 1, 2], [3], [4]]
    assert report.to_dict()["rows"] == [[0, 1, 2], [3], [4]] and len(report.to_dict()["candidates"]) == 5
    console = Console(width=250, record=True)
    console.print(candidate_table(report, top=0, width=250))
    text = console.export_text()
    assert "5 of 5 candidates in 3 rows" in text
    assert "★ fp32, attn=sdpa, mb=2x1, opt=adamw; also mb=1x1; also attn=flash_attention_2" in text
    console = Console(width=250, record=True)
    console.print(candidate_table(report, top=2, width=250))
    assert "4 of 5 candidates in 2 rows" in console.export_text()


def test_twins_that_are_every_combination_of_a_few_changes_name_each_change_once():
    """SDPA or flash attention, and AdamW 8-bit paged or not, predicted alike: the row says "also
    attn=flash_attention_2 and/or opt=paged_adamw8bit" once, not each of the three combinations; twins that are
    not every combination are each named."""
    from autofit.config import Config
    from autofit.estimate.prediction import Estimate
    from autofit.pipelines.candidate import Candidate, also
    from autofit.strategies.memory import Breakdown

    def row(config):
        return Candidate(config, Estimate(Breakdown(1, 1, 1, 10, 0), 13, 0, "simulated"), True, "fits", 0, 1.0, 8.0,
                         1 << 30)

    head = Config(attention="sdpa", optimizer="adamw8bit", micro_batch_size=2)
    flash, paged = head.replace(attention="flash_attention_2"), head.replace(optimizer="paged_adamw8bit")
    both = flash.replace(optimizer="paged_adamw8bit")
    assert also(row(head), [row(flash), row(paged), row(both)]) == \
        "; also attn=flash_attention_2 and/or opt=paged_adamw8bit"
    assert also(row(head), [row(flash), row(paged)]) == "; also attn=flash_attention_2; also opt=paged_adamw8bit"
    assert also(row(head), [row(flash)]) == "; also attn=flash_attention_2"
    assert also(row(head), []) == ""
