"""Step 1 of the flow (docs/design.md): what the user asked, validated once, and the `Target` it is planned for.

`make_spec` turns a model, a batch and the user's arguments into a `TrainSpec` (factories, bytes, a
device: `train_spec`); `Target` describes the hardware a plan is for, built from a live device (tune) or a
GPU profile (dry-run: `target`); a user's own optimizer is measured on stand-ins (`optimizer_costs`).
"""
