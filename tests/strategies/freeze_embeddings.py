"""A technique written as a plug-in, the way a new rung is added: this one file (and its test).

Freezing the input embeddings trains something different (tier 2): their gradients and optimizer
states are never made. Nothing outside this file knows about it.
"""

from __future__ import annotations

from torch import nn

from autofit.config import Config, Knob
from autofit.strategies.base import Option, Strategy


class Frozen(Knob):
    """Whether the input embeddings train."""

    OFF = "off"  # the embeddings train (no change)
    ON = "on"  # frozen: no gradients or optimizer states for them


class FreezeEmbeddings(Strategy):
    """off, on."""

    field = "freeze_embeddings"
    rung = 7
    knob_type = Frozen

    def options(self, spec) -> list[Option]:
        return [Option(Frozen.OFF, 0, "embeddings train"),
                Option(Frozen.ON, 2, "input embeddings frozen: no gradients or optimizer states for them")]

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return self.value(a) is Frozen.ON or self.value(b) is Frozen.OFF

    def apply(self, run) -> None:
        if self.value(run.config) is Frozen.ON:
            for module in run.model.modules():
                if isinstance(module, nn.Embedding):
                    module.weight.requires_grad_(False)

    def memory(self, config, parts):
        if self.value(config) is Frozen.OFF:
            return parts
        import dataclasses

        return dataclasses.replace(parts, overhead=parts.overhead + 1)  # one byte: a mark the test can see

    def launcher_keys(self, config: Config, fmt: str) -> dict:
        on = self.value(config) is Frozen.ON and fmt == "deepspeed"  # DeepSpeed's parser keeps unknown keys
        return {"autofit_plugins.freeze_embeddings": "on"} if on else {}
