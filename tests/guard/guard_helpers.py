"""Tiny models, batches and reference loops shared by the OOM guard's tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autofit.devices.memory import CpuBudget

WIDTH = 16


class Net(nn.Module):
    """Three blocks (so activation checkpointing has something to wrap) and a head, on (B, L, WIDTH)."""

    def __init__(self, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(_block() for _ in range(depth))
        self.heavy = BackwardHeavy()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.heavy(x))


def _block() -> nn.Module:
    # Wider inside than at its edges, so checkpointing a block drops activations for real.
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH))


class _Heavy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, extra, forward_extra):
        ctx.extra = extra
        scratch = torch.ones(forward_extra * x.shape[0]) if forward_extra else None  # a forward that needs memory
        del scratch
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.ones(ctx.extra * grad.shape[0]) if ctx.extra else None  # a backward that needs memory
        del scratch
        return grad, None, None


class BackwardHeavy(nn.Module):
    """Identity whose backward (`extra`) or forward (`forward_extra`) allocates that many floats per
    sample for a moment: an OOM on demand, in the backward or in the forward."""

    def __init__(self):
        super().__init__()
        self.extra = 0
        self.forward_extra = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Heavy.apply(x, self.extra, self.forward_extra)


def loss_fn(output: torch.Tensor, batch) -> torch.Tensor:
    return F.mse_loss(output, batch[1])


def make_batch(step: int, size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, length, WIDTH, generator=gen), torch.randn(size, length, 1, generator=gen)


def fresh(seed: int = 0, lr: float = 1e-2):
    """The same model and AdamW every time (create it inside a budget to have it counted)."""
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def reference(batches, schedules, seed: int = 0) -> Net:
    """A bare loop: step i splits batches[i] into micro-batches of the sizes in schedules[i]."""
    model, optimizer = fresh(seed)
    for batch, sizes in zip(batches, schedules):
        total, start = batch[0].shape[0], 0
        for size in sizes:
            chunk = (batch[0][start:start + size], batch[1][start:start + size])
            (loss_fn(model(chunk[0]), chunk) * (size / total)).backward()
            start += size
        assert start == total
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def step_peak(micro_batch: int, length: int, total: int = 16) -> int:
    """Peak bytes of a bare step (model, AdamW states, gradients, activations) at this micro-batch."""
    batch = make_batch(0, total, length)
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        for _ in range(2):  # the second step runs with AdamW's states in place
            budget.reset_peak()
            for start in range(0, total, micro_batch):
                chunk = (batch[0][start:start + micro_batch], batch[1][start:start + micro_batch])
                (loss_fn(model(chunk[0]), chunk) * (micro_batch / total)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return budget.peak


def assert_same_weights(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")


SCRATCH = 100_000  # floats per sample: 8 samples' scratch (3.2 MB) dwarfs the tiny model's activations


def ddp_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int) -> None:
    """One rank of the 2-rank test: DDP over gloo under a CPU budget. Rank 1 runs out of memory in the
    forward of the second micro-batch of step 2, rank 0 in the backward of the second micro-batch of
    step 5 (after some gradients went in); after `steps` steps rank 0 raises a non-OOM error."""
    import datetime
    import gc
    import traceback

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from autofit.guard.core import OomGuard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    record = {"sizes": [], "recoveries": [], "error": None}
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        calls = []

        def on_forward(*_):
            calls.append(1)
            if rank == 1 and len(calls) == 6:  # step 2, second micro-batch, this rank only
                model.heavy.forward_extra = SCRATCH
                budget.limit = budget.peak + 6 * SCRATCH * 4
            if rank == 0 and len(calls) == 16:  # step 5, second micro-batch of 4: an OOM in the backward
                model.heavy.extra = SCRATCH
                budget.limit = budget.peak + 3 * SCRATCH * 4

        model.register_forward_pre_hook(on_forward)
        guard = OomGuard(DistributedDataParallel(model), optimizer, micro_batch_size=8, loss_fn=loss_fn)
        for step in range(steps):
            report = guard.step(make_batch(100 * rank + step, 16, 8))
            record["sizes"].append(report.micro_batches)
        record["recoveries"] = [r.reason for r in guard.recoveries]
        record["samples_seen"] = guard.samples_seen
        record["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        failing = fresh_loss_that_fails(rank)
        guard.loss_fn = failing
        try:
            guard.step(make_batch(100 * rank + steps, 16, 8))
        except Exception as exc:  # noqa: BLE001 - recorded for the test to inspect
            record["error"] = (type(exc).__name__, str(exc), traceback.format_exc())
    torch.save(record, f"{out_dir}/rank{rank}.pt")
    # DDP's reducer holds the process group: left to interpreter shutdown, gloo's worker threads are
    # torn down while Python finalizes and the rank can abort (SIGABRT, "terminate called without an
    # active exception"; pytorch/pytorch#179291). Drop it, then leave together.
    del guard, model, optimizer, budget
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def fresh_loss_that_fails(rank: int):
    def loss(output, batch):
        if rank == 0:
            raise ValueError("rank 0's labels are malformed")
        return loss_fn(output, batch)

    return loss


def reference_ranks(batches_per_step) -> Net:
    """What DDP computes: each step's gradient is the mean over ranks of each rank's mean gradient."""
    model, optimizer = fresh()
    for batches in batches_per_step:
        for batch in batches:
            (loss_fn(model(batch[0]), batch) / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def accelerate_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the 2-rank accelerate test: rank 1's third loader batch runs out of memory."""
    import os

    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from autofit.guard.accelerate import AccelerateGuard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    record = {"sizes": [], "recoveries": []}
    with CpuBudget(None) as budget:
        model, optimizer = fresh()
        prepared, optimizer, loader = accelerator.prepare(model, optimizer,
                                                          DataLoader(accelerate_data(), batch_size=8))
        guard = AccelerateGuard(accelerator, prepared, optimizer, loss_fn=loss_fn)
        for index, batch in enumerate(loader):
            if rank == 1 and index == 2:
                model.heavy.forward_extra = SCRATCH
                budget.limit = budget.peak + 6 * SCRATCH * 4
            with accelerator.accumulate(prepared):
                guard.backward(batch)
                optimizer.step()
                optimizer.zero_grad()
            record["sizes"].append(guard.last_report.micro_batches)
    record["recoveries"] = [r.reason for r in guard.recoveries]
    record["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(record, f"{out_dir}/accelerate{rank}.pt")
    accelerator.end_training()


def accelerate_data():
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(64, 8, WIDTH, generator=gen), torch.randn(64, 8, 1, generator=gen))


class TokenLM(nn.Module):
    """A tiny language model for the Trainer whose loss is a mean (no `num_items_in_batch`)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(2))
        self.out = nn.Linear(32, 64)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        logits = self.out(x)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


class TokenRecords(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def trainer_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of the 2-rank Trainer test: a plain Trainer run, then a GuardedTrainer run in which
    rank 1's forward needs more memory than is left from optimizer step 1 on."""
    import os

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from autofit.guard.trainer import GuardedTrainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)

    def args(name: str) -> TrainingArguments:
        return TrainingArguments(output_dir=f"{out_dir}/{name}{rank}", per_device_train_batch_size=8,
                                 gradient_accumulation_steps=2, max_steps=3, learning_rate=0.1, optim="sgd",
                                 max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no",
                                 logging_strategy="no", seed=0, ddp_backend="gloo", dataloader_num_workers=0)

    torch.manual_seed(0)
    reference = TokenLM()
    Trainer(model=reference, args=args("plain"), train_dataset=TokenRecords(96, 3)).train()
    torch.manual_seed(0)
    model, state = TokenLM(), {"on": False}

    def scratch(module, inputs, kwargs):
        if state["on"]:
            del_me = torch.ones(1_000_000 * kwargs["input_ids"].shape[0])
            del del_me

    model.register_forward_pre_hook(scratch, with_kwargs=True)

    class Squeeze(TrainerCallback):
        def on_step_begin(self, args, trainer_state, control, **kwargs):
            if rank == 1 and trainer_state.global_step == 1 and not state["on"]:
                state["on"] = True
                budget.limit = budget.current + 6_000_000 * 4  # 8 samples' scratch (32 MB) is over

    with CpuBudget(None) as budget:
        trainer = GuardedTrainer(model=model, args=args("guarded"), train_dataset=TokenRecords(96, 3),
                                 callbacks=[Squeeze()])
        trainer.train()
    guard = trainer.oom_guard
    torch.save({"recoveries": [r.reason for r in guard.recoveries], "config": guard.config.to_dict(),
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "reference": {k: v.detach().clone() for k, v in reference.state_dict().items()}},
               f"{out_dir}/trainer{rank}.pt")
