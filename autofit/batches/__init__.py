"""The bottom of the flow (docs/design.md): batches. Batches as users give them, sliced into micro-batches
(`batch`), each micro-batch's share of the loss (`shares`), whether a loss couples its samples (`coupling`),
whether the samples reach a time-major module's steps axis (`sample_axis`), and batches synthesized from a
Hugging Face config (`synthetic`, made by the factories in `synthetic_batches`).
"""
