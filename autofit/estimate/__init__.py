"""Step 4 of the flow (docs/design.md): predicted peak memory per device without a GPU (model states by
formula, activations by fake-tensor simulation), the cost model (`cost_model`), GPU profiles, and the dry-run that
ranks the same space the tuner walks. Estimation ranks and prunes; the probe decides.
"""
