"""Step 5 of the flow (docs/design.md): real training steps of one candidate under the budget, and their
outcome. The training step (`step`), budgets and peaks (`memory`), OOM kinds (`oom`), the outcome
record (`outcome`), and the launcher that runs a probe in a child process or N ranks (`launch`).
"""
