"""The batch factories a synthesized batch is made by (`autofit.batches.synthetic`): `make_batch(n)` objects
that build `n` samples of random fields, seeded, so every size probed gets the same values at the
same positions. Frozen dataclasses, so child probes receive them by pickling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autofit.batches.batch import BatchFactory


@dataclasses.dataclass(frozen=True)
class Field:
    """One tensor of a synthesized batch: its name, its shape per sample, and its values (`high` > 0:
    integers in [low, high), token ids or labels; 0: standard normal floats, pixels or features)."""

    name: str
    shape: tuple[int, ...]
    high: int = 0
    low: int = 0
    end: int | None = None  # the id each sample's last position holds and no other does (an `<eos>`)

    def make(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """The field's tensor for `n` samples."""
        shape = (n, *self.shape)
        if not self.high:
            return torch.randn(shape, generator=gen)
        if self.end is None:
            return torch.randint(self.low, self.high, shape, generator=gen)
        values = _ids_without(self.end, self.low, self.high, shape, gen)
        values[..., -1] = self.end
        return values


def _ids_without(skipped: int, low: int, high: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random ids in [low, high) that are never `skipped` (an `<eos>`, an image's placeholder)."""
    ids = torch.randint(low, high - 1, shape, generator=gen)
    return ids + (ids >= skipped).long()


@dataclasses.dataclass(frozen=True)
class SyntheticBatches:
    """make_batch(n): the fields' tensors with a leading axis of n samples, plus fixed keyword
    arguments (`extras`, such as CLIP's return_loss=True). Picklable, so child probes rebuild it."""

    fields: tuple[Field, ...]
    extras: tuple[tuple[str, Any], ...] = ()

    def __call__(self, n: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(0)
        batch: dict[str, Any] = {}
        for f in self.fields:
            batch[f.name] = f.make(n, gen)
        batch.update(self.extras)
        return batch


@dataclasses.dataclass(frozen=True)
class VisionLanguageBatches:
    """make_batch(n) for a vision-language model: an image's `image_tokens` placeholders (`image_token`)
    then random text ids (never the placeholder), labels on the text (-100 on the image: no loss there),
    the image's pixel values, and `token_type_ids` where the model takes them (0 on the image, 1 on the
    text: PaliGemma's and Gemma 3's training masks)."""

    pixels: Field
    image_token: int
    image_tokens: int
    length: int
    vocab: int
    token_types: bool = False

    def __call__(self, n: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(0)
        text = _ids_without(self.image_token, 0, self.vocab, (n, self.length - self.image_tokens), gen)
        image = torch.full((n, self.image_tokens), self.image_token)
        batch = {"input_ids": torch.cat([image, text], dim=1),
                 "labels": torch.cat([torch.full_like(image, -100), text], dim=1),
                 self.pixels.name: torch.randn((n, *self.pixels.shape), generator=gen)}
        if self.token_types:
            batch["token_type_ids"] = torch.cat([torch.zeros_like(image), torch.ones_like(text)], dim=1)
        return batch


@dataclasses.dataclass(frozen=True)
class PackedImageBatches:
    """make_batch(n) for a vision-language model that packs its images' patches over the samples (Qwen2-VL
    and its kin: `autofit.batches.batch.PACKED`): one image a sample of `grid` (frames, height, width in
    patches), its `image_tokens` placeholders first (a placeholder per `merge` patches) then random text,
    labels on the text; the patches (`patch_values` each) packed in `pixel_values`, a grid row per image in
    `image_grid_thw`, and `mm_token_type_ids` 1 on the image, as the model's processor makes them."""

    image_token: int
    grid: tuple[int, int, int]
    merge: int
    patch_values: int
    length: int
    vocab: int

    @property
    def patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def image_tokens(self) -> int:
        return self.patches // self.merge

    def __call__(self, n: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(0)
        text = _ids_without(self.image_token, 0, self.vocab, (n, self.length - self.image_tokens), gen)
        image = torch.full((n, self.image_tokens), self.image_token)
        return {"input_ids": torch.cat([image, text], dim=1),
                "labels": torch.cat([torch.full_like(image, -100), text], dim=1),
                "mm_token_type_ids": torch.cat([torch.ones_like(image), torch.zeros_like(text)], dim=1),
                "pixel_values": torch.randn((n * self.patches, self.patch_values), generator=gen),
                "image_grid_thw": torch.tensor([self.grid] * n)}


@dataclasses.dataclass(frozen=True)
class WithPixels:
    """make_batch(n): `text`'s batch of n samples with their images' `pixels` (`_document`)."""

    text: BatchFactory
    pixels: Field

    def __call__(self, n: int) -> dict[str, Any]:
        return {**self.text(n), self.pixels.name: torch.randn((n, *self.pixels.shape),
                                                              generator=torch.Generator().manual_seed(1))}


OBJECTS_PER_IMAGE = 8  # COCO's images hold 7.3 annotated objects on average (its 2017 train split)


@dataclasses.dataclass(frozen=True)
class _ObjectBatches:
    """make_batch(n) for models trained on objects in images: pixel values and, per image, `objects` targets
    of `classes` classes (`_targets`)."""

    pixels: Field
    classes: int
    objects: int = OBJECTS_PER_IMAGE

    def __call__(self, n: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(0)
        pixels = torch.randn((n, *self.pixels.shape), generator=gen)
        return {self.pixels.name: pixels, **self._targets(n, gen)}

    def _targets(self, n: int, gen: torch.Generator) -> dict[str, list]:
        raise NotImplementedError


class DetectionBatches(_ObjectBatches):
    """Object detectors (DETR, YOLOS, RT-DETR, ...): targets as transformers' detection losses take them,
    `labels`, a list of one dict per image of `class_labels` and `boxes` (centre x, centre y, width,
    height, relative to the image)."""

    def _targets(self, n: int, gen: torch.Generator) -> dict[str, list]:
        return {"labels": [{"class_labels": torch.randint(0, self.classes, (self.objects,), generator=gen),
                            "boxes": 0.25 + 0.5 * torch.rand(self.objects, 4, generator=gen)} for _ in range(n)]}


class MaskBatches(_ObjectBatches):
    """Mask segmenters (Mask2Former, MaskFormer): per image, the `mask_labels` (objects x height x width,
    binary) and `class_labels` (objects) their losses take."""

    def _targets(self, n: int, gen: torch.Generator) -> dict[str, list]:
        masks = [(torch.rand(self.objects, *self.pixels.shape[1:], generator=gen) > 0.5).float() for _ in range(n)]
        return {"mask_labels": masks, "class_labels": [torch.randint(0, self.classes, (self.objects,), generator=gen)
                                                       for _ in range(n)]}


@dataclasses.dataclass(frozen=True)
class TokenBatches:
    """make_batch(n) for causal language models: random token ids, labels equal to the inputs."""

    vocab_size: int
    seq_len: int

    def __call__(self, n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab_size, (n, self.seq_len), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids.clone()}
