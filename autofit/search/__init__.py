"""The search (docs/design.md): the candidates the strategies offer for a Target, laid out as a space with
the rules between knobs applied once (`space`, `rules`), the walk that probes as little as it can (`walk`)
and what a person sees while it runs (`progress`),
the finalists re-measured back to back (`confirm`) and the decision between them with its records
(`decision`), and the trial store that makes a search resumable (`trials`). `autofit.pipelines.tune`
wires the job -> space -> walk -> confirmation -> plan.
"""
