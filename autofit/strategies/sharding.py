"""The base of rung 6's engines: ZeRO (DeepSpeed) and FSDP2 both offer values of the `sharding` knob.

Each engine offers the stages it has, is unavailable where it cannot run (and says why), and applies
only its own values. Sharding over one rank saves nothing by itself; on one GPU an engine serves the
offload rung (the rule table says so once). Over several nodes each engine also offers its hierarchical
values (`hierarchical`), which shard or gather within a node, beside sharding over every GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from autofit.config import Config, Engine, Sharding
from autofit.errors import UsageError
from autofit.strategies.base import Option, Placement, Strategy
from autofit.strategies.costs import summed, times
from autofit.strategies.run import cast_floating, cast_inputs

if TYPE_CHECKING:
    from autofit.job.train_spec import TrainSpec
    from autofit.strategies.costs import StepFacts
    from autofit.strategies.run import TrainRun

WHAT = {1: "optimizer states", 2: "gradients and optimizer states", 3: "parameters, gradients and optimizer states"}


class ShardingEngine(Strategy):
    """An engine's values of `sharding`; subclasses set `engine` and `offered` and build the engine."""

    field = "sharding"
    rung = 6
    engine: ClassVar[Engine]
    offered: ClassVar[tuple[Sharding, ...]]  # least sharded first
    hierarchical: ClassVar[tuple[Sharding, ...]] = ()  # offered over several nodes (`Target.nodes`)
    label: ClassVar[str]  # how the reason names the engine ("ZeRO", "FSDP2")

    def options(self, spec: "TrainSpec") -> list[Option]:
        why_not = self.unavailable_reason(spec)
        target = spec.target
        where = f"{target.count} ranks" + (f" on {target.nodes} nodes" if target.nodes > 1 else "")
        options = [Option(Sharding.NONE, 0, "no sharding")] + [
            Option(value, 0, why_not or f"{self.label} ({value.value}): {WHAT[value.stage]} sharded over {where}",
                   available=why_not is None) for value in self.offered]
        if target.nodes > 1:
            options += [Option(value, self.tier(value), why_not or self.across_nodes(value, target.nodes, target.per_node),
                               available=why_not is None) for value in self.hierarchical]
        return options

    def tier(self, value: Sharding) -> int:
        """The exactness tier of `value` (0: same math)."""
        return 0

    def across_nodes(self, value: Sharding, nodes: int, per_node: int) -> str:
        """The reason of hierarchical `value` over `nodes` nodes of `per_node` ranks (one line)."""
        return f"{self.label} ({value.value}): sharded within each node of {per_node}, across {nodes} nodes"

    def unavailable_reason(self, spec: "TrainSpec") -> str | None:
        """Why this engine cannot run for `spec`, or None."""
        if spec.target.count < 2 and not spec.target.cuda:
            return (f"sharding needs several ranks; num_gpus={spec.target.count} "
                    f"(on one GPU {self.label} serves the offload rung)")
        return None

    def saves_at_least(self, a: Config, b: Config) -> bool:
        """Any sharding saves at least what none does; within one engine, a higher stage saves more;
        across engines nothing is certain (their buffers differ). Hierarchical values (several nodes) hold
        more than sharding over every GPU at their stage (a node's share, or a second partition) and are
        otherwise unordered against the other stages."""
        if a.sharding is b.sharding or b.sharding is Sharding.NONE:
            return True
        if a.engine is not b.engine:
            return False
        if a.sharding.hierarchical:
            return False
        return a.sharding.stage >= b.sharding.stage

    def holds_alike(self, a: Config, b: Config) -> bool:
        return a.sharding is b.sharding

    def spread(self, config: Config) -> tuple[str, bool] | None:
        if not config.sharding.stage or not self.owns(config):
            return None
        return config.sharding.value, config.sharding.hierarchical

    def placement(self, config: Config) -> Placement:
        """Engines keep process-group state: their probes run in launched ranks."""
        return Placement.RANKS if config.engine is self.engine else Placement.IN_PROCESS

    def owns(self, config: Config) -> bool:
        """Whether `config` shards with this engine."""
        return config.engine is self.engine

    def runs_engine(self, config: Config) -> bool:
        return self.owns(config)

    def replays_training(self, config: Config) -> bool:
        """An engine's flat buffers and sharded states are not torch AdamW's replayed training."""
        return not self.owns(config)

    def collective_seconds(self, config: Config, step: "StepFacts") -> tuple[float, float] | None:
        """Over several ranks: the gradients' reduce-scatter and all-gather once per step over every rank,
        and with sharded parameters two all-gathers of the 16-bit weights (`step.weight_bytes`) in every
        micro-step, forward and backward, each charged to the slowest link it crosses."""
        if not self.owns(config):
            return None
        n, links = config.num_gpus, step.links
        if n < 2:
            return summed([])
        steps = [times(2, links.ring(n, step.grad_bytes, True))]
        if config.shards_parameters:
            steps.append(times(2 * config.grad_accum_steps, links.ring(n, step.weight_bytes, True)))
        return summed(steps)

    def shaped_elsewhere(self, run: "TrainRun") -> bool:
        """Shape a simulated or live `run` as this engine would, where it owns the config, and say whether
        that was all (True: no engine to build). Simulated: DeepSpeed's bf16/fp16 mode trains 16-bit weights
        and FSDP2's MixedPrecisionPolicy computes on 16-bit gathered weights, neither under autocast, with
        float inputs cast (as DeepSpeed's engine under autofit and `cast_forward_inputs` cast them); each rank
        holds a weight two modules share as two (`autofit.estimate.engines` adds its gradient). Live: the OOM
        guard runs plain torch or DDP steps."""
        if not (run.simulated or run.live):
            return False
        if not self.owns(run.config):
            return True
        if run.live:
            raise UsageError(f"The plan trains through {self.engine.value} ({run.config.describe()}); the OOM guard runs "
                             "plain torch or DDP steps. Train that plan with autofit.prepare (bash "
                             "launch/torchrun.sh), or tune again without sharding for the guard.")
        run.tie_weights = False
        if run.autocast_dtype is not None:
            cast_inputs(cast_floating(run.model, run.autocast_dtype), run.autocast_dtype)
            run.autocast_dtype, run.cast_whole = None, True
        return True

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        if not self.owns(config):
            return {}
        from autofit.strategies import compute_dtype

        half = {"weights16": True, "_cast_whole": True} if compute_dtype(config) is not None else {}
        return {"_untied": True, **half}
