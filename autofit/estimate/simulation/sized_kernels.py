"""Kernels whose memory fake tensors cannot size: what a recurrent layer keeps for its backward, which
torch's meta kernels leave out, an embedding bag's sparse gradient, and CTC's alpha table, sized by the data.

A training-mode `nn.LSTM` on the CPU runs one oneDNN primitive per layer and direction
(`aten.mkldnn_rnn_layer`, aten/src/ATen/native/mkldnn/RNN.cpp) and keeps its workspace for the backward:
every step's gates and the states around them, about 15 hidden-sized vectors per step and sample in fp32
where the output holds one. On CUDA, cuDNN (`aten._cudnn_rnn`, every mode) keeps a reserve space alike.
torch's meta kernels return both empty (torch/_meta_registrations.py: `mkldnn_rnn_layer`'s workspace is
`torch.empty(0)`; `_cudnn_rnn`'s reserve is `0 if train else 0`, "TODO: Query
cudnnGetRNNTrainingReserveSize"), so a simulated step left out most of an LSTM's activations: a 2-layer
LSTM classifier (hidden 128, 50 steps) was predicted at 7.6 MiB where its CPU probe peaked at 31.5 MiB at
micro-batch 32. `run` gives those outputs their size:

- **oneDNN** (`onednn_workspace`): seven parts, each rounded up to a 4 KiB page, their leading dimensions
  padded as oneDNN pads them (`get_good_ld`, src/cpu/rnn/rnn_utils.cpp: 64-byte multiples, then one more
  64 bytes where the length is a multiple of 256 elements). The parts and their element sizes were fitted
  to torch 2.13's kernel and agree with it to the byte on 40 random shapes in fp32 and bf16
  (tests/estimate/test_sized_kernels.py measures 24 random shapes again against the real kernel).
- **cuDNN** (`cudnn_reserve`): kept for backward with the output (tools/autograd/derivatives.yaml:
  `_cudnn_rnn_backward` takes `result0` and `result3`); not measured by this project (no GPU was lent
  for it). Per layer,
  direction, step and sample an LSTM keeps 6 hidden-sized vectors (4 gates, the cell, the hidden state)
  and a GRU 7, less one at the top layer, whose hidden states are the output: (6 x layers - 1) and
  (7 x layers - 1). Reconstructed from the one published reserve size found, a maintainer's
  `cudnnGetRNNTrainingReserveSize` on a P100 (pytorch/pytorch#2895: 736,000,000 bytes for a 4-layer LSTM
  and 864,000,000 for the same GRU; the issue's parameter counts give hidden 320, input 123, and the
  sizes 23 and 27 vectors for 25,000 step-samples): an assumption, stated as one. A plain tanh/ReLU RNN
  is taken at 2 per layer (its pre-activation and output), with no figure behind it. When CPU kernels
  stand in for CUDA, an LSTM's oneDNN call per layer is given cuDNN's share instead (its output, kept by
  the layer above, is the sixth vector); GRUs and plain RNNs run the CPU's composite cells there, which
  keep more than cuDNN would (an over-count, on the safe side).
- **EmbeddingBag's sparse gradient** (`aten._embedding_bag_backward` with `sparse=True`, an
  `nn.EmbeddingBag(sparse=True)`'s): torch's meta kernel returns a sparse tensor of no rows, so a
  recommendation model's gradient, the rows its batch looks up, was missing. `run` makes it as the kernel
  does: a row per index looked up (`_embedding_bag_sparse_grad`), and a copy of a sparse tensor (autograd
  keeps a sparse gradient as a copy) with the rows it copies.
- **CTC** (`aten._ctc_loss.Tensor`, what `F.ctc_loss` runs with tensor lengths): its outputs are sized by
  the longest target, a value fake tensors do not hold, so a simulation of a loss of one's own over CTC
  failed (`DynamicOutputShapeException`). The negative log-likelihood per sample and the alpha table
  (samples x frames x (2 x longest target + 1), in the log-probabilities' dtype, kept for backward:
  aten/src/ATen/native/LossCTC.cpp, `ctc_loss_cpu_template`; the CUDA kernel's is alike) are given the
  padded targets' width as the longest target, or for targets concatenated in one row their whole length:
  at most that, never less. Its kernels take fp32 and fp64 only (`AT_DISPATCH_FLOATING_TYPES` in
  LossCTC.cpp and cuda/LossCTC.cu); 16-bit log-probabilities are refused here as there.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten
PAGE = 4096  # oneDNN aligns each part of its workspace to a page (`set_offsets`)
_CUDNN_VECTORS = {0: 2, 1: 2, 2: 6, 3: 7}  # cudnnRNNMode_t (RNN_RELU, RNN_TANH, LSTM, GRU) -> per layer


def _good_ld(dim: int, itemsize: int) -> int:
    """oneDNN's leading dimension for `dim` elements of `itemsize` bytes (`rnn_utils::get_good_ld`)."""
    per_line = 64 // itemsize
    ld = -(-dim // per_line) * per_line
    return ld + per_line if ld % 256 == 0 else ld


def _page(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def onednn_workspace(steps: int, batch: int, input_size: int, hidden: int, itemsize: int) -> int:
    """Bytes of the workspace torch's oneDNN LSTM layer (`mkldnn_rnn_layer`, one layer and direction) keeps
    for backward, its input `itemsize` bytes an element: seven parts, fitted to the kernel's sizes (the
    gates of every step and per-step vectors in the input's dtype; per-state vectors in it and in fp32)."""
    wide = max(input_size, hidden)
    states = (steps + 1) * batch * 2
    parts = (steps * batch * _good_ld(4 * hidden, itemsize) * itemsize,  # the gates of every step
             steps * batch * _good_ld(hidden, itemsize) * itemsize,
             states * _good_ld(wide, itemsize) * itemsize,
             states * _good_ld(wide, 4) * 4,
             states * _good_ld(wide, 4) * 4,
             states * hidden * itemsize,
             states * hidden * 4)
    return sum(_page(part) for part in parts)


def cudnn_reserve(mode: int, layers: int, directions: int, step_samples: int, hidden: int, itemsize: int) -> int:
    """Bytes of cuDNN's training reserve for a stack of `layers` x `directions` recurrent layers of `mode`
    (cudnnRNNMode_t) over `step_samples` (steps x samples, or the packed batch sizes' sum): see the module."""
    return (_CUDNN_VECTORS[mode] * layers - 1) * directions * step_samples * hidden * itemsize


def run(func: Any, args: tuple, kwargs: dict | None, cuda: bool) -> Any:
    """Run `func` under fake tensors, the workspace of `mkldnn_rnn_layer` and the reserve of `_cudnn_rnn`
    given the size the kernel would allocate, and `_ctc_loss` with tensor lengths its outputs (the module's
    formulas). `cuda`: CPU kernels stand in for CUDA, and an LSTM layer's oneDNN call keeps what cuDNN keeps
    per layer instead. Called by the simulation's storage counter for every op (`simulate._Tracker`), which
    then counts what it returns as the op's own outputs: two identity checks per op, no mode of its own."""
    if func is aten._ctc_loss.Tensor:
        return _ctc_outputs(_arg(args, kwargs, 0, "log_probs"), _arg(args, kwargs, 1, "targets"))
    if func is aten._embedding_bag_backward.default and _arg(args, kwargs, 9, "sparse"):
        return _embedding_bag_sparse_grad(_arg(args, kwargs, 0, "grad"), _arg(args, kwargs, 1, "indices"),
                                          _arg(args, kwargs, 6, "num_weights"))
    if func is aten.clone.default and args[0].layout is torch.sparse_coo:  # as autograd keeps a sparse gradient
        return _sparse(args[0]._indices().clone(), args[0]._values().clone(), args[0].shape)
    out = func(*args, **(kwargs or {}))
    if func is aten.mkldnn_rnn_layer.default and _arg(args, kwargs, 15, "train"):
        return (*out[:3], _bytes(out[0], _onednn_size(args, kwargs, out[0], cuda)))
    if func is aten._cudnn_rnn.default and _arg(args, kwargs, 12, "train"):
        return (*out[:3], _bytes(out[0], _cudnn_size(args, kwargs, out[0])), *out[4:])
    return out


def _embedding_bag_sparse_grad(grad: torch.Tensor, indices: torch.Tensor, num_weights: int) -> torch.Tensor:
    """The sparse gradient of an `nn.EmbeddingBag(sparse=True)`'s weight: a row of the bags' gradient for each
    index looked up, uncoalesced (`_embedding_bag_sparse_backward`, then `embedding_sparse_backward`,
    aten/src/ATen/native/EmbeddingBag.cpp and Embedding.cpp: `grad.index_select(0, offset2bag)` as its
    values, the indices themselves, viewed, as its positions). Its meta kernel makes one of no rows."""
    dim = grad.shape[-1]
    values = torch.empty(indices.numel(), dim, dtype=grad.dtype, device=grad.device)  # padding rows counted too
    return _sparse(indices.reshape(1, -1), values, (num_weights, dim))


def _sparse(indices: torch.Tensor, values: torch.Tensor, size: Any) -> torch.Tensor:
    """An uncoalesced sparse COO tensor of these parts (torch's meta kernels make sparse tensors of no rows,
    a copy of one (`clone`, as autograd keeps a sparse gradient) too)."""
    return torch.sparse_coo_tensor(indices, values, size, is_coalesced=False, check_invariants=False)


def _bytes(like: torch.Tensor, nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device)


def _arg(args: tuple, kwargs: dict | None, index: int, name: str) -> Any:
    return args[index] if len(args) > index else (kwargs or {})[name]


def _onednn_size(args: tuple, kwargs: dict | None, output: torch.Tensor, cuda: bool) -> int:
    # torch hands the kernel its input time-major whatever `batch_first` says (aten/src/ATen/native/mkldnn/RNN.cpp
    # transposes it first), as the real kernel's calls show: (steps, samples, features)
    (steps, batch, features), hidden = _arg(args, kwargs, 0, "input").shape, _arg(args, kwargs, 10, "hidden_size")
    if cuda:  # cuDNN's share of one LSTM layer: 6 vectors, of which the output (counted) is one
        return (_CUDNN_VECTORS[2] - 1) * steps * batch * hidden * output.element_size()
    return onednn_workspace(steps, batch, features, hidden, output.element_size())


def _cudnn_size(args: tuple, kwargs: dict | None, output: torch.Tensor) -> int:
    mode, hidden = _arg(args, kwargs, 6, "mode"), _arg(args, kwargs, 7, "hidden_size")
    layers, bidirectional = _arg(args, kwargs, 9, "num_layers"), _arg(args, kwargs, 13, "bidirectional")
    step_samples = output.numel() // output.shape[-1]  # the packed rows, or steps x samples
    return cudnn_reserve(mode, layers, 2 if bidirectional else 1, step_samples, hidden, output.element_size())


def _ctc_outputs(log_probs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_ctc_loss`'s (negative log-likelihood, alpha table) for (frames, samples, classes) `log_probs`, the
    longest target taken at its bound (see the module)."""
    if log_probs.dtype not in (torch.float32, torch.float64):  # AT_DISPATCH_FLOATING_TYPES on both devices
        raise NotImplementedError(f'"ctc_loss" not implemented for {log_probs.dtype}: pass the log-probabilities '
                                  "to F.ctc_loss as float32 (`.float()`)")
    frames, samples = log_probs.shape[:2]
    longest = targets.shape[1] if targets.dim() == 2 else targets.shape[0]
    return log_probs.new_empty(samples), log_probs.new_empty(samples, frames, 2 * longest + 1)
