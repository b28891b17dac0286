"""The bottom of the flow (docs/design.md): models as autofit reads them. What a model is made of, read from a
build on the meta device (`info`), the names `--model` takes: presets, hub ids, config folders, FILE.py:factory
(`names`), and the published configurations shipped as data (`presets`).
"""
