"""A technique written as a plug-in, the way a new rung is added: this one file (and its test).

Freezing the input embeddings trains something different (tier 2): their gradients and optimizer
states are never made. Nothing outside this file knows about it: every hook below is the one the
built-in strategies implement, and `SEEN` records each call so a test can tell which consumer ran it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from autofit.config import Config, Knob
from autofit.strategies.base import Option, Strategy

# (hook, what called it): "apply" with "probe" (a probe's or prepare's run), "simulated" (the estimator's step)
# or "live" (the OOM guard's model); "memory"; "setup_lines", "launcher_keys", "refuses" with the format
SEEN: list[tuple[str, str]] = []


class Frozen(Knob):
    """Whether the input embeddings train."""

    OFF = "off"  # the embeddings train (no change)
    ON = "on"  # frozen: no gradients or optimizer states for them


def freeze(model: nn.Module) -> nn.Module:
    """Freeze `model`'s input embeddings (what an exported script runs: `FreezeEmbeddings.setup_lines`)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.weight.requires_grad_(False)
    return model


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
            SEEN.append(("apply", "simulated" if run.simulated else "live" if run.live else "probe"))
            freeze(run.model)  # the same call on a meta model (simulated), a fresh one and a live one

    def memory(self, config, parts):
        if self.value(config) is Frozen.OFF:
            return parts
        import dataclasses

        SEEN.append(("memory", ""))
        return dataclasses.replace(parts, overhead=parts.overhead + 1)  # one byte: a mark the test can see

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        if self.value(config) is Frozen.OFF:
            return []
        SEEN.append(("setup_lines", fmt))
        return ["from freeze_embeddings import freeze", "freeze(model)  # input embeddings frozen, as probed"]

    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        if self.value(config) is Frozen.OFF:
            return {}
        SEEN.append(("launcher_keys", fmt))
        if fmt == "deepspeed":  # DeepSpeed's parser keeps unknown keys
            return {"autofit_plugins.freeze_embeddings": "on"}
        return {"AUTOFIT_FROZEN_EMBEDDINGS": "1"} if fmt == "torchrun" else {}  # accelerate's and the Trainer's
        # loaders reject keys they do not know: the lines above say it there

    def deepspeed_keys(self, config: Config, inputs: Any) -> dict[str, Any]:
        """Its sections of DeepSpeed's engine config (the ZeRO probe's and deepspeed.json's alike): frozen
        embeddings need none of the engine, but the hook is asked as the built-ins' are."""
        if self.value(config) is Frozen.ON:
            SEEN.append(("deepspeed_keys", ""))
        return {}

    def refuses(self, config: Config, fmt: str) -> str | None:
        if self.value(config) is Frozen.ON:
            SEEN.append(("refuses", fmt))
        return None
