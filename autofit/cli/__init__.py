"""The `autofit` command line: one module per command; `main` only registers them."""
