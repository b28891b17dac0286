"""The probe (docs/design.md): real training steps of one candidate under the budget, and their outcome.
One probe in this process (`run`: the strategies' `TrainRun` built, warmed up, timed, its peak read and its
memory released), OOM kinds (`oom`), the outcome record (`outcome`), and the launcher that runs a probe in a
child process or N ranks (`launch`, `child`, `handover`, `payload`, `orphans`). The budgets a probe runs
under are the device's (`autofit.devices.memory`).
"""
