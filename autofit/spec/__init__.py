"""Step 1 of the flow (DESIGN.md): what the user asked, validated once, and the `Target` it is planned for.

`make_spec` turns a model, a batch and the user's arguments into a `TrainSpec` (factories, bytes, a
device); `Target` describes the hardware a plan is for, built from a live device (tune) or a GPU
profile (dry-run). Also here: batches as users give them (`batch`), batches synthesized from a Hugging
Face config (`synthetic`, made by the factories in `synthetic_batches`), model inspection on the meta
device, presets and `--model` names.
"""
