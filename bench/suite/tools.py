"""The tools people use today, run for real on a scenario under the same memory budget.

- accelerate's `find_executable_batch_size`: retries the training function at 0.9x the batch on OOM.
- the Trainer's `auto_find_batch_size=True` (built on the same accelerate helper).
- Lightning's batch-size finder (`Tuner.scale_batch_size`, binsearch mode), when lightning is installed.
- DeepSpeed's autotuner: GPU-only (it launches CUDA jobs), recorded as not run on the CPU.

Each ends with a micro-batch (and the accumulation it trains with); whether that keeps the user's global
batch is recorded. All three recognise an out-of-memory error by its message, so on the CPU the budget
phrases its error as PyTorch's own CPU allocator does ("DefaultCPUAllocator: can't allocate memory");
autofit's budget message would not be recognised and each would simply crash. The model is built inside
the budget, so its parameters count, as they would on a card.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from autofit.batches.batch import call_model, leading_dim, take_rows, to_device
from autofit.config import Config
from autofit.devices.memory import CpuBudget, CudaBudget
from autofit.probe.oom import first_line, release_memory
from autofit.job.train_spec import TrainSpec

TOOL_STEPS = 5  # optimizer steps each tool trains at the size it settles on (the first 2 are warm-up)


class AllocatorWordedBudget(CpuBudget):
    """`CpuBudget` whose OOM reads like PyTorch's CPU allocator, so message-matching tools recognise it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except torch.OutOfMemoryError as exc:
            raise torch.OutOfMemoryError(f"DefaultCPUAllocator: can't allocate memory: {exc}") from None


def tool_budget(spec: TrainSpec) -> Any:
    """The budget the tools run under: the CUDA fraction (real CUDA OOMs), or the re-worded CPU budget."""
    if spec.device.type == "cuda":
        return CudaBudget(spec.memory_budget, spec.device)
    return AllocatorWordedBudget(spec.memory_budget)


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """What one tool ended with. Batch sizes in samples, throughput in samples/s, time in seconds."""

    tool: str
    status: str  # "ok" | "failed" | "not run"
    micro_batch_size: int | None = None
    grad_accum_steps: int | None = None
    samples_per_s: float | None = None  # as the tool's own run measured it (under the budget)
    wall_s: float | None = None  # the whole search, retries included
    tried: tuple[int, ...] = ()  # micro-batch sizes tried, in order
    note: str = ""

    @property
    def effective_batch(self) -> int | None:
        """Samples per optimizer step the tool trains with."""
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * (self.grad_accum_steps or 1)

    def keeps(self, global_batch: int) -> bool | None:
        """Whether the tool trains with the user's global batch."""
        return None if self.effective_batch is None else self.effective_batch == global_batch

    def config(self, base: Config) -> Config | None:
        """The configuration the tool trains with, in autofit's terms (no other rung touched)."""
        if self.status != "ok" or self.micro_batch_size is None:
            return None
        return base.replace(micro_batch_size=self.micro_batch_size, grad_accum_steps=self.grad_accum_steps or 1)

    def to_dict(self, global_batch: int) -> dict[str, Any]:
        """JSON form, with the effective batch and whether the global batch is kept."""
        data = dataclasses.asdict(self)
        data.update(effective_batch=self.effective_batch, keeps_global_batch=self.keeps(global_batch))
        return data


def _timed(tool: str, body: Callable[[list[int]], ToolOutcome]) -> ToolOutcome:
    tried: list[int] = []
    start = time.perf_counter()
    try:
        outcome = body(tried)
    except Exception as exc:  # noqa: BLE001 - a tool that crashes is a finding
        outcome = ToolOutcome(tool, "failed", note=f"{first_line(exc)} (raised in {_where(exc)})")
    release_memory()
    return dataclasses.replace(outcome, wall_s=time.perf_counter() - start, tried=tuple(tried))


def _where(exc: BaseException) -> str:
    """The innermost frame outside torch and this harness: the tool's code that was running."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if "/torch/" not in f.filename and "/bench/" not in f.filename] or frames
    frame = inside[-1]
    return f"{frame.name}, {'/'.join(Path(frame.filename).parts[-3:])}:{frame.lineno}"


# -- accelerate -------------------------------------------------------------------------------------------
def run_accelerate(spec: TrainSpec) -> ToolOutcome:
    """`find_executable_batch_size(starting_batch_size=global batch)` around a plain training loop,
    as in accelerate's examples: the batch it settles on is the batch trained (no accumulation)."""
    from accelerate.utils import find_executable_batch_size

    def body(tried: list[int]) -> ToolOutcome:
        def train(batch_size: int) -> float:
            tried.append(batch_size)
            return _plain_loop(spec, batch_size)

        with tool_budget(spec):
            speed = find_executable_batch_size(train, starting_batch_size=spec.global_batch_size)()
        return ToolOutcome("accelerate.find_executable_batch_size", "ok", tried[-1], 1, speed)

    return _timed("accelerate.find_executable_batch_size", body)


def _plain_loop(spec: TrainSpec, batch_size: int) -> float:
    """Build the model and AdamW, train TOOL_STEPS steps at `batch_size`; samples/s of the last steps."""
    model = spec.model_factory().to(spec.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = to_device(spec.batch_factory(batch_size), spec.device)
    times = []
    for _ in range(TOOL_STEPS):
        start = time.perf_counter()
        spec.loss_fn(call_model(model, batch), batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(spec.device)
        times.append(time.perf_counter() - start)
    return batch_size / statistics.mean(times[2:])


# -- transformers Trainer -------------------------------------------------------------------------------
class LossModule(nn.Module):
    """Wraps a model whose loss is computed outside it, so the Trainer sees `{"loss": ...}`."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.loss_fn(self.model(inputs), (inputs, targets))}


def _rows(spec: TrainSpec, n: int) -> list[dict[str, torch.Tensor]]:
    """`n` samples as dicts of tensors, the form Trainer and DataLoader collate."""
    batch = spec.batch_factory(n)
    rows = []
    for i in range(leading_dim(batch)):
        row = take_rows(batch, i, 1)
        if isinstance(row, dict):
            rows.append({k: v[0] for k, v in row.items()})
        else:
            rows.append({"inputs": row[0][0], "targets": row[1][0]})
    return rows


def _trainable(spec: TrainSpec) -> nn.Module:
    model = spec.model_factory()
    return model if spec.model.is_hf else LossModule(model, spec.loss_fn)


def run_trainer(spec: TrainSpec) -> ToolOutcome:
    """`Trainer.train()` with `auto_find_batch_size=True`, starting at the global batch, TOOL_STEPS steps."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Sizes(TrainerCallback):
        def __init__(self, tried: list[int]):
            self.tried = tried

        def on_train_begin(self, args, state, control, **kwargs):
            self.tried.append(state.train_batch_size)

    def body(tried: list[int]) -> ToolOutcome:
        rows = _rows(spec, 4 * spec.global_batch_size)
        with tempfile.TemporaryDirectory() as out, tool_budget(spec):
            args = TrainingArguments(output_dir=out, per_device_train_batch_size=spec.global_batch_size,
                                     auto_find_batch_size=True, max_steps=TOOL_STEPS, report_to=[],
                                     save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                     use_cpu=spec.device.type == "cpu", remove_unused_columns=False,
                                     dataloader_num_workers=0, optim="adamw_torch")
            trainer = Trainer(model=_trainable(spec), args=args, train_dataset=rows, callbacks=[Sizes(tried)])
            output = trainer.train()
            size, accum = trainer._train_batch_size, args.gradient_accumulation_steps
        speed = output.metrics.get("train_samples_per_second")
        return ToolOutcome("transformers.Trainer(auto_find_batch_size)", "ok", size, accum, speed,
                           note="samples/s from the Trainer's own metrics (includes its start-up)")

    return _timed("transformers.Trainer(auto_find_batch_size)", body)


# -- Lightning --------------------------------------------------------------------------------------------
def lightning_available() -> tuple[bool, str]:
    """Whether lightning imports, and why not."""
    if importlib.util.find_spec("lightning") is None:
        return False, "lightning is not installed (pip install lightning)"
    return True, ""


def run_lightning(spec: TrainSpec) -> ToolOutcome:
    """Lightning's `Tuner.scale_batch_size(mode="binsearch")` from batch 2; it grows the batch until an
    OOM, then bisects: the result is the largest batch that fits, whatever the user's global batch."""
    ok, why = lightning_available()
    if not ok:
        return ToolOutcome("lightning.Tuner.scale_batch_size", "not run", note=why)
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    class Module(L.LightningModule):
        def __init__(self, model: nn.Module, rows: list[dict[str, torch.Tensor]], tried: list[int]):
            super().__init__()
            self.model, self.rows, self.tried, self.batch_size = model, rows, tried, 2

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

        def train_dataloader(self):
            self.tried.append(self.batch_size)
            return torch.utils.data.DataLoader(self.rows, batch_size=self.batch_size, shuffle=False)

    def body(tried: list[int]) -> ToolOutcome:
        rows = _rows(spec, 16 * spec.global_batch_size)  # room to grow past the global batch
        with tempfile.TemporaryDirectory() as root, tool_budget(spec):
            trainer = L.Trainer(accelerator="gpu" if spec.device.type == "cuda" else "cpu", devices=1,
                                max_steps=TOOL_STEPS, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
            module = Module(_trainable_lightning(spec), rows, tried)
            size = Tuner(trainer).scale_batch_size(module, mode="binsearch", init_val=2, steps_per_trial=3,
                                                   max_val=len(rows))
        if not size:
            return ToolOutcome("lightning.Tuner.scale_batch_size", "failed", note="the finder returned no size")
        return ToolOutcome("lightning.Tuner.scale_batch_size", "ok", size, 1,
                           note="samples/s: re-measured by the harness (the finder reports none)")

    return _timed("lightning.Tuner.scale_batch_size", body)


class _KeywordLoss(nn.Module):
    """Calls a Hugging Face model with the batch's keywords, or a plain model through `LossModule`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = model

    def forward(self, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.inner(**batch)
        return {"loss": out["loss"] if isinstance(out, dict) or hasattr(out, "loss") else out}


def _trainable_lightning(spec: TrainSpec) -> nn.Module:
    return _KeywordLoss(_trainable(spec))


# -- DeepSpeed --------------------------------------------------------------------------------------------
def run_deepspeed_autotuner(spec: TrainSpec) -> ToolOutcome:
    """Not run: DeepSpeed's autotuner launches CUDA jobs through the deepspeed launcher."""
    if spec.device.type != "cuda":
        return ToolOutcome("deepspeed.autotuner", "not run", note="needs a GPU")
    return ToolOutcome("deepspeed.autotuner", "not run",
                       note="not automated in this harness yet (it needs a launcher script and a ds_config)")


def run_tools(spec: TrainSpec) -> list[ToolOutcome]:
    """Every tool on `spec`, one after another."""
    return [run_accelerate(spec), run_trainer(spec), run_lightning(spec), run_deepspeed_autotuner(spec)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
