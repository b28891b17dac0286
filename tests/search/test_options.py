"""`SearchOptions`: the search's own knobs as one value, checked when built; `autofit.autofit` takes it and
its keywords of the same names, in either call style."""

import dataclasses

import pytest
from models import make_mlp, make_mlp_batch, mlp_loss

import autofit
from autofit import SearchOptions, UsageError

JOB = dict(global_batch_size=8, device="cpu", memory_budget="2MiB", loss_fn=mlp_loss, allow=0)  # OOMs: every probe counts


@pytest.mark.parametrize("field, value, message", [
    ("max_probes", 0, "max_probes must be an integer >= 1 (probes the search may run), but got 0."),
    ("max_probes", 2.5, "max_probes must be an integer >= 1"),
    ("warmup_steps", -1, "warmup_steps must be an integer >= 0 (untimed steps per probe), but got -1."),
    ("timed_steps", True, "timed_steps must be an integer >= 1 (timed steps per probe), but got True."),
    ("max_micro_batch", 0, "max_micro_batch must be an integer >= 1"),
    ("probe_timeout", 0, "probe_timeout must be a number > 0 (wall seconds a probe may take), but "
                         "got 0."),
    ("safety_margin", 1.0, "safety_margin must be a number in [0, 1)"),
    ("exact_margin", -0.1, "exact_margin must be a number >= 0 (0.10 = a numerics change must be 10% faster"),
    ("exact_margin", "10%", "but got '10%'"),
    ("predict", "yes", "predict must be True or False (whether the estimator prunes), but got 'yes'."),
])
def test_a_bad_value_is_refused_naming_it(field, value, message):
    with pytest.raises(UsageError) as caught:
        SearchOptions(**{field: value})
    assert message in str(caught.value)
    flag = "--" + field.replace("_", "-")  # the command line names its option
    assert caught.value.words(cli=True).startswith(f"{flag} must be")


def test_defaults_are_the_documented_ones_and_replace_checks_again():
    options = SearchOptions()
    assert (options.max_probes, options.warmup_steps, options.timed_steps, options.exact_margin,
            options.safety_margin, options.predict) == (40, 2, 3, 0.10, 0.10, True)
    assert options.replace(max_probes=None, timed_steps=5) == dataclasses.replace(options, timed_steps=5)
    with pytest.raises(UsageError, match="timed_steps must be an integer >= 1"):
        options.replace(timed_steps=0)
    with pytest.raises(UsageError, match="SearchOptions has no field 'max_probe'"):
        options.replace(max_probe=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_probes = 3


def test_both_call_styles_search_the_same_way():
    """`options=SearchOptions(...)` and the keywords of the same names run the same search; a keyword beside
    `options` replaces that field."""
    fields = dict(max_probes=2, warmup_steps=1, timed_steps=1, predict=False)
    by_value = autofit.autofit(make_mlp, make_mlp_batch, **JOB, options=SearchOptions(**fields))
    by_keywords = autofit.autofit(make_mlp, make_mlp_batch, **JOB, **fields)
    assert by_value.probes_run == by_keywords.probes_run == 2
    assert [p.config for p in by_value.probes if p.measured] == [p.config for p in by_keywords.probes if p.measured]
    one = autofit.autofit(make_mlp, make_mlp_batch, **JOB, options=SearchOptions(**fields), max_probes=1)
    assert one.probes_run == 1
    with pytest.raises(UsageError, match="max_probes must be an integer >= 1"):
        autofit.autofit(make_mlp, make_mlp_batch, **JOB, options=SearchOptions(**fields), max_probes=0)
    with pytest.raises(UsageError, match=r"options=\{'max_probes': 2\}: pass autofit.SearchOptions"):
        autofit.autofit(make_mlp, make_mlp_batch, **JOB, options={"max_probes": 2})
