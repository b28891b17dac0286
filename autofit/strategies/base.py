"""The strategy contract: one technique of the decision tree, one small class.

A strategy owns one knob of `Config` (`field`). It says which values it offers for a spec and its
`Target` (cheapest first; unavailable ones with the reason), how two configs compare in the memory its
knob saves (so the search can skip candidates certain to fail), and where a probe using its value must
run (in process, a child process, launched ranks). Everything a technique does beyond choosing goes
through the hooks below, which the probe, the estimator's simulation, `autofit.prepare`, the OOM guard and
every exporter loop over without naming a technique:

- `apply(run)`: the one model transform. `build_run` calls it for a probe, `autofit.prepare` for a user's
  loop, the estimator for its simulated step (`run.simulated`: a meta model, stand-ins where the real
  layer cannot run on fake tensors), and the OOM guard for a live model (`run.live`: what cannot change
  in place is checked instead). `simulated_as(config, facts)` says what of its value the simulated step
  depends on (the simulation's cache key).
- `memory(config, parts)`: what its value does to a prediction beyond the estimator's formulas (the joint
  model-states formulas of `autofit.estimate.states` cover the built-in knobs they combine).
- `launcher_keys(config, fmt)`, `setup_lines(config, fmt)`, `refuses(config, fmt)`: the keys it writes into
  each launcher format, the Python lines an exported script runs on `model`, and why a format cannot say
  its value (naming the knob and the format that can). `recorded(settings, summary)` rebuilds it as a
  saved plan recorded it (`settings`) for the exports and `prepare`. `deepspeed_keys(config, inputs)`: its
  sections of DeepSpeed's config (`autofit.strategies.deepspeed_config` assembles them for the ZeRO probe,
  the estimator's buffers and every export alike; `EngineInputs` carries what is not on `Config`), and
  `launcher_files(config, fmt, strategies)`: the engine's own files a format writes (deepspeed.json).
- `compute_dtype(config)`: the 16-bit dtype its value makes the forward compute in, which the search reads
  an error naming that dtype against.
- `recomputes(config)`, `activation_knobs`: the share of the forward its value runs again in backward (the
  dry-run's step time), and the fields whose values change activation memory only (the walk's comparisons).
- the dry-run's step time, which `autofit.estimate.cost_model` combines over the strategies with the step's
  figures as a record (`autofit.strategies.costs.StepFacts`): `trains`, `extra_flops`, `compute_slowdown`,
  `half_gradients`, `collective_seconds`, `offload_seconds`, `host_ops`, `step_ops`.
- the estimator's other terms: `engine_memory` (an engine's bytes by phase), `recomputed_blocks` and
  `fuses_attention` (the activation formula), `adapted_layers` and `adapter_dropout` (the simulated
  adapters), `runs_engine` (the engines' error bound), `replays_training` and `resident_bytes` (the
  allocator replay). Each defaults to "nothing": a technique implements the ones its value changes.
- `rules()`: the combinations with its values that cannot run, and why (`Rule`s, which
  `autofit.search.rules` checks with the joint ones where the space is built).
- What the search, the plan, the dry-run, `prepare` and the guard ask of every strategy (no-ops by default):
  `replaces`, `adapting`, `writing_to`, `not_installed`, `host_room`, `observed`, `accumulation_kwargs`,
  `running_differs`, `holds_alike`, `spread` (each docstring says who asks; docs/new-rungs.md lists them).

Several strategies may offer values of one knob (ZeRO and FSDP2 both offer `sharding`): each applies only
the values it offers. A strategy outside autofit's own adds its knob by declaring `knob_type` (a `Knob`
enum whose first member is the no-op): it is registered on `Config` and in `plugins()`, so the search,
the dry-run, the exports, `prepare`, the guard and the report handle it with no edit elsewhere.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import re
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

from autofit.config import Config, Knob, register_knob

if TYPE_CHECKING:
    import torch

    from autofit.strategies.costs import StepFacts
    from autofit.strategies.memory import Breakdown, EngineFacts, EngineMemory
    from autofit.strategies.run import TrainRun
    from autofit.job.target import Target
    from autofit.job.train_spec import TrainSpec


class Placement(enum.IntEnum):
    """Where a probe must run; a config runs where its most demanding knob says."""

    IN_PROCESS = 0  # the caller's process
    CHILD = 1  # a child process: the knob touches process-global state (bitsandbytes paging, kernels)
    RANKS = 2  # launched ranks with a process group: an engine (DeepSpeed, FSDP2) or several ranks


@dataclasses.dataclass(frozen=True)
class EngineInputs:
    """What an engine's config needs beyond `Config` (`Strategy.deepspeed_keys`): the same for the probe that
    trains with it and the exports that write it."""

    nvme_path: str | None = None  # folder on a fast local disk for NVMe offload; None where none was given
    hyperparameters: dict[str, Any] | None = None  # the optimizer's (lr, betas, eps, ...); None: a plan's or defaults


@dataclasses.dataclass(frozen=True)
class Option:
    """One value a strategy offers: its exactness tier, and a one-line reason (why offered, or why not)."""

    value: Any  # the value of the strategy's field
    tier: int  # 0 same math, 1 standard numerics change, 2 trains something different (opt-in)
    reason: str
    available: bool = True
    also: tuple[tuple[str, Any], ...] = ()  # other fields this value sets (checkpointing's frequency)
    # How far it moves the arithmetic, which orders numerics changes (`Space.degree`): within tier 1, 1 where
    # only the compute precision changes (autocast), 2 where the update itself does (weights' or optimizer
    # states' precision, another optimizer); None: its tier.
    degree: int | None = None

    @property
    def change(self) -> int:
        """`degree`, or the tier where none is given."""
        return self.tier if self.degree is None else self.degree

    def knobs(self, field: str) -> dict[str, Any]:
        """Every Config field this option sets, as `Config.replace` takes them."""
        return {field: self.value, **dict(self.also)}


_PLUGINS: list[type["Strategy"]] = []


@dataclasses.dataclass(frozen=True)
class Rule:
    """A combination that cannot run: `check(config, target)` returns why, or None when it can
    (`autofit.search.rules`)."""

    name: str
    knobs: tuple[str, ...]  # the fields the rule reads
    check: Callable[[Config, "Target"], str | None]


class Strategy(abc.ABC):
    """One technique. Subclasses set `field` and `rung` and implement `options` and `apply`."""

    field: ClassVar[str]  # the Config knob this strategy sets
    rung: ClassVar[int]  # position in docs/design.md's decision tree (cheapest first)
    order: ClassVar[int]  # a built-in's place among its rung's (`autofit.strategies.BUILT_IN`); a plug-in has none
    # the Config fields it sets whose values change activation memory only: the walk sets them alike to
    # compare what two configs hold where no activation is live
    activation_knobs: ClassVar[tuple[str, ...]] = ()
    knob_type: ClassVar[type[Knob] | None] = None  # a plug-in strategy's own knob (its first member: off)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("knob_type") is not None:
            register_knob(cls.field, cls.knob_type, next(iter(cls.knob_type)))
            _PLUGINS.append(cls)

    @classmethod
    def required(cls) -> "Strategy | None":
        """The instance every run needs where no strategy given sets this knob (`autofit.strategies.with_required`:
        the micro-batch's, the rank count's, the optimizer's offering the user's optimizer alone), or None."""
        return None

    def recomputes(self, config: Config) -> float:
        """The share (0..1) of the forward's matmul FLOPs `config`'s value runs again in backward (the dry-run's
        step time, `autofit.estimate.cost_model`); 0 by default."""
        return 0.0

    def rules(self) -> tuple[Rule, ...]:
        """The combinations with this knob's values that cannot run (none by default): `autofit.search.rules`
        checks them beside the joint ones, each once where the search space is built."""
        return ()

    @abc.abstractmethod
    def options(self, spec: "TrainSpec") -> list[Option]:
        """Every value for `spec` and its target, cheapest first; unavailable ones carry the reason."""

    @abc.abstractmethod
    def apply(self, run: "TrainRun") -> None:
        """Make `run` train with `run.config`'s value of this knob (called in rung order, before the
        optimizer exists); values another strategy offers are left to it. The same call shapes a probe's
        run, `autofit.prepare`'s, the estimator's simulated step (`run.simulated`: `run.model` is on the
        meta device and becomes fake tensors afterwards; see `autofit.strategies.run.SimulatedRun`) and the
        OOM guard's live model (`run.live`: its optimizer exists, `run.optimizer`; a value that cannot be
        applied in place is checked, raising `UsageError` with the fix where the model does not run it)."""

    def value(self, config: Config) -> Any:
        """This strategy's knob in `config`."""
        return config.knob(self.field)

    def saves_at_least(self, a: Config, b: Config) -> bool:
        """Whether config `a`'s value of this knob needs no more memory than `b`'s, all else equal."""
        return self.value(a) == self.value(b)

    def placement(self, config: Config) -> Placement:
        """Where a probe of `config` must run as far as this knob is concerned."""
        return Placement.IN_PROCESS

    def memory(self, config: Config, parts: "Breakdown") -> "Breakdown":
        """The predicted bytes per device with this knob's effect beyond the estimator's own formulas
        (the simulated step, and the joint model-states formulas of `autofit.estimate.states`, which cover
        the built-in knobs they combine); a plug-in technique says here what it does to memory."""
        return parts

    # -- the dry-run's step time: `autofit.estimate.cost_model` combines these over `completed()` strategies
    def trains(self, config: Config, facts: Any) -> tuple[int, int] | None:
        """(parameters, tensors) that train under `config`'s value instead of the model's own trainable ones,
        its base frozen (no weight gradients: 4 FLOPs per parameter and position, not 6; LoRA's adapters), from
        `facts` (`autofit.estimate.facts.ModelFacts`); None where it trains the model's own (the default)."""
        return None

    def extra_flops(self, config: Config, step: "StepFacts") -> float:
        """FLOPs per sample `config`'s value adds to each micro-step beyond the forward, the backward and
        recomputation (`recomputes`): a chunked loss runs the head's forward again. 0 by default."""
        return 0.0

    def compute_slowdown(self, config: Config) -> float:
        """How much slower `config`'s value makes the step's arithmetic (1.0 by default; NF4 base weights
        are dequantized in every matmul)."""
        return 1.0

    def half_gradients(self, config: Config) -> bool:
        """Whether `config`'s value makes the gradients the step reduces 16-bit under a 16-bit compute dtype
        (weights trained in 16 bits: pure bf16, DeepSpeed's bf16/fp16 mode); False by default."""
        return False

    def collective_seconds(self, config: Config, step: "StepFacts") -> tuple[float, float] | None:
        """(within-node, across-node) seconds of one optimizer step's collectives where `config`'s value runs
        them (a sharding engine's reduce-scatters and gathers over `step.links`); None where it does not (the
        default: the cost model charges data parallelism's all-reduce of the gradients)."""
        return None

    def offload_seconds(self, config: Config, step: "StepFacts") -> float:
        """Seconds per optimizer step `config`'s value spends moving model states over PCIe and stepping
        them on the host; 0 by default."""
        return 0.0

    def host_ops(self, config: Config, step: "StepFacts") -> int:
        """Operations the host issues per micro-step for `config`'s value beside the model's simulated
        kernels (a sharding engine's per-parameter or per-unit work; the host's floor of the step time); 0 by
        default."""
        return 0

    def step_ops(self, config: Config, step: "StepFacts") -> int:
        """Operations the host issues for one optimizer step under `config`'s value (the optimizer's); 0 by
        default."""
        return 0

    # -- the estimator's memory beyond the simulated step and the state formulas ---------------------------
    def engine_memory(self, config: Config, engine: "EngineFacts") -> "EngineMemory | None":
        """What the engine `config`'s value trains through holds beyond the model states, by phase (DeepSpeed's
        buffers, ZeRO-3's gathered weights, a tied weight's gradient kept through a checkpointed backward),
        from `engine` (`autofit.strategies.memory.EngineFacts`); None where its value runs no engine (the
        default: `autofit.estimate.engines` counts plain torch and DDP)."""
        return None

    def recomputed_blocks(self, config: Config) -> float:
        """The share (0..1) of the blocks whose activations `config`'s value recomputes in the backward,
        wholly or op by op, each keeping only its input (the activation formula; an engine's tied gradient);
        0 by default. Unlike `recomputes`, op-level recomputation counts."""
        return 0.0

    def fuses_attention(self, config: Config) -> bool:
        """Whether `config`'s value runs a fused attention kernel, which keeps no sequence x sequence matrix
        (the activation formula); False by default."""
        return False

    def adapted_layers(self, model: "torch.nn.Module") -> list[str] | None:
        """Full names of the layers of `model` (a meta build) this strategy trains adapters on, which the
        simulated step adds and the model's facts count (LoRA's targets); None where it adds none (the default)."""
        return None

    def adapter_dropout(self) -> float | None:
        """The dropout probability on the input of the adapters this strategy adds (`adapted_layers`); None
        where it adds none (the default)."""
        return None

    # -- the estimator's trust in its prediction, and the allocator's replay ----------------------------
    def runs_engine(self, config: Config) -> bool:
        """Whether `config`'s value trains through an engine of its own (DeepSpeed, FSDP2): 16-bit weights
        without autocast's copies, buffers of its own, and the wider error bound calibrated for engines
        (`autofit.estimate.tolerance`). False by default."""
        return False

    def replays_training(self, config: Config) -> bool:
        """Whether the estimator's allocator replay of training around the simulated step (the weights, torch
        AdamW's states and step on the card, every micro-step) holds under `config`'s value; True by default
        (an engine's flat buffers, offloaded, 8-bit or in-backward states do not)."""
        return True

    def resident_bytes(self, module: "torch.nn.Module") -> int | None:
        """Bytes of `module`'s weight as training holds it on the card, where this strategy's simulated stand-in
        holds another (a quantized layer's packed weight); None for any other module (the default)."""
        return None

    def simulated_as(self, config: Config, facts: dict[str, Any]) -> dict[str, Any]:
        """What of `config`'s value of this knob the estimator's simulated step depends on, as named facts
        (hashable values) merged over the strategies in rung order (`facts`: those of the strategies
        before this one); one simulation serves every config with the same facts. A fact whose name starts
        with "_" is for later strategies only, not the key. Default: the value itself, nothing for the
        knob's default (no-op) value."""
        value = self.value(config)
        return {} if value == Config().knob(self.field) else {self.field: str(value)}

    def relieves(self, config: Config) -> Config | None:
        """Where this knob's value in `config` only lowers memory and is never predicted faster at the same
        micro-batch (the same step, or more FLOPs, kernels or copies): `config` with the knob at its default,
        which it relieves. The dry-run predicts `config` only where it could be chosen over the level with every
        such knob at its default: that one falls short of a clean fit at its largest micro-batch and is not
        faster than `config` could be (`autofit.pipelines.levels._may_win`). None (the default): the value is
        predicted everywhere."""
        return None

    def recorded(self, settings: dict[str, Any], summary: dict[str, Any]) -> "Strategy":
        """This strategy as a saved plan needs it: rebuilt from what `settings` recorded for its knob
        (`Plan.settings[field]`, what `settings` returned) and the plan's spec `summary` (`Plan.spec`), for
        the exports and `autofit.prepare` (LoRA's adapters, the optimizer's hyperparameters). Itself by
        default."""
        return self

    def settings(self, config: Config, spec: "TrainSpec") -> dict[str, Any]:
        """What reproducing `config`'s value of this knob takes beyond the value itself (LoRA's target
        modules, scaling and dropout; the optimizer's class and hyperparameters, read from `spec`), recorded
        in the plan (`Plan.settings`) for the exports and `autofit.prepare`; nothing by default. JSON values
        only."""
        return {}

    def compute_dtype(self, config: Config) -> "torch.dtype | None":
        """The 16-bit dtype `config`'s value of this knob makes the forward compute in (an autocast's, 16-bit
        weights'), None where it leaves the model's own (the default): the search reads an error that names
        that dtype as the dtype's, not the other knobs'."""
        return None

    def explain(self, config: Config, exc: BaseException) -> str:
        """What `config`'s value of this knob has to do with the error `exc` a probe of it raised, as a
        clause for the probe's reason ("; ..."), when the knob is its likely cause and the user can act on it;
        "" otherwise (the default)."""
        return ""

    def launcher_keys(self, config: Config, fmt: str) -> dict[str, Any]:
        """Keys this knob writes into launcher format `fmt`; dotted names nest. "trainer": keyword arguments
        of `transformers.TrainingArguments`; "accelerate": fields of accelerate's config file; "deepspeed":
        keys of the DeepSpeed config beside those its builder writes (`autofit.strategies.deepspeed_config`);
        "torchrun": environment variables torchrun.sh and accelerate_launch.sh export (upper-case names:
        `AUTOFIT_*`, or a library's own), and `max_grad_norm`, the default of train_with_prepare.py's
        clipping. Nothing for a format whose loader rejects keys it does not know."""
        return {}

    def deepspeed_keys(self, config: Config, inputs: EngineInputs) -> dict[str, Any]:
        """This knob's keys of DeepSpeed's config for `config` (dotted names nest; the precision's bf16/fp16
        section, the optimizer's, the offload targets), which `autofit.strategies.deepspeed_config` merges
        into its skeleton (batch sizes, ZeRO stage, clipping, buffers): one dict for the ZeRO probe, the
        estimator and every export. `inputs`: what the keys need beyond `config`; a plan's instance
        (`recorded`) adds what the plan recorded. None by default."""
        return {}

    def launcher_files(self, config: Config, fmt: str, strategies: Sequence["Strategy"]) -> dict[str, dict[str, Any]]:
        """The engine's own files launcher format `fmt` writes for `config` beside its own (file name ->
        document; DeepSpeed's JSON), built with every strategy of the plan as it recorded them (`strategies`,
        `autofit.strategies.for_plan`). None by default."""
        return {}

    def setup_lines(self, config: Config, fmt: str) -> list[str]:
        """Python lines an exported script of format `fmt` runs on a variable `model` (and `optimizer`) to
        apply what no launcher key can say, calling this strategy's own code as the probe did; "trainer":
        train_with_trainer.py runs them, the other formats list them for your train.py. None by default."""
        return []

    def refuses(self, config: Config, fmt: str) -> str | None:
        """Why launcher format `fmt` cannot run `config`'s value of this knob, naming the knob and the format
        that can (`autofit.export` refuses the export with it); None where it can (the default)."""
        return None

    def replaces(self, config: Config, spec: "TrainSpec") -> str:
        """What `config`'s value of this knob replaces of the job `spec` describes, as a plan says it when the
        choice changes numerics ("your optimizer adamw is replaced by adafactor (...)"); "" where it keeps the
        job as given (the default)."""
        return ""

    def adapting(self, modules: Sequence[str]) -> "Strategy":
        """This strategy adapting the modules named `modules` (names or name suffixes, `dry_run(lora_targets=...)`)
        where it adds adapters to chosen modules, its other settings kept; itself where it adapts none (the
        default)."""
        return self

    def writing_to(self, nvme_path: str) -> "Strategy":
        """This strategy writing what it moves off the GPU to the folder `nvme_path` (a search's `nvme_path`),
        its other settings kept; itself where it writes to no disk (the default)."""
        return self

    def not_installed(self) -> str | None:
        """Why this machine cannot run this strategy at all (a library it needs is missing), as a message that
        names the install and the alternative; a search whose engine choice names this strategy's `engine`
        raises it. None where it can run (the default)."""
        return None

    def host_room(self, config: Config, need: Callable[[], int | None], nvme_path: str | None) -> str | None:
        """Why this machine cannot hold a probe of `config`'s value of this knob (None where it can, the
        default): what it moves off the GPU against the host RAM free now or the free space of `nvme_path`.
        `need()` predicts the probe's host bytes (None where it cannot); call it only where the value moves
        something (a prediction costs a simulation). `autofit tune` skips such a probe with the reason."""
        return None

    def observed(self, model: "torch.nn.Module", optimizer: Any) -> dict[str, Any]:
        """This knob's value as a live `model` and `optimizer` show it (field -> value), for the configuration
        the OOM guard runs without a plan; nothing where the live objects do not say it (the default)."""
        return {}

    def accumulation_kwargs(self, config: Config) -> dict[str, Any]:
        """Keyword arguments of accelerate's `GradientAccumulationPlugin` that `config`'s value of this knob
        was measured with (`Prepared.gradient_accumulation_plugin`); none by default."""
        return {}

    def running_differs(self, config: Config, running_precision: Any, autocast_dtype: "torch.dtype | None",
                        planned_dtype: "torch.dtype | None") -> str | None:
        """Why the OOM guard's model would not run `config` as it was measured, naming the fix; None where it
        would (the default). `running_precision`: the precision a framework that runs the forward itself
        (accelerate, the Trainer) uses by its own settings ("bf16", "fp16", "fp32"; None without one);
        `autocast_dtype`: the dtype a caller gave the guard, against `planned_dtype`, the plan's. The guard
        refuses to start with it."""
        return None

    def holds_alike(self, a: Config, b: Config) -> bool:
        """Whether `a` and `b` hold their model states alike for this knob (the same engine and stage), so that
        what one held where no activation is live bounds the other's through `saves_at_least`; True by
        default (a knob that only changes how much is held)."""
        return True

    def spread(self, config: Config) -> tuple[str, bool] | None:
        """How `config`'s value of this knob spreads model states over the GPUs: the value's name and whether it
        shards within a node (replicating across nodes) rather than over every GPU; None where it shards
        nothing (the default). A dry-run over several nodes weighs the two ways against each other."""
        return None


# A dtype mismatch between a 16-bit and an fp32 tensor as torch words it: "got Float and BFloat16", "Input
# type (float) and bias type (c10::BFloat16)", "self (Float) and source (Half) must have the same scalar type".
_HALF = re.compile(r"bfloat16|\bhalf\b|float16", re.IGNORECASE)
_FULL = re.compile(r"\b(?:float|float32)\b", re.IGNORECASE)


def mixes_dtypes(exc: BaseException) -> bool:
    """Whether `exc` is an op refusing to meet a 16-bit tensor and an fp32 one (`Strategy.explain`)."""
    text = str(exc)
    return bool(_HALF.search(text) and _FULL.search(text))


def set_nested(out: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `value` at the dotted key `dotted` ("zero_optimization.stage") of `out`, making parents."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        out = out.setdefault(key, {})
    out[leaf] = value


def plugins() -> list[Strategy]:
    """One instance of each plug-in strategy defined so far (those that declare `knob_type`)."""
    return [cls() for cls in _PLUGINS]


def plugin_classes() -> tuple[type[Strategy], ...]:
    """The plug-in strategy classes defined so far: what a value made once per set of them is keyed by."""
    return tuple(_PLUGINS)


class Ladder(Strategy):
    """A strategy whose values each save at least as much memory as the ones before them in `values`."""

    values: ClassVar[tuple[Any, ...]]

    def saves_at_least(self, a: Config, b: Config) -> bool:
        return self.values.index(self.value(a)) >= self.values.index(self.value(b))
