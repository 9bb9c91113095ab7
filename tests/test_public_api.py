"""The public surface is pinned: adding or removing a name is a deliberate change."""

import stabmon


def test_public_api_exports_exactly_the_documented_names() -> None:
    assert sorted(stabmon.__all__) == [
        "AlreadyAttachedError",
        "AnomalyStop",
        "Config",
        "ConfigError",
        "DeviceMismatchError",
        "Monitor",
        "Plugin",
        "StabmonError",
        "TrainingStalled",
        "__version__",
        "attach",
        "load_config",
        "sample_hashes",
    ]
    for name in stabmon.__all__:
        assert hasattr(stabmon, name), name


def test_errors_form_one_hierarchy() -> None:
    assert issubclass(stabmon.ConfigError, stabmon.StabmonError)
    assert issubclass(stabmon.AlreadyAttachedError, stabmon.StabmonError)
    assert issubclass(stabmon.DeviceMismatchError, stabmon.StabmonError)
    assert issubclass(stabmon.TrainingStalled, stabmon.StabmonError)
    assert issubclass(stabmon.AnomalyStop, stabmon.StabmonError)
