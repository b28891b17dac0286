"""The benchmark suite behind `python bench/run.py`: scenarios (`scenarios`), the exhaustive oracle
(`oracle`), the tools people use (`tools`), back-to-back re-measurement and robustness (`measure`), the
dry-run error (`dryrun`), one scenario side by side (`side_by_side`), a competing load (`load`) and the
README's tables (`report`)."""
