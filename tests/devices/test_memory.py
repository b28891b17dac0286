import gc

import pytest
import torch

from autofit.devices.memory import CpuBudget, DeadlinePassed


def test_counts_storages_and_frees_them():
    with CpuBudget(None) as budget:
        a = torch.zeros(1000)  # 4000 bytes
        view = a[10:20]  # shares a's storage: not counted again
        b = torch.ones(500, dtype=torch.float64)  # 4000 bytes
        assert budget.current == 8000
        del a, view, b
        gc.collect()
    assert budget.current == 0
    assert budget.peak == 8000


def test_parameters_and_optimizer_states_count():
    with CpuBudget(None) as budget:
        layer = torch.nn.Linear(100, 100)  # 40400 bytes of parameters
        assert budget.current == 40400
        optimizer = torch.optim.AdamW(layer.parameters())
        layer(torch.zeros(1, 100)).sum().backward()
        optimizer.step()  # exp_avg and exp_avg_sq: 2 x 40400 bytes, plus the gradients
        assert budget.current >= 4 * 40400


def test_a_sparse_gradient_counts_its_indices_and_values():
    """An `nn.EmbeddingBag(sparse=True)` trained with SGD: its gradient is a sparse tensor, whose parts hold
    its bytes (it has no storage of its own: counting it had raised out of every probe's backward)."""
    with CpuBudget(None) as budget:
        table = torch.nn.EmbeddingBag(1000, 8, sparse=True)  # 32000 bytes
        table(torch.tensor([[1, 2, 3], [4, 5, 6]])).sum().backward()
        values, indices = table.weight.grad._values(), table.weight.grad._indices()
        assert budget.current == 32000 + values.nbytes + indices.nbytes
        torch.optim.SGD(table.parameters(), lr=0.1).step()
    assert budget.peak >= 32000 + values.nbytes + indices.nbytes


def test_an_accumulated_sparse_gradient_counts_every_micro_batchs_rows():
    """Autograd accumulates a sparse gradient in place (`add_`), which gives it new, longer parts: they had gone
    uncounted (the parts read after the op took the ids of those that died in it), so a CPU probe's sparse
    gradient stayed at one micro-batch's rows whatever the accumulation."""
    table = torch.nn.EmbeddingBag(1000, 8, sparse=True)
    with CpuBudget(None) as budget:
        for _ in range(4):
            table(torch.randint(0, 1000, (2, 3))).sum().backward()
            grad = table.weight.grad
            assert budget.current >= grad._values().nbytes + grad._indices().nbytes
    assert grad._values().shape == (4 * 2 * 3, 8)  # concatenated, uncoalesced


def test_over_the_limit_raises_out_of_memory():
    with pytest.raises(torch.OutOfMemoryError, match="over the budget"):
        with CpuBudget(10_000):
            keep = [torch.zeros(1000) for _ in range(3)]  # noqa: F841


def test_oom_in_backward_propagates_with_its_type():
    x = torch.randn(200, 200, requires_grad=True)
    with pytest.raises(torch.OutOfMemoryError):
        with CpuBudget(3 * 160_000):
            w = torch.randn(200, 200, requires_grad=True)
            (x @ w @ w).sum().backward()


def test_deadline_stops_inside_a_step():
    with pytest.raises(DeadlinePassed):
        with CpuBudget(None) as budget:
            budget.deadline = 0.0  # already passed
            torch.zeros(3) + 1


def test_copying_a_module_made_outside_counts_only_the_copy():
    import copy

    layer = torch.nn.Linear(100, 100)  # 40400 bytes, made outside the budget
    with CpuBudget(None) as budget:
        clone = copy.deepcopy(layer)  # deepcopy detaches (a view of the original), then clones
        assert budget.current == 40400
        layer.weight.data.add_(1)  # in place on a tensor made outside: no new memory
        assert budget.current == 40400
    del clone


def test_timing_turns_the_bookkeeping_off_and_back_on():
    with CpuBudget(None) as budget:
        kept = torch.zeros(100)
        with budget.timing():
            scratch = torch.zeros(1000)  # not counted: the timed steps repeat counted warm-up steps
            assert budget.current == 400
        del kept
        gc.collect()
        assert budget.current == 0
        torch.zeros(10)
        assert budget.peak == 400
    del scratch
