"""Standalone measurements: each script's docstring names the claim it backs (a README or docs sentence,
a package constant) and the results file it writes under bench/results; bench/README.md has the table."""
