"""What the exported training scripts share: their command line, read as `autofit tune` reads its own.

    python train_with_trainer.py --model gpt2 --dataset data.py:make_dataset --max-steps 100

`--model` takes what `autofit tune --model` takes (a preset, a config.json or model folder, or
FILE.py:factory returning a model, (model, make_batch) or (model, make_batch, loss_fn)); `--dataset`
is FILE.py:fn returning the training set (any map-style dataset: a list of samples, a TensorDataset,
a `datasets.Dataset`); `--collate-fn FILE.py:fn` the function that makes a batch of its samples where
torch's default cannot (samples holding a different count of objects, masks or boxes each: Mask2Former's,
DETR's); `--loss-fn FILE.py:fn` and (train_with_prepare.py) `--optimizer FILE.py:fn` as in `autofit
tune`. Run with no arguments, a script says what to pass and exits 2.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from torch import nn

from autofit.models.names import factory_loss_fn, file_factory, resolve_loss_fn, resolve_model

EXIT_USAGE = 2


def command_line(description: str, argv: Sequence[str] | None = None, loss: bool = True,
                 optimizer: bool = False) -> argparse.Namespace:
    """The script's options (`--loss-fn` with `loss`, `--optimizer` with `optimizer`); without --model and
    --dataset, the usage and what to pass (exit 2)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="what `autofit tune --model` took: a preset, a config.json or model folder, "
                                        "or FILE.py:factory")
    parser.add_argument("--dataset", help="FILE.py:fn returning the training set (a map-style dataset)")
    parser.add_argument("--collate-fn", help="FILE.py:fn making a batch of a list of samples, where torch's "
                                             "default cannot stack them (a different count of objects each)")
    if loss:
        parser.add_argument("--loss-fn", help="FILE.py:fn computing fn(output, batch) -> scalar loss, for a model "
                                              "whose output has no .loss (or the factory's third item)")
    if optimizer:
        parser.add_argument("--optimizer", help="FILE.py:fn returning your optimizer for the parameters it is given, "
                                                "where the plan was tuned with one it cannot rebuild")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    options = parser.parse_args(argv)
    missing = [name for name in ("model", "dataset") if not getattr(options, name)]
    if missing:
        parser.print_usage()
        parser.exit(EXIT_USAGE, f"{parser.prog}: pass {' and '.join('--' + m for m in missing)}: the model you "
                                f"tuned (as autofit tune --model took it) and FILE.py:fn returning the training set, "
                                f"e.g. --model examples/quickstart.py:make_model --dataset "
                                f"examples/quickstart.py:make_dataset --max-steps 2\n")
    return options


def load_model(text: str) -> nn.Module:
    """The model `--model` names, built as `autofit tune` builds it (random weights for presets and configs)."""
    return resolve_model(text)[0]()


def load_loss(model_text: str, loss_text: str | None) -> Any:
    """`--loss-fn`, else the loss a (model, make_batch, loss_fn) factory returns, else None (`output.loss`)."""
    return resolve_loss_fn(loss_text) if loss_text else factory_loss_fn(model_text)


def load_optimizer(text: str | None) -> Any:
    """The optimizer factory `--optimizer FILE.py:fn` names (called on the trainable parameters), or None: the
    plan's own (`autofit.prepare` rebuilds it)."""
    return file_factory(text, "--optimizer").load() if text else None


def load_dataset(text: str) -> Any:
    """The training set `--dataset FILE.py:fn` returns."""
    return file_factory(text, "--dataset").load()()


def load_collate(text: str | None) -> Any:
    """The function `--collate-fn FILE.py:fn` names (it is called on each list of samples), or None."""
    return file_factory(text, "--collate-fn").load() if text else None
