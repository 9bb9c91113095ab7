"""Tests of stabmon.config: sources and their order, type and range checks, every error path."""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from stabmon.config import Config, DaemonConfig, ThroughputConfig, load_config
from stabmon.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"
OVERRIDE = "attach() keyword argument"
MAPPING = "config mapping"


def write_yaml(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def dotted_keys(section: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for name, value in section.items():
        keys.append(prefix + name)
        if isinstance(value, dict):
            keys.extend(dotted_keys(value, prefix + name + "."))
    return keys


# Defaults and sources


def test_load_config_returns_defaults_when_given_nothing() -> None:
    config = load_config(env={})

    assert config == Config()
    assert config.port == 9400
    assert config.run_id is None
    assert config.stall_seconds is None
    assert config.daemon == DaemonConfig(port=9399, address="0.0.0.0", interval=5.0)


def test_load_config_reads_values_from_a_yaml_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port: 9500\nspike_threshold: 4.5\ndaemon:\n  interval: 2\n")

    config = load_config(path, env={})

    assert config.port == 9500
    assert config.spike_threshold == 4.5
    assert config.daemon.interval == 2.0
    assert config.daemon.port == 9399


def test_load_config_accepts_a_path_given_as_str(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "measure_every: 4\n")

    assert load_config(str(path), env={}).measure_every == 4


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_load_config_returns_defaults_when_the_file_is_empty(tmp_path: Path, text: str) -> None:
    assert load_config(write_yaml(tmp_path, text), env={}) == Config()


def test_load_config_reads_values_from_a_mapping_source() -> None:
    config = load_config({"run_id": "exp-1", "daemon": {"port": 9600}}, env={})

    assert config.run_id == "exp-1"
    assert config.daemon.port == 9600


def test_load_config_reads_the_file_named_by_stabmon_config_when_source_is_none(
    tmp_path: Path,
) -> None:
    path = write_yaml(tmp_path, "leak_windows: 5\n")

    assert load_config(env={"STABMON_CONFIG": str(path)}).leak_windows == 5


def test_load_config_ignores_stabmon_config_when_a_source_is_given(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "leak_windows: 5\n")

    config = load_config({"leak_windows": 7}, env={"STABMON_CONFIG": str(path)})

    assert config.leak_windows == 7


def test_load_config_lets_environment_override_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port: 9500\nrun_id: from-file\nrun_dir: /file\n")
    env = {"STABMON_PORT": "9600", "STABMON_RUN_ID": "from-env", "STABMON_DIR": "/env"}

    config = load_config(path, env=env)

    assert (config.port, config.run_id, config.run_dir) == (9600, "from-env", "/env")


def test_load_config_ignores_empty_environment_variables(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port: 9500\n")

    config = load_config(path, env={"STABMON_PORT": "", "STABMON_RUN_ID": "", "STABMON_CONFIG": ""})

    assert config.port == 9500
    assert config.run_id is None


def test_load_config_lets_overrides_beat_the_environment() -> None:
    config = load_config(overrides={"port": 9700}, env={"STABMON_PORT": "9600"})

    assert config.port == 9700


def test_load_config_reads_os_environ_when_env_is_omitted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STABMON_RUN_ID", "from-os-environ")

    assert load_config().run_id == "from-os-environ"


def test_load_config_merges_a_dotted_override_into_the_file_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "daemon:\n  port: 9800\n  interval: 10\n")

    config = load_config(path, overrides={"daemon.interval": 2}, env={})

    assert config.daemon == DaemonConfig(port=9800, interval=2.0)


def test_load_config_merges_a_nested_override_into_the_file_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "daemon:\n  port: 9800\n  interval: 10\n")

    config = load_config(path, overrides={"daemon": {"interval": 2}}, env={})

    assert config.daemon == DaemonConfig(port=9800, interval=2.0)


def test_load_config_accepts_a_daemon_config_as_a_section_override() -> None:
    section = DaemonConfig(port=9900, address="127.0.0.1", interval=1.0)

    assert load_config(overrides={"daemon": section}, env={}).daemon == section


def test_load_config_applies_only_overrides_to_a_config_source() -> None:
    source = Config(port=9500, run_id="given")

    config = load_config(source, overrides={"measure_every": 3}, env={"STABMON_PORT": "9600"})

    assert config == dataclasses.replace(source, measure_every=3)


def test_load_config_returns_a_config_source_unchanged_when_there_are_no_overrides() -> None:
    source = Config(port=9500)

    assert load_config(source, env={"STABMON_PORT": "9600"}) is source


# Types


def test_load_config_widens_an_integer_to_a_float_for_a_number_field() -> None:
    config = load_config({"spike_threshold": 7}, env={})

    assert config.spike_threshold == 7.0
    assert isinstance(config.spike_threshold, float)


def test_config_widens_an_integer_to_a_float_when_constructed_directly() -> None:
    assert isinstance(Config(sample_seconds=2).sample_seconds, float)


def test_load_config_accepts_null_for_optional_fields(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "run_id: null\nstall_seconds: ~\nrun_dir: null\n")

    config = load_config(path, env={})

    assert (config.run_id, config.stall_seconds, config.run_dir) == (None, None, None)


def test_load_config_lets_an_override_reset_an_optional_field_to_none(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "stall_seconds: 120\n")

    assert load_config(path, overrides={"stall_seconds": None}, env={}).stall_seconds is None


def test_load_config_reads_yaml_booleans(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "serve_metrics: false\nevent_log: False\n")

    config = load_config(path, env={})

    assert config.serve_metrics is False
    assert config.event_log is False


def test_load_config_rejects_a_bool_for_an_integer_field() -> None:
    with pytest.raises(
        ConfigError, match=r"^port in config mapping: expected an integer, got True \(bool\)$"
    ) as caught:
        load_config({"port": True}, env={})

    assert (caught.value.key, caught.value.source) == ("port", MAPPING)


def test_load_config_rejects_a_bool_for_a_number_field() -> None:
    with pytest.raises(ConfigError, match=r"expected a number, got False \(bool\)$") as caught:
        load_config({"sample_seconds": False}, env={})

    assert caught.value.key == "sample_seconds"


def test_load_config_rejects_an_integer_for_a_bool_field() -> None:
    with pytest.raises(
        ConfigError, match=r"^event_log in .*: expected true or false, got 1 \(int\)$"
    ) as caught:
        load_config({"event_log": 1}, env={})

    assert caught.value.key == "event_log"


def test_load_config_rejects_a_float_for_an_integer_field() -> None:
    with pytest.raises(ConfigError, match=r"expected an integer, got 2\.5 \(float\)$"):
        load_config({"measure_every": 2.5}, env={})


def test_load_config_rejects_a_quoted_number_from_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, 'port: "9500"\n')

    with pytest.raises(
        ConfigError,
        match=r"port in .*run\.yaml: expected an integer, got '9500' \(str\); "
        r"write it without quotes$",
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == ("port", str(path))


def test_load_config_rejects_a_word_for_an_integer_field(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port: abc\n")

    with pytest.raises(
        ConfigError, match=r"port in .*run\.yaml: expected an integer, got 'abc' \(str\)$"
    ) as caught:
        load_config(path, env={})

    assert caught.value.allowed == "an integer from 0 to 65535"


def test_load_config_rejects_a_number_for_a_string_field() -> None:
    with pytest.raises(
        ConfigError, match=r"^run_id in .*: expected a string or None, got 123 \(int\)$"
    ) as caught:
        load_config({"run_id": 123}, env={})

    assert caught.value.key == "run_id"


def test_load_config_rejects_null_for_a_field_that_is_not_optional() -> None:
    with pytest.raises(
        ConfigError, match=r"^port in .*: expected an integer, got None \(NoneType\)$"
    ):
        load_config({"port": None}, env={})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 10**400])
def test_load_config_rejects_a_non_finite_number(value: float) -> None:
    with pytest.raises(
        ConfigError, match=r"^spike_threshold in .*: expected a finite number, got "
    ) as caught:
        load_config({"spike_threshold": value}, env={})

    assert caught.value.key == "spike_threshold"


# Ranges


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("stall_seconds", -5, "a number > 0 and <= 2592000, got -5"),
        ("port", 70000, "an integer from 0 to 65535, got 70000"),
        ("spike_ema_alpha", 1, "a number > 0 and < 1, got 1"),
        ("max_modules", 2000, "an integer from 1 to 1024, got 2000"),
        ("measure_every", 0, "an integer >= 1, got 0"),
        ("leak_warmup_epochs", -1, "an integer >= 0, got -1"),
        ("address", "", "a non-empty string, got ''"),
    ],
)
def test_load_config_rejects_a_value_out_of_range(
    tmp_path: Path, key: str, value: object, expected: str
) -> None:
    path = write_yaml(tmp_path, json.dumps({key: value}))

    with pytest.raises(
        ConfigError, match=f"^{re.escape(f'{key} in {path}: expected {expected}')}$"
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == (key, str(path))


def test_load_config_rejects_an_empty_run_id() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^run_id in .*: expected a non-empty string of at most 128 characters, got ''$",
    ):
        load_config({"run_id": ""}, env={})


def test_load_config_rejects_a_run_id_longer_than_128_characters() -> None:
    with pytest.raises(
        ConfigError,
        match=r"expected a non-empty string of at most 128 characters, got 129 characters$",
    ):
        load_config({"run_id": "r" * 129}, env={})


def test_load_config_names_the_dotted_key_for_a_bad_daemon_value(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "daemon:\n  interval: -1\n", name="node.yaml")

    with pytest.raises(
        ConfigError,
        match=rf"^daemon\.interval in {re.escape(str(path))}: "
        r"expected a number > 0 and <= 2592000, got -1$",
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == ("daemon.interval", str(path))


def test_config_rejects_an_out_of_range_value_when_constructed_directly() -> None:
    with pytest.raises(
        ConfigError, match=r"^port in Config\(\): expected an integer from 0 to 65535, got -1$"
    ) as caught:
        Config(port=-1)

    assert (caught.value.key, caught.value.source) == ("port", "Config()")


def test_config_rejects_a_mapping_for_a_section_when_constructed_directly() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^daemon in Config\(\): expected a DaemonConfig, got \{\} \(dict\); "
        r"use load_config\(\)",
    ):
        Config(daemon={})  # type: ignore[arg-type]  # the wrong type is the point of the test


def test_config_cannot_be_changed_after_construction() -> None:
    config = Config()

    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]  # assigning to a frozen field is the point of the test


# Keys


def test_load_config_suggests_a_close_key_when_the_key_is_unknown(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "stall_secs: 30\n")

    with pytest.raises(
        ConfigError,
        match=rf"^stall_secs in {re.escape(str(path))}: unknown key; "
        r"did you mean 'stall_seconds'\? allowed: address, amp_skip_run, basic_auth_file, daemon, ",
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == ("stall_secs", str(path))
    assert "stall_seconds" in caught.value.allowed.split(", ")


def test_load_config_lists_allowed_keys_without_a_hint_when_nothing_is_close() -> None:
    with pytest.raises(
        ConfigError, match=r"^zzz in config mapping: unknown key; allowed: address, "
    ) as caught:
        load_config({"zzz": 1}, env={})

    assert caught.value.key == "zzz"


def test_load_config_suggests_a_dotted_key_when_a_daemon_key_is_unknown() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^daemon\.intervl in attach\(\) keyword argument: unknown key; "
        r"did you mean 'daemon\.interval'\? "
        r"allowed: daemon\.address, daemon\.interval, daemon\.port$",
    ) as caught:
        load_config(overrides={"daemon.intervl": 2}, env={})

    assert (caught.value.key, caught.value.source) == ("daemon.intervl", OVERRIDE)


def test_load_config_rejects_a_dotted_key_below_a_plain_value() -> None:
    with pytest.raises(
        ConfigError, match=r"^port\.x in .*: unknown key; port is a single value, not a section$"
    ) as caught:
        load_config(overrides={"port.x": 1}, env={})

    assert caught.value.key == "port.x"


def test_load_config_rejects_a_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "daemon: 5\n")

    with pytest.raises(
        ConfigError, match=r"^daemon in .*: expected a mapping of daemon\.\* keys, got 5 \(int\)$"
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == ("daemon", str(path))


def test_load_config_rejects_a_key_that_is_not_a_string(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "1: 5\n")

    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: keys must be strings, got 1 \(int\)$"
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == (None, str(path))


def test_load_config_rejects_a_section_key_that_is_not_a_string() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^daemon in config mapping: keys must be strings, got None \(NoneType\)$",
    ) as caught:
        load_config({"daemon": {None: 1}}, env={})

    assert caught.value.key == "daemon"


# Environment


def test_load_config_rejects_a_port_variable_that_is_not_a_number() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^port in environment variable STABMON_PORT: expected a decimal integer, got 'abc'$",
    ) as caught:
        load_config(env={"STABMON_PORT": "abc"})

    assert (caught.value.key, caught.value.source) == ("port", "environment variable STABMON_PORT")


def test_load_config_rejects_a_port_variable_out_of_range() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^port in environment variable STABMON_PORT: "
        r"expected an integer from 0 to 65535, got 70000$",
    ):
        load_config(env={"STABMON_PORT": "70000"})


def test_load_config_parses_a_port_variable_with_surrounding_spaces() -> None:
    assert load_config(env={"STABMON_PORT": " 9600\n"}).port == 9600


# Overrides


def test_load_config_names_the_keyword_argument_when_an_override_is_bad() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^max_modules in attach\(\) keyword argument: "
        r"expected an integer from 1 to 1024, got 0$",
    ) as caught:
        load_config(overrides={"max_modules": 0}, env={})

    assert (caught.value.key, caught.value.source) == ("max_modules", OVERRIDE)


# Files


def test_load_config_reports_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"

    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: config file not found; check the path$"
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == (None, str(path))


def test_load_config_names_stabmon_config_when_the_file_it_names_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"

    with pytest.raises(
        ConfigError,
        match=r"config file not found; check environment variable STABMON_CONFIG, or unset it$",
    ) as caught:
        load_config(env={"STABMON_CONFIG": str(path)})

    assert caught.value.source == str(path)


def test_load_config_reports_a_path_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"cannot read config file \(Is a directory\); check the path$"
    ) as caught:
        load_config(tmp_path, env={})

    assert (caught.value.key, caught.value.source) == (None, str(tmp_path))


def test_load_config_refuses_a_file_over_one_mib(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "# padding\n" * 110_000 + "port: [\n")

    with pytest.raises(
        ConfigError,
        match=r"config file is larger than 1 MiB, too large for a stabmon config; check the path$",
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == (None, str(path))


def test_load_config_reports_the_line_and_column_of_malformed_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port: 9500\nspike_threshold: [1, 2\nleak_windows: 3\n")

    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: malformed YAML at line \d+, column \d+: "
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == (None, str(path))


def test_load_config_reports_line_two_for_a_bad_indent_on_line_two(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port: 9500\n  bad indent: 1\n")

    with pytest.raises(ConfigError, match=r"malformed YAML at line 2, column \d+: "):
        load_config(path, env={})


def test_load_config_rejects_a_python_tag_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "created-by-yaml"
    path = write_yaml(tmp_path, f"port: !!python/object/apply:builtins.open ['{marker}', 'w']\n")

    with pytest.raises(
        ConfigError,
        match=r"unsupported YAML at line 1, column 7: .*"
        r"tags such as !!python/object are not allowed",
    ) as caught:
        load_config(path, env={})

    assert not marker.exists()
    assert (caught.value.key, caught.value.source) == (None, str(path))


@pytest.mark.parametrize(("text", "kind"), [("- port\n- 9500\n", "list"), ("just text\n", "str")])
def test_load_config_rejects_a_file_whose_top_level_is_not_a_mapping(
    tmp_path: Path, text: str, kind: str
) -> None:
    path = write_yaml(tmp_path, text)

    with pytest.raises(
        ConfigError, match=rf"expected a mapping of keys to values at the top level, got a {kind}; "
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == (None, str(path))


def test_load_config_rejects_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(b"run_id: caf\xe9\n")

    with pytest.raises(
        ConfigError, match=r"config file is not UTF-8 text \(bad byte at offset 11\)$"
    ) as caught:
        load_config(path, env={})

    assert (caught.value.key, caught.value.source) == (None, str(path))


# Round trip, docs, fuzzing


def test_to_dict_round_trips_through_load_config() -> None:
    config = Config(
        run_id="exp-7",
        port=0,
        stall_seconds=90.0,
        serve_metrics=False,
        daemon=DaemonConfig(interval=1.5),
    )

    data = config.to_dict()

    assert json.loads(json.dumps(data)) == data
    assert load_config(data, env={}) == config


def test_docs_mention_every_config_key() -> None:
    text = DOCS.read_text(encoding="utf-8")

    missing = [key for key in dotted_keys(Config().to_dict()) if f"`{key}`" not in text]

    assert missing == []


def test_docs_example_yaml_spells_out_the_defaults(tmp_path: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.DOTALL)
    path = write_yaml(tmp_path, blocks[-1])

    assert load_config(path, env={}) == Config()


def test_docs_example_yaml_names_every_key(tmp_path: Path) -> None:
    # The "every key" example cannot miss one: a new field fails here until it is listed.
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.DOTALL)
    example = yaml.safe_load(blocks[-1])
    assert sorted(dotted_keys(example)) == sorted(dotted_keys(Config().to_dict()))


def test_config_fields_each_have_a_doc() -> None:
    for section in (Config, DaemonConfig, ThroughputConfig):
        undocumented = [f.name for f in dataclasses.fields(section) if not f.metadata.get("doc")]

        assert undocumented == []


_KEYS = st.one_of(
    st.sampled_from(dotted_keys(Config().to_dict()) + ["daemon.", "port.x", "stall_secs"]),
    st.text(max_size=12),
    st.integers(),
    st.none(),
    st.booleans(),
)
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=140))
_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_KEYS, children, max_size=3),
    max_leaves=12,
)


@settings(database=None, max_examples=300, deadline=None)
@given(mapping=st.dictionaries(_KEYS, _VALUES, max_size=6))
def test_load_config_raises_only_config_error_when_fed_arbitrary_mappings(
    mapping: dict[Any, Any],
) -> None:
    try:
        config = load_config(mapping, overrides=mapping, env={})
    except ConfigError:
        return

    assert isinstance(config, Config)


def test_load_config_never_runs_os_system_from_a_python_tag(tmp_path: Path) -> None:
    marker = tmp_path / "X"
    text = f'!!python/object/apply:os.system ["touch {marker}"]\n'
    for document in (text, f"port: {text}", f"daemon:\n  interval: {text}"):
        path = write_yaml(tmp_path, document)
        with pytest.raises(ConfigError, match=r"unsupported YAML .*tags such as"):
            load_config(path, env={})
    assert not marker.exists()


def test_load_config_refuses_a_huge_file_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    with path.open("wb") as file:
        file.truncate(8 * 2**30)  # 8 GiB, sparse: reading it whole would exhaust memory
    with pytest.raises(ConfigError, match=r"larger than 1 MiB|over 1 MiB|MiB"):
        load_config(path, env={})


_YAML_TEXT = st.one_of(
    st.text(max_size=200),
    st.lists(
        st.tuples(
            st.sampled_from([*dotted_keys(Config().to_dict()), "daemon", "x", "- a", "? k"]),
            st.sampled_from(["", " 1", " -5", " 1e999", " .nan", " [1, 2]", " {a: 1}",
                             " !!binary aGk=", " &a 1", " *a", " 'text'", " ~", " yes",
                             " !!python/name:os.system", ":", " |\n  block"]),
        ),
        max_size=6,
    ).map(lambda pairs: "".join(f"{key}:{value}\n" for key, value in pairs)),
)  # fmt: skip


@settings(database=None, max_examples=300, deadline=None)
@given(text=_YAML_TEXT)
def test_load_config_raises_only_config_error_when_fed_arbitrary_yaml_text(text: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            config = load_config(path, env={})
        except ConfigError:
            return
    assert isinstance(config, Config)


@settings(database=None, max_examples=200, deadline=None)
@given(
    environ=st.dictionaries(
        st.sampled_from(["STABMON_PORT", "STABMON_RUN_ID", "STABMON_DIR", "STABMON_OTHER"]),
        st.text(max_size=200),
    )
)
def test_load_config_raises_only_config_error_when_fed_arbitrary_environment(
    environ: dict[str, str],
) -> None:
    try:
        config = load_config({}, env=environ)
    except ConfigError:
        return
    assert isinstance(config, Config)


def test_throughput_section_rejects_a_non_positive_slowdown_threshold() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^throughput\.slowdown_threshold in attach\(\) keyword argument: expected a "
        r"number > 0, got 0",
    ):
        load_config(overrides={"throughput.slowdown_threshold": 0}, env={})


def test_throughput_section_rejects_an_unknown_mfu_dtype() -> None:
    with pytest.raises(
        ConfigError, match=r"^throughput\.mfu_dtype in config mapping: expected one"
    ):
        load_config({"throughput": {"mfu_dtype": "int4"}}, env={})
