"""One-off diagnostics: each prints what it found (its docstring says what it looked for and what that
showed) and writes nothing under bench/results; what became a fix or a claim is measured in bench/measurements/."""
