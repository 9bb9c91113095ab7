"""Write stabmon's monitoring mixin: alerts, rules, dashboards and a config, from their sources.

    python deploy/mixin/generate.py                       # regenerate deploy/mixin
    python deploy/mixin/generate.py --check               # exit 1 if deploy/mixin is stale
    python deploy/mixin/generate.py --config site.yaml --out my-mixin   # your thresholds

The layout a user of the Prometheus ecosystem expects of a mixin (issue 39), generated, not
hand-written jsonnet, because the rules and dashboards already have one source each:

- ``alerts.yaml``: the groups of ``deploy/prometheus/rules/stabmon.rules.yml`` that hold
  alerts, whole. Each alert reads series recorded earlier in its own group (a group evaluates
  its rules in order, at its own interval), so those records travel with it.
- ``rules.yaml``: the groups that only record (fleet aggregates for dashboards and a store).
- ``dashboards/*.json``: ``dashboards/json/*.json`` byte for byte (``dashboards/generate.py``
  writes those from ``dashboards/*.dashboard.py``).
- ``config.yaml``: the selectors and thresholds the rules use, each with the rules that use
  it, and every alert's ``for:`` and severity. ``SELECTORS`` and ``THRESHOLDS`` below are its
  source; the tests check that each one is, verbatim, what its rules say, so the config never
  describes rules other than the shipped ones.

``--config FILE`` renders the mixin with other values: a YAML file of the same shape as
``config.yaml`` (``selectors: {name: value}``, ``thresholds: {name: value}``,
``alerts: {AlertName: {for: 30m, severity: critical}}``; a list of ``for:`` durations for an
alert made of several rules, one each), any subset. Each value replaces the
shipped one in exactly the rules listed for it. The promtool tests
(``deploy/prometheus/tests``) prove the shipped values only: re-run them on your own rules.

Every alert must carry a ``runbook_url`` to its section of ``docs/runbooks.md``: the script
refuses to write a mixin with an alert that has none. Needs only the standard library and PyYAML.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stabmon.shared.generated import BlockDumper, check_fresh, stale_files

MIXIN_DIR = Path(__file__).resolve().parent
ROOT = MIXIN_DIR.parents[1]
RULES_FILE = ROOT / "deploy" / "prometheus" / "rules" / "stabmon.rules.yml"
DASHBOARDS_DIR = ROOT / "dashboards" / "json"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/stabmon/stabmon/blob/main/docs/runbooks.md#"
ALERTS_OUTPUT = "alerts.yaml"
RULES_OUTPUT = "rules.yaml"
CONFIG_OUTPUT = "config.yaml"
DASHBOARDS_OUTPUT = "dashboards"


@dataclass(frozen=True)
class Selector:
    """A label matcher the rules use for a set of values (one label, one operator)."""

    label: str
    op: str
    value: str
    rules: tuple[str, ...]
    why: str

    def matcher(self, value: str | None = None) -> str:
        return f'{self.label}{self.op}"{self.value if value is None else value}"'


@dataclass(frozen=True)
class Threshold:
    """A number the rules compare with: where each rule says it (``{}`` marks the number)."""

    value: float
    uses: tuple[tuple[str, str], ...]  # (rule name, PromQL fragment with {} for the value)
    why: str


#: The selectors of the shipped rules. The rules select by metric name and stabmon's own
#: labels only, never by job or instance, so a mixin's usual ``jobSelector`` has no place here:
#: scrape jobs may be named freely.
SELECTORS: dict[str, Selector] = {
    "training_phases": Selector(
        "phase",
        "=~",
        "data_wait|forward|backward|optimizer",
        ("StabmonTrainingSlowdown", "StabmonInputStarvation"),
        "the phases of a training step, whose time adds up to a step",
    ),
    "step_phases": Selector(
        "phase",
        "!~",
        "startup|data_wait|forward|backward|optimizer",
        ("StabmonTrainingStalled",),
        "anything else is a named phase (checkpoint, eval) that excuses its run's waiting ranks",
    ),
    "throttle_reasons": Selector(
        "reason",
        "=~",
        "hw_thermal_slowdown|sw_thermal_slowdown|hw_power_brake_slowdown|hw_slowdown",
        ("StabmonGPUThermalThrottling",),
        "NVML's throttle reasons that mean heat or a hardware fault (not power caps or idling)",
    ),
    "host_memory": Selector(
        "device",
        "=",
        "host",
        ("StabmonHostMemoryLeak",),
        "the process's host memory among the memory drift series",
    ),
    "device_memory": Selector(
        "device",
        "!=",
        "host",
        ("StabmonDeviceMemoryLeak",),
        "every accelerator among the memory drift series",
    ),
    "loader_workers": Selector(
        "scope",
        "=",
        "workers",
        ("run_rank:stabmon_process_memory_bytes:min30m", "StabmonHostMemoryLeak"),
        "the data loader workers' memory, apart from the training process's own",
    ),
}

#: The thresholds of the shipped rules; the comment above each rule says why its value.
THRESHOLDS: dict[str, Threshold] = {
    "stall_heartbeat_seconds": Threshold(
        1800,
        (
            ("StabmonTrainingStalled", "time() - stabmon_last_step_timestamp_seconds > {}"),
            ("StabmonTrainingStalled", "* 0 + {}"),
        ),
        "a rank with no watchdog, or a record without its own limit, is stalled after this "
        "long without a step",
    ),
    "daemon_poll_stale_seconds": Threshold(
        120,
        (("StabmonDaemonDown", '{poller="processes"} > {}'),),
        "a daemon whose process poller has not finished a poll for this long is stuck",
    ),
    "straggler_ratio": Threshold(
        1.2,
        (
            ("StabmonStragglerRank", "ratio_to_run_median10m > {})"),
            ("StabmonTrainingSlowdown", "ratio_to_run_median10m > {})"),
        ),
        "a rank this many times its run's median step time (over 10 minutes) is a straggler; "
        "the slowdowns of its run are then not paged apart",
    ),
    "gpu_underutilized_ratio": Threshold(
        0.5,
        (("StabmonGPUUnderutilized", "avg_over_time(stabmon_gpu_utilization_ratio[15m]) < {}"),),
        "mean utilization over 15 minutes below which a training GPU is mostly idle",
    ),
    "thermal_throttle_share": Threshold(
        0.5,
        (("StabmonGPUThermalThrottling", "[5m]) > {}"),),
        "share of 5 minutes a GPU is throttled",
    ),
    "amp_loss_scale_floor": Threshold(
        1,
        (("StabmonAmpLossScaleCollapse", "stabmon_amp_loss_scale <= {}"),),
        "a loss scale at or below this cannot represent fp16 gradients",
    ),
    "amp_skipped_share": Threshold(
        0.01,
        (("StabmonAmpLossScaleCollapse", "increase(stabmon_amp_skipped_steps_total[30m])) > {}"),),
        "share of steps GradScaler skipped in 30 minutes (a healthy run skips about 0.05%)",
    ),
    "amp_skipped_steps_min": Threshold(
        10,
        (("StabmonAmpLossScaleCollapse", "increase(stabmon_amp_skipped_steps_total[30m]) >= {}"),),
        "skipped steps in 30 minutes before their share counts",
    ),
    "memory_used_share": Threshold(
        0.5,
        (
            ("StabmonMemoryExhaustionForecast", "/ stabmon_gpu_memory_total_bytes > {}"),
            ("StabmonMemoryExhaustionForecast", "node:stabmon_process_memory_bytes:ratio > {}"),
        ),
        "share of the memory in use above which a 72-hour forecast warns",
    ),
    "leak_epoch_growth": Threshold(
        0.005,
        tuple(
            (alert, f"[{window}] offset {offset}) > {{}}")
            for alert in ("StabmonDeviceMemoryLeak", "StabmonHostMemoryLeak")
            for window, offset in (
                ("2h", "2h"),
                ("2h", "4h"),
                ("2h", "6h"),
                ("5h30m", "6h"),
                ("5h30m", "12h"),
            )
        ),
        "growth, as a share of the baseline, in each of three 2-hour (or 6-hour) windows",
    ),
    "leak_fast_growth": Threshold(
        0.02,
        tuple(
            (alert, f"[2h] offset {offset}) > {{}}")
            for alert in ("StabmonDeviceMemoryLeak", "StabmonHostMemoryLeak")
            for offset in ("30m", "1h")
        ),
        "growth, as a share of the baseline, in each of the last two half hours",
    ),
    "leak_halfhour_floor_ratio": Threshold(
        1.01,
        tuple(
            ("StabmonHostMemoryLeak", f"> {{}} * last_over_time(run_rank:{series}:min30m[10m]")
            for series in ("stabmon_host_memory_rss_bytes", "stabmon_process_memory_bytes")
        ),
        "each half hour's memory floor over the one before (2%/h or faster pages within 3 h)",
    ),
    "leak_workers_growth_6h": Threshold(
        0.05,
        (("StabmonHostMemoryLeak", "[1h30m] offset 4h) - 1 > {}"),),
        "data loader workers' growth over 6 hours, with every 2-hour floor rising",
    ),
}


class SourceError(Exception):
    """A source the mixin cannot be made from (or a --config it cannot apply)."""


def _dump(header: str, document: Mapping[str, Any]) -> str:
    body = yaml.dump(document, Dumper=BlockDumper, sort_keys=False, allow_unicode=True, width=100)
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comments + body


def _number(value: float) -> str:
    """A threshold as PromQL writes it (1800, 0.5, 1.01)."""
    return f"{value:g}"


def normalized(expr: str) -> str:
    """A PromQL expression without its comments, whitespace runs as one space."""
    without_comments = re.sub(r"#[^\n]*", "", expr)
    return " ".join(without_comments.split())


def rule_name(rule: Mapping[str, Any]) -> str:
    return str(rule.get("alert") or rule.get("record"))


def _fragment_pattern(fragment: str) -> re.Pattern[str]:
    """``fragment`` (``{}`` for the value) as a regex over raw PromQL: any whitespace between
    tokens, comments left alone; the value is group 1."""
    before, after = fragment.split("{}")

    def loose(text: str) -> str:
        return r"\s+".join(re.escape(part) for part in text.split(" "))

    return re.compile(loose(before) + r"([0-9.e+-]+)" + loose(after))


def load_groups(rules_file: Path = RULES_FILE) -> list[dict[str, Any]]:
    document = yaml.safe_load(rules_file.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or not isinstance(document.get("groups"), list):
        raise SourceError(f"{rules_file}: expected a Prometheus rules file with a 'groups' list")
    groups: list[dict[str, Any]] = document["groups"]
    return groups


def check_runbooks(groups: Sequence[Mapping[str, Any]], runbooks: Path = RUNBOOKS) -> None:
    """Every alert links its own section of docs/runbooks.md, which exists."""
    sections = set(re.findall(r"^## (\S+)$", runbooks.read_text(encoding="utf-8"), re.M))
    for group in groups:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            name = rule["alert"]
            url = rule.get("annotations", {}).get("runbook_url")
            if url != RUNBOOK_BASE + name.lower():
                raise SourceError(
                    f"alert {name} in group {group['name']}: runbook_url must be "
                    f"{RUNBOOK_BASE}{name.lower()}, got {url!r}"
                )
            if name not in sections:
                raise SourceError(f"alert {name}: docs/runbooks.md has no '## {name}' section")


def _rules_named(groups: Sequence[Mapping[str, Any]], name: str) -> list[dict[str, Any]]:
    return [rule for group in groups for rule in group["rules"] if rule_name(rule) == name]


def apply_config(
    groups: list[dict[str, Any]], overrides: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The groups with ``overrides`` (the shape of config.yaml, any subset) put in place."""
    unknown = set(overrides) - {"selectors", "thresholds", "alerts"}
    if unknown:
        raise SourceError(f"--config: unknown sections {sorted(unknown)}")
    groups = copy.deepcopy(groups)
    for name, value in (overrides.get("selectors") or {}).items():
        selector = SELECTORS.get(name)
        if selector is None:
            raise SourceError(f"--config: unknown selector {name!r}; known: {sorted(SELECTORS)}")
        if not isinstance(value, str) or '"' in value or "\\" in value:
            raise SourceError(f"--config: selector {name} must be a string without quotes")
        for rule_name_ in selector.rules:
            for rule in _rules_named(groups, rule_name_):
                rule["expr"] = rule["expr"].replace(selector.matcher(), selector.matcher(value))
    for name, value in (overrides.get("thresholds") or {}).items():
        threshold = THRESHOLDS.get(name)
        if threshold is None:
            raise SourceError(f"--config: unknown threshold {name!r}; known: {sorted(THRESHOLDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SourceError(f"--config: threshold {name} must be a number, got {value!r}")
        for rule_name_, fragment in threshold.uses:
            pattern = _fragment_pattern(fragment)
            for rule in _rules_named(groups, rule_name_):

                def swap(match: re.Match[str], new: str = _number(value)) -> str:
                    start, end = match.span(1)
                    whole = match.group(0)
                    return whole[: start - match.start()] + new + whole[end - match.start() :]

                rule["expr"] = pattern.sub(swap, rule["expr"])
    for alert, settings in (overrides.get("alerts") or {}).items():
        rules = [rule for rule in _rules_named(groups, alert) if "alert" in rule]
        if not rules:
            raise SourceError(f"--config: no alert named {alert!r}")
        if not isinstance(settings, dict) or set(settings) - {"for", "severity"}:
            raise SourceError(f"--config: alert {alert} takes only 'for' and 'severity'")
        durations = settings.get("for")
        if isinstance(durations, list) and len(durations) != len(rules):
            raise SourceError(f"--config: alert {alert} has {len(rules)} rules, one for: each")
        for index, rule in enumerate(rules):
            if durations is not None:
                rule["for"] = str(durations[index] if isinstance(durations, list) else durations)
            if "severity" in settings:
                rule.setdefault("labels", {})["severity"] = str(settings["severity"])
    return groups


def config_document(groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """config.yaml: the selectors and thresholds, as the (possibly overridden) rules use them."""
    alerts: dict[str, dict[str, Any]] = {}
    for group in groups:
        for rule in group["rules"]:
            if "alert" in rule:
                entry = alerts.setdefault(
                    rule["alert"],
                    {"severity": rule["labels"]["severity"], "for": [], "group": group["name"]},
                )
                entry["for"].append(str(rule.get("for", "0s")))
    for entry in alerts.values():
        # One alert over several rules (StabmonTrainingStalled's in-process and daemon legs)
        # lists each rule's for:, in the rules' order.
        entry["for"] = entry["for"][0] if len(set(entry["for"])) == 1 else entry["for"]
    return {
        "selectors": {
            name: {
                "matcher": selector.matcher(current_selector(groups, selector)),
                "used_by": list(selector.rules),
                "why": selector.why,
            }
            for name, selector in SELECTORS.items()
        },
        "thresholds": {
            name: {
                "value": current_threshold(groups, threshold),
                "used_by": sorted({rule for rule, _ in threshold.uses}),
                "why": threshold.why,
            }
            for name, threshold in THRESHOLDS.items()
        },
        "alerts": alerts,
    }


def current_selector(groups: Sequence[Mapping[str, Any]], selector: Selector) -> str:
    """The value the rules' matchers on the selector's label (and operator) hold: one value,
    in every rule the selector names, or SourceError."""
    pattern = re.compile(rf'\b{re.escape(selector.label)}{re.escape(selector.op)}"([^"]*)"')
    found: set[str] = set()
    for name in selector.rules:
        rules = _rules_named(groups, name)
        values = {v for rule in rules for v in pattern.findall(normalized(rule["expr"]))}
        if not values:
            raise SourceError(f'rule {name} has no {selector.label}{selector.op}"..." matcher')
        found |= values
    if len(found) != 1:
        raise SourceError(
            f"the rules' {selector.label}{selector.op} matchers differ: {sorted(found)}"
        )
    return found.pop()


def current_threshold(groups: Sequence[Mapping[str, Any]], threshold: Threshold) -> float:
    """The value every place of ``threshold`` holds in the rules: one number, found in every
    rule it names and in as many places there as the number is written, or SourceError (a
    place no fragment covers would keep its old value under --config)."""
    found: list[str] = []
    matched: dict[str, int] = {}
    for name, fragment in threshold.uses:
        pattern = _fragment_pattern(fragment)
        values = [
            value
            for rule in _rules_named(groups, name)
            for value in pattern.findall(normalized(rule["expr"]))
        ]
        if not values:
            raise SourceError(f"rule {name} has no {fragment.replace('{}', 'N')!r}")
        found.extend(values)
        matched[name] = matched.get(name, 0) + len(values)
    numbers = {float(value) for value in found}
    if len(numbers) != 1:
        raise SourceError(f"a threshold's places in the rules differ: {sorted(numbers)}")
    value = numbers.pop()
    literal = re.compile(rf"(?<![\w.:]){re.escape(_number(value))}(?![\w.])")
    for name, count in matched.items():
        written = sum(
            len(literal.findall(normalized(rule["expr"]))) for rule in _rules_named(groups, name)
        )
        if written != count:
            raise SourceError(
                f"rule {name} writes {_number(value)} {written} times, the threshold's "
                f"fragments find {count}"
            )
    return int(value) if value.is_integer() else value


def render_all(
    overrides: Mapping[str, Any] | None = None,
    rules_file: Path = RULES_FILE,
    dashboards_dir: Path = DASHBOARDS_DIR,
) -> dict[str, str]:
    """``{path relative to the mixin directory: text}`` for every file of the mixin."""
    groups = load_groups(rules_file)
    if overrides:
        groups = apply_config(groups, overrides)
    check_runbooks(groups)
    alerting = [g for g in groups if any("alert" in rule for rule in g["rules"])]
    recording = [g for g in groups if g not in alerting]
    source = rules_file.relative_to(ROOT) if rules_file.is_relative_to(ROOT) else rules_file
    edit = f"edit {source} (its comments say why each value) and rerun the script, never this file."
    dashboards = sorted(dashboards_dir.glob("*.json"))
    if not dashboards:
        raise SourceError(f"{dashboards_dir}: no dashboard JSON; run python dashboards/generate.py")
    rendered = {
        ALERTS_OUTPUT: _dump(
            f"Generated by deploy/mixin/generate.py from {source}:\n{edit}\n"
            "The groups that hold alerts, whole: each alert reads series recorded earlier in its\n"
            "own group. Load as they are (promtool check rules, mimirtool rules load).",
            {"groups": alerting},
        ),
        RULES_OUTPUT: _dump(
            f"Generated by deploy/mixin/generate.py from {source}:\n{edit}\n"
            "The groups that only record: per-run and per-node aggregates for dashboards and "
            "a global store.",
            {"groups": recording},
        ),
        CONFIG_OUTPUT: _dump(
            "Generated by deploy/mixin/generate.py: the selectors and thresholds the rules in\n"
            "alerts.yaml and rules.yaml use, each with the rules that use it, and every alert's\n"
            "for: and severity. No job or instance selector: the rules select by metric name and\n"
            "stabmon's labels only. To change a value, copy the entries you change into a file\n"
            "of this shape (value only: 'thresholds: {straggler_ratio: 1.3}') and run\n"
            "python deploy/mixin/generate.py --config that-file --out your-mixin.",
            config_document(groups),
        ),
    }
    for path in dashboards:
        rendered[f"{DASHBOARDS_OUTPUT}/{path.name}"] = path.read_text(encoding="utf-8")
    return rendered


def stale(rendered: Mapping[str, str], directory: Path = MIXIN_DIR) -> list[str]:
    """The mixin's files in ``directory`` that are missing, differ, or have no source."""
    top = {name: text for name, text in rendered.items() if "/" not in name}
    nested = {
        name.split("/", 1)[1]: text
        for name, text in rendered.items()
        if name.startswith(DASHBOARDS_OUTPUT + "/")
    }
    return stale_files(top, directory) + [
        f"{DASHBOARDS_OUTPUT}/{name}"
        for name in stale_files(nested, directory / DASHBOARDS_OUTPUT, owned_glob="*.json")
    ]


def write(rendered: Mapping[str, str], directory: Path = MIXIN_DIR) -> list[str]:
    """Bring ``directory`` in step with ``rendered``; returns the names it changed."""
    changed = stale(rendered, directory)
    (directory / DASHBOARDS_OUTPUT).mkdir(parents=True, exist_ok=True)
    for name in changed:
        target = directory / name
        if name in rendered:
            target.write_text(rendered[name], encoding="utf-8")
        else:
            target.unlink()  # a dashboard whose source is gone
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a generated file is stale; write nothing"
    )
    parser.add_argument("--out", type=Path, default=MIXIN_DIR, help="default: %(default)s")
    parser.add_argument(
        "--config", type=Path, help="a YAML file of selectors, thresholds and alerts to change"
    )
    args = parser.parse_args(argv)
    if args.config is not None and args.out.resolve() == MIXIN_DIR:
        parser.error("--config needs --out: deploy/mixin holds the shipped values")
    try:
        overrides = None
        if args.config is not None:
            overrides = yaml.safe_load(args.config.read_text(encoding="utf-8")) or {}
            if not isinstance(overrides, dict):
                raise SourceError(f"{args.config}: expected a mapping of sections")
        rendered = render_all(overrides)
    except (SourceError, OSError, yaml.YAMLError) as error:
        sys.stderr.write(f"ERROR: {error}\n")
        return 2
    if args.check:
        return check_fresh(
            stale(rendered, args.out),
            args.out,
            what="mixin files",
            command="python deploy/mixin/generate.py",
        )
    for name in write(rendered, args.out):
        print(f"wrote {args.out / name}" if name in rendered else f"removed {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
