"""The two pipelines (docs/design.md), each wiring the steps below it into one answer: `tune` (the job ->
the space -> the walk over real probes -> the confirmation -> a `Plan`) and `dry_run` (the same space,
every candidate predicted on a GPU profile, nothing trained -> a `DryRunReport` of `candidate.Candidate`s, its
chosen reason's sentences in `notes`). `host_memory` checks both against the RAM of a node.
"""
