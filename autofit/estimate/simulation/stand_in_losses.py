"""Stand-ins for Hugging Face losses whose shapes depend on the data, which fake tensors hold none of: the
memory the loss keeps and passes through, without its data-dependent steps (`stand_in`).

- **CTC heads** (wav2vec2, HuBERT) compute the loss over `labels.masked_select(...)` and tensor lengths:
  the stand-in is the fp32 log-softmax of the logits, which `ctc_loss` keeps for backward and the size
  of the gradient it returns (its alpha table, batch x frames x (2 x characters + 1) fp32, under 1 MB per
  sample for 10 s of audio, is left out).
- **Object detectors** (DETR, YOLOS) match predictions to targets with scipy on the host first: the
  classification's fp32 log-softmax over every query and a gradient for every predicted box; the box
  losses over the matched pairs (a few floats per object) are left out.
- **Mask2Former** (`ForUniversalSegmentation`) matches too, then supervises every decoder layer with
  point-sampled mask losses (transformers' `Mask2FormerLoss`): `_mask_layer`. MaskFormer's loss
  upsamples every matched mask to the image instead, which this stand-in would not count: it is left to
  the real loss (its simulation fails, and the dry-run says so).

The label fields are dropped from the batch the model is called with (the model then computes no loss);
the simulation still counts their bytes, live through the step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

MASK_LABELS = ("mask_labels", "class_labels")


def stand_in(model: nn.Module, batch: Any) -> tuple[Any, Callable[[Any, Any], torch.Tensor]] | None:
    """(the batch less the label fields, the stand-in loss) for a head whose loss has data-dependent shapes
    and whose label fields `batch` holds; None for any other."""
    name = type(model).__name__
    keys, loss = next((found for suffix, found in LOSSES.items() if name.endswith(suffix)), ((), None))
    if loss is None or not isinstance(batch, dict) or not all(key in batch for key in keys):
        return None
    if keys == MASK_LABELS:
        model.config.output_auxiliary_logits = True  # every decoder layer's predictions, as its loss supervises
        loss = functools.partial(loss, masks=_MaskTargets.of(batch["mask_labels"], model.config))
    return {k: v for k, v in batch.items() if k not in keys}, loss


def ctc(output: Any, batch: Any) -> torch.Tensor:
    return torch.log_softmax(output.logits, dim=-1, dtype=torch.float32).mean()


def detection(output: Any, batch: Any) -> torch.Tensor:
    return torch.log_softmax(output.logits, dim=-1, dtype=torch.float32).mean() + output.pred_boxes.float().mean()


class _MaskTargets:
    """What Mask2Former's loss reads of the targets: the most objects an image holds, their masks' size,
    and the points it samples (`train_num_points`, `oversample_ratio`)."""

    def __init__(self, objects: int, size: tuple[int, ...], points: int, oversampled: int):
        self.objects, self.size, self.points, self.oversampled = objects, size, points, oversampled

    @classmethod
    def of(cls, mask_labels: list[torch.Tensor], config: Any) -> "_MaskTargets":
        points = int(getattr(config, "train_num_points", 12544))
        return cls(max(len(masks) for masks in mask_labels), tuple(mask_labels[0].shape[1:]), points,
                   int(points * getattr(config, "oversample_ratio", 3.0)))


def mask2former(output: Any, batch: Any, masks: _MaskTargets) -> torch.Tensor:
    """Mask2Former's loss, as memory: `_mask_layer` for the last decoder layer and each auxiliary one."""
    auxiliary = output.auxiliary_logits or ()
    layers = [(output.class_queries_logits, output.masks_queries_logits),
              *((layer["class_queries_logits"], layer["masks_queries_logits"]) for layer in auxiliary)]
    return sum(_mask_layer(classes, predicted, masks) for classes, predicted in layers)


def _mask_layer(classes: torch.Tensor, predicted: torch.Tensor, masks: _MaskTargets) -> torch.Tensor:
    """One decoder layer's loss (`Mask2FormerLoss`: `Mask2FormerHungarianMatcher`, `loss_labels`, `loss_masks`)
    as memory. Under no_grad and gone after: the matcher's point samples of every query, image by image
    (its (queries x points) logits and the costs drawn from them); the targets padded to the most objects
    and the matched ones picked out, at the image's resolution; the oversampled points the uncertainty
    picks from. Kept for backward: the classification's fp32 log-softmax; the matched queries' masks, which
    `grid_sample` keeps with its grid, in fp32 even under autocast (its inputs are promoted to the widest
    dtype, the fp32 points: `AT_FORALL_PROMOTE`, aten/src/ATen/autocast_mode.h); the sampled logits and
    labels the sigmoid cross-entropy and
    dice losses keep. The matching pairs as many queries as the image holds objects, at most every query."""
    samples, queries = predicted.shape[:2]
    per_image = min(masks.objects, queries)
    matched = samples * per_image
    fp32 = dict(device=predicted.device, dtype=torch.float32)
    with torch.no_grad():
        for _ in range(samples):  # the matcher, one image at a time
            costs = [torch.empty(queries, masks.points, **fp32) for _ in range(4)]
            del costs
        padded = torch.zeros(samples, masks.objects, *masks.size, **fp32)
        targets = padded[:, :per_image].flatten(0, 1).clone()  # the matched ones
        del padded
        oversampled = [torch.empty(matched, masks.oversampled, 2, **fp32),  # points, their logits, uncertainties
                       *(torch.empty(matched, 1, masks.oversampled, **fp32) for _ in range(2))]
        del oversampled
        grid = torch.rand(matched, 1, masks.points, 2, **fp32) * 2 - 1
        labels = torch.rand(matched, masks.points, **fp32)
    picked = predicted[:, :per_image].flatten(0, 1)[:, None]
    logits = F.grid_sample(picked.float(), grid, align_corners=False).flatten(1)
    probabilities = logits.sigmoid()
    loss = torch.log_softmax(classes, dim=-1, dtype=torch.float32).mean() \
        + F.binary_cross_entropy_with_logits(logits, labels) + (probabilities * labels).sum() / probabilities.sum()
    del targets  # held until the layer's mask losses are computed (`loss_masks`: `del target_masks`)
    return loss


# Heads whose loss has shapes that depend on the data, by class-name suffix: (their label fields, the stand-in)
LOSSES = {"ForCTC": (("labels",), ctc), "ForObjectDetection": (("labels",), detection),
          "ForUniversalSegmentation": (MASK_LABELS, mask2former)}
