"""Where each built-in technique is named outside its own strategy file (DESIGN.md: one technique, one file).

    python scripts/technique_names.py            # per technique: the package files naming it, and how
    python scripts/technique_names.py --json     # the same as one JSON document
    python scripts/technique_names.py --max 3    # exit 1 where a technique is named in more than 3 files

A technique is a strategy file of `autofit/strategies/`. What names it (`NAMES`): its knob's members other
than the no-op (`Loss.CHUNKED`, through any alias the file imports the knob under), the knob's type itself
where a file reads it, its knob field and the `Config` properties derived from it read off a config
(`config.loss`, `run.config.steps_in_backward`, `new.replace(checkpointing=...)`; the distinctive ones off
anything), string literals equal to a non-default value or the field ("pure_bf16", "checkpointing"),
and imports of its strategy module or class (code generated as strings included: "from
autofit.strategies.pure_bf16 import ..."). Comments and docstrings do not count.

Not counted: the technique's own file, `autofit/config.py` (where knobs are declared) and the one joint
module, `autofit/estimate/states.py` (ZeRO x offload x quantization model states, and the rules between
knobs that belong to no one technique, `JOINT_RULES`). The micro-batch
and the rank count (`micro_batch.py`, `data_parallel.py`) shape every step and every launcher by
definition: they are listed, and not held to `--max`.

Device facts (`DEVICE_FACTS`): in the GPU catalogue (`autofit/devices/gpus.py`, a card's peak TFLOP/s per
compute dtype) and `autofit gpus` (its "bf16" column: whether the card computes in bf16) the strings "bf16"
and "fp16" name a card's dtypes, not the mixed-precision technique, and are not counted there; anything else
naming the technique in those files (the `Precision` knob, `config.precision`) still is.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autofit"
EXCLUDED = ("autofit/config.py", "autofit/estimate/states.py")
STRUCTURAL = ("micro_batch", "data_parallel")  # every step's shape: listed, not held to --max

# technique (strategy file stem) -> what names it:
#   members: "Knob.MEMBER" of its values (the no-op member counts for every technique sharing the knob)
#   fields: Config fields and properties read off a config (`config.X`), or as keywords of `replace`/`Config`
#   distinct: attributes distinctive enough to count off anything (`.pure_bf16`)
#   strings: string literals equal to one of its values or fields
#   classes: its strategy classes
NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "precision": dict(members=("Precision.FP32", "Precision.BF16", "Precision.FP16"),
                      fields=("precision", "half_precision"), distinct=("half_precision",),
                      strings=("bf16", "fp16"), classes=("MixedPrecision",)),
    "pure_bf16": dict(members=("Precision.FP32", "Precision.PURE_BF16"), fields=("precision", "pure_bf16"),
                      distinct=("pure_bf16",), strings=("pure_bf16",), classes=("PureBf16",)),
    "attention": dict(members=("Attention.DEFAULT", "Attention.SDPA", "Attention.FLASH_ATTENTION_2",
                               "Attention.EAGER"), fields=("attention",), distinct=(),
                      strings=("sdpa", "flash_attention_2", "eager"), classes=("FusedAttention",)),
    "chunked_loss": dict(members=("Loss.FULL", "Loss.CHUNKED"), fields=("loss",), distinct=(),
                         strings=("chunked",), classes=("ChunkedLoss",)),
    "checkpointing": dict(members=("Checkpointing.NONE", "Checkpointing.OPS", "Checkpointing.EVERY_K",
                                   "Checkpointing.FULL"),
                          fields=("checkpointing", "checkpoint_every", "checkpointed_share", "recomputed_share"),
                          distinct=("checkpoint_every", "checkpointed_share", "recomputed_share"),
                          strings=("checkpointing", "checkpoint_every", "every_k"),
                          classes=("ActivationCheckpointing",)),
    "activation_offload": dict(members=("ActivationOffload.NONE", "ActivationOffload.CPU"),
                               fields=("activation_offload", "offloads_activations"),
                               distinct=("offloads_activations",), strings=("activation_offload",),
                               classes=("ActivationOffloading",)),
    "micro_batch": dict(members=(), fields=("micro_batch_size", "grad_accum_steps"), distinct=(),
                        strings=("micro_batch_size", "grad_accum_steps"), classes=("MicroBatch",)),
    "optimizer": dict(members=("Optimizer.ADAMW", "Optimizer.ADAMW8BIT", "Optimizer.PAGED_ADAMW8BIT",
                               "Optimizer.ADAFACTOR", "Optimizer.USER"), fields=("optimizer",),
                      distinct=("eight_bit",), strings=("adamw8bit", "paged_adamw8bit", "adafactor"),
                      classes=("OptimizerStates",)),
    "optimizer_in_backward": dict(members=("OptimizerStep.AFTER_BACKWARD", "OptimizerStep.IN_BACKWARD"),
                                  fields=("optimizer_step", "steps_in_backward"), distinct=("steps_in_backward",),
                                  strings=("in_backward", "optimizer_step"), classes=("OptimizerInBackward",)),
    "zero": dict(members=("Sharding.NONE", "Sharding.ZERO1", "Sharding.ZERO2", "Sharding.ZERO3",
                          "Engine.TORCH", "Engine.DEEPSPEED"),
                 fields=("sharding", "engine", "zero_stage", "shards_optimizer", "shards_gradients",
                         "shards_parameters"), distinct=("zero_stage", "shards_optimizer", "shards_gradients",
                                                         "shards_parameters"),
                 strings=("zero1", "zero2", "zero3"), classes=("Zero",)),
    "fsdp": dict(members=("Sharding.NONE", "Sharding.FSDP_GRAD_OP", "Sharding.FSDP_FULL", "Engine.TORCH",
                          "Engine.FSDP"),
                 fields=("sharding", "engine", "shards_optimizer", "shards_gradients", "shards_parameters",
                         "needs_sync_each_micro_batch"),
                 distinct=("shards_optimizer", "shards_gradients", "shards_parameters", "needs_sync_each_micro_batch"),
                 strings=("fsdp_grad_op", "fsdp_full"), classes=("Fsdp",)),
    "data_parallel": dict(members=(), fields=("num_gpus",), distinct=(), strings=("num_gpus",),
                          classes=("DataParallel",)),
    "quantization": dict(members=("Quantization.NONE", "Quantization.INT8", "Quantization.NF4"),
                         fields=("quantization", "adapters"), distinct=(), strings=("int8", "nf4", "quantization"),
                         classes=("QuantizedBase",)),
    "lora": dict(members=(), fields=("lora", "adapters"), distinct=(), strings=("lora",), classes=("Lora",)),
    "offload": dict(members=("Offload.NONE", "Offload.CPU", "Offload.NVME"), fields=("offload", "offloads"),
                    distinct=("offloads",), strings=("nvme",), classes=("StateOffloading",)),
    "allocator": dict(members=("Allocator.DEFAULT", "Allocator.EXPANDABLE"), fields=("allocator",), distinct=(),
                      strings=("expandable_segments",), classes=("ExpandableSegments",)),
}
# files -> string literals that are a GPU's own facts there (its dtypes), not the technique (see the docstring)
DEVICE_FACTS = {"autofit/devices/gpus.py": ("bf16", "fp16"), "autofit/cli/gpus.py": ("bf16", "fp16")}

# The strategy modules that are part of a technique without being one: the engines' shared base and the
# DeepSpeed config builder (both ZeRO's), the run object and the memory record every strategy shares.
PART_OF = {"sharding": ("zero", "fsdp"), "deepspeed_config": ("zero",)}


def python_files() -> list[pathlib.Path]:
    """Every module of the package."""
    return sorted(PACKAGE.rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (not counted)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the name it was imported as (`from autofit.config import Loss as L`: L -> Loss)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                out[alias.asname or alias.name] = alias.name
    return out


def _config_like(node: ast.AST) -> bool:
    """Whether an attribute's receiver reads as a configuration (`config`, `run.config`, `self.config`)."""
    text = ast.unparse(node).rsplit(".", 1)[-1].lower()
    return text.endswith("config") or text in ("cfg", "old", "new")


@functools.lru_cache(maxsize=None)
def _read(tree: ast.AST) -> tuple[tuple[ast.AST, ...], dict[str, str], set[int]]:
    """A module's nodes, its import aliases and its docstrings, walked once however many techniques ask."""
    return tuple(ast.walk(tree)), _aliases(tree), _docstrings(tree)


def hits(tree: ast.AST, names: dict[str, tuple[str, ...]], stem: str, facts: tuple[str, ...] = ()) -> list[str]:
    """How a module (`tree`) names the technique `stem` described by `names`: one entry per kind of mention,
    with its line. `facts`: string literals that are a device's facts in this module (`DEVICE_FACTS`)."""
    nodes, aliases, docs = _read(tree)
    members = {tuple(m.split(".")) for m in names["members"]}
    knobs = {knob for knob, _ in members}
    module_names = {f"autofit.strategies.{s}" for s in (stem, *[p for p, owners in PART_OF.items() if stem in owners])}
    found: dict[str, int] = {}

    def note(what: str, node: ast.AST) -> None:
        found.setdefault(what, getattr(node, "lineno", 0))

    for node in nodes:
        if isinstance(node, ast.Attribute):
            receiver = aliases.get(node.value.id, node.value.id) if isinstance(node.value, ast.Name) else None
            if receiver in knobs and (receiver, node.attr) in members:
                note(f"{receiver}.{node.attr}", node)
            elif receiver in knobs:
                note(f"{receiver}.{node.attr}", node)
            elif node.attr in names["distinct"] or (node.attr in names["fields"] and _config_like(node.value)):
                note(f".{node.attr}", node)
        elif isinstance(node, ast.Name) and aliases.get(node.id) in knobs | set(names["classes"]) \
                and isinstance(node.ctx, ast.Load):
            note(aliases[node.id], node)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] in ("replace", "Config"):
            for keyword in node.keywords:
                if keyword.arg in names["fields"]:
                    note(f"{keyword.arg}=", node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in names["strings"] and node.value not in facts:
                note(repr(node.value), node)
            elif any(f"{m} " in node.value or node.value.startswith(f"{m}") for m in module_names):
                note(f"generated import of {stem}", node)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module in module_names or (module == "autofit.strategies" and any(
                    a.name in (stem, *names["classes"]) for a in node.names)):
                note(f"import from {module}", node)
    return [f"{what} (line {line})" for what, line in sorted(found.items(), key=lambda kv: kv[1])]


def survey() -> dict[str, dict[str, list[str]]]:
    """technique -> {file (relative to the repository) -> how it names the technique}."""
    out: dict[str, dict[str, list[str]]] = {}
    files = {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text()) for path in python_files()}
    for stem, names in NAMES.items():
        own = {f"autofit/strategies/{stem}.py"} | {f"autofit/strategies/{p}.py" for p, owners in PART_OF.items()
                                                    if stem in owners}
        named = {}
        for relative, tree in files.items():
            if relative in own or relative in EXCLUDED:
                continue
            found = hits(tree, names, stem, DEVICE_FACTS.get(relative, ()))
            if found:
                named[relative] = found
        out[stem] = named
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--max", type=int, default=None, help="exit 1 where a technique is named in more files")
    parser.add_argument("--brief", action="store_true", help="files only, not how each names the technique")
    options = parser.parse_args(argv)
    found = survey()
    over = {stem: len(files) for stem, files in found.items()
            if options.max is not None and stem not in STRUCTURAL and len(files) > options.max}
    if options.json:
        print(json.dumps({"techniques": found, "over": over}, indent=2))
    else:
        for stem, files in found.items():
            mark = " (structural)" if stem in STRUCTURAL else ""
            print(f"{stem}{mark}: {len(files)} file{'s' * (len(files) != 1)}")
            for relative, how in files.items():
                print(f"    {relative}" + ("" if options.brief else f": {', '.join(how)}"))
        if over:
            print(f"over {options.max}: " + ", ".join(f"{stem} ({n})" for stem, n in over.items()))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
