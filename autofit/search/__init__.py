"""Steps 2-3 and 5 of the flow (docs/design.md): the candidates the strategies offer for a Target, laid out as a
space with the rules between knobs applied once (`space`, `rules`), the walk that probes as little as
it can (`walk`), the trial store that makes a search resumable (`trials`), and `autofit.autofit`
wiring spec -> space -> walk -> plan (`tuner`).
"""
