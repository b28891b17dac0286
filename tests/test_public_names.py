"""The package's public names: each resolves from `import autofit`, and a probe process does not import the
parts it does not run (they are imported on first use of their names)."""

import subprocess
import sys

import autofit


def test_every_public_name_resolves_and_is_listed():
    for name in autofit.__all__:
        assert getattr(autofit, name) is not None, name
    assert set(autofit.__all__) <= set(dir(autofit))
    from autofit import autofit as tune, dry_run, OomGuard  # noqa: F401  (from-imports of lazy names)

    assert callable(tune) and callable(dry_run)


def test_a_probe_process_starts_without_the_estimator_the_search_or_the_guard():
    code = ("import sys, autofit.probe.child; "
            "print(sorted(m for m in ('autofit.pipelines.dry_run', 'autofit.pipelines.tune', 'autofit.guard', "
            "'autofit.search.walk', 'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
