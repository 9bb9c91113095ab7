"""Configuration of a stabmon Monitor: the ``Config`` dataclasses and ``load_config``.

``load_config`` builds one frozen ``Config`` from up to four sources; a later source
wins key by key:

1. the defaults declared on the dataclasses below;
2. the YAML file ``source`` (when ``source`` is None, the file named by the
   environment variable ``STABMON_CONFIG``, if set), or a mapping passed as ``source``;
3. environment variables: ``STABMON_RUN_ID``, ``STABMON_PORT`` and ``STABMON_DIR``
   (empty values are ignored);
4. ``overrides``: the keyword arguments of ``stabmon.attach``.

Why this order: the YAML file is checked in and shared by the team, so it is the
baseline. The launcher (torchrun, SLURM, a pod spec) knows what the file cannot,
such as this job's run id or a free port, and says it through the environment. The
training script is the most specific place: what it passes explicitly is never
overridden from outside. A ``Config`` passed as ``source`` is taken as already
resolved: only ``overrides`` apply to it.

Usage::

    config = load_config("run.yaml", overrides={"measure_every": 10, "daemon.interval": 2})
    logger.info("stabmon config: %s", config.to_dict())

Each field declares its type in its annotation and its constraint in its metadata
(``gt``, ``ge``, ``lt``, ``le``, ``nonempty``, ``max_length``, and ``env`` for the
variable that sets it; see ``_meta``). One generic checker reads them, for values
from every source and on direct construction, so a new field or a nested section
needs no loader code.
Errors are ``ConfigError`` and read ``<dotted key> in <source>: <problem>``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import os
import re
import reprlib
import stat
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import yaml

from stabmon.errors import ConfigError
from stabmon.rundir import RUN_ID_PATTERN

__all__ = ["Config", "DaemonConfig", "ThroughputConfig", "load_config"]

_MAX_FILE_BYTES = 1024 * 1024  # 1 MiB: a config is a few dozen lines
# A config is a few dozen flat keys; anything far beyond is an attack or an accident
# (a 414-byte alias bomb expands to billions of nodes when walked).
_MAX_YAML_NODES = 10_000
_MAX_YAML_ALIASES = 100
_MAX_YAML_DEPTH = 32
_CONFIG_FILE_VARIABLE = "STABMON_CONFIG"
_MAPPING_SOURCE = "config mapping"
_OVERRIDE_SOURCE = "attach() keyword argument"
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_TEXT_FORMS = {bool: "true, false, yes, no, 1 or 0", int: "a decimal integer", float: "a number"}
_TRUE_WORDS = frozenset({"true", "yes", "1"})
_FALSE_WORDS = frozenset({"false", "no", "0"})
_DECIMAL = re.compile(r"[+-]?[0-9]+")
# Metadata keys of numeric bounds, in the order messages name them.
_BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "gt": (operator.gt, ">"),
    "ge": (operator.ge, ">="),
    "lt": (operator.lt, "<"),
    "le": (operator.le, "<="),
}


class _Section:
    """What every config section shares: validation on construction, and ``to_dict``."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        # Config(port=-1) must fail as load_config would, not later inside a thread.
        source = f"{type(self).__name__}()"
        for name, spec in _specs(type(self)).items():
            value = getattr(self, name)
            if _is_section(spec.kind):
                if not isinstance(value, spec.kind):
                    raise ConfigError(
                        f"expected a {spec.kind.__name__}, got {_show(value, typed=True)}; "
                        "use load_config() to build a config from a mapping",
                        key=name,
                        source=source,
                        allowed=spec.kind.__name__,
                    )
                continue
            checked = _check_value(spec, value, key=name, source=source)
            if type(checked) is not type(value):
                # An int given for a float field is stored as a float; frozen, hence object.
                object.__setattr__(self, name, checked)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as a plain nested dict of JSON-able values, e.g. for logging."""
        return dataclasses.asdict(self)


def _meta(
    doc: str,
    *,
    env: str | None = None,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    nonempty: bool = False,
    max_length: int | None = None,
    choices: tuple[str, ...] | None = None,
    pattern: str | None = None,
) -> dict[str, Any]:
    """Field metadata: the doc and the constraint (keywords, so a misspelt rule fails)."""
    rules = {
        "env": env,
        "gt": gt,
        "ge": ge,
        "lt": lt,
        "le": le,
        "max_length": max_length,
        "choices": choices,
        "pattern": pattern,
    }
    meta = {"doc": doc} | {name: rule for name, rule in rules.items() if rule is not None}
    return meta | ({"nonempty": True} if nonempty else {})


@dataclass(frozen=True, kw_only=True)
class DaemonConfig(_Section):
    """The node daemon (``stabmon daemon``): one per machine, polling NVML and psutil."""

    port: int = field(
        default=9399,
        metadata=_meta(
            "HTTP port of the daemon's exporter (below the ranks' 9400 + local rank); "
            "0 picks a free port.",
            ge=0,
            le=65535,
        ),
    )
    address: str = field(
        default="0.0.0.0",
        metadata=_meta("Bind address of the daemon's exporter.", nonempty=True),
    )
    interval: float = field(
        default=5.0,
        metadata=_meta("Seconds between two NVML/psutil polls.", gt=0),
    )


#: Dtypes the peak-FLOP/s table knows (stabmon.probes.flops).
MFU_DTYPES: tuple[str, ...] = ("auto", "fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True, kw_only=True)
class ThroughputConfig(_Section):
    """Throughput, MFU and the slowdown rule (docs/throughput.md)."""

    flops_per_step: float | None = field(
        default=None,
        metadata=_meta(
            "FLOPs of one optimizer step on this rank (forward and backward of every "
            "micro-batch); None counts them once with FlopCounterMode at flops_measure_step.",
            gt=0,
        ),
    )
    flops_measure_step: int = field(
        default=3,
        metadata=_meta(
            "The step (counted from attach) whose forward and backward are counted once with "
            "FlopCounterMode, after warm-up; 0 never counts (give flops_per_step instead).",
            ge=0,
        ),
    )
    peak_flops: float | None = field(
        default=None,
        metadata=_meta(
            "Peak dense FLOP/s of one device for MFU; None looks the GPU up in the built-in "
            "table. MFU is exported only on CUDA devices.",
            gt=0,
        ),
    )
    mfu_dtype: str = field(
        default="auto",
        metadata=_meta(
            "Which peak applies: 'auto' reads the autocast dtype (else the parameters' dtype; "
            "fp32 matmuls allowed to use TF32 count as tf32) at flops_measure_step.",
            choices=MFU_DTYPES,
        ),
    )
    slowdown_threshold: float = field(
        default=0.10,
        metadata=_meta(
            "Relative growth of the mean step time against the run's recent baseline that "
            "counts as slow (0.10 = 10% slower).",
            gt=0,
        ),
    )
    slowdown_hold_seconds: float = field(
        default=300.0,
        metadata=_meta(
            "How long every block of steps must stay slow before a slowdown anomaly.", gt=0
        ),
    )
    slowdown_baseline_seconds: float = field(
        default=600.0,
        metadata=_meta(
            "Span of recent normal blocks whose median step time is the baseline.", gt=0
        ),
    )
    slowdown_block_seconds: float = field(
        default=10.0,
        metadata=_meta(
            "Steps are judged in blocks at least this long (the mean step time of a block).",
            gt=0,
        ),
    )
    slowdown_warmup_steps: int = field(
        default=100,
        metadata=_meta(
            "Steps after attach, or after load_state_dict() (a resume), left out of the "
            "slowdown rule: compilation, cache warm-up, loader start.",
            ge=0,
        ),
    )
    record_seconds: float = field(
        default=60.0,
        metadata=_meta(
            "Interval of the throughput records in the event log (phase seconds, steps, "
            "samples, FLOPs), which `stabmon report` turns into goodput.",
            gt=0,
        ),
    )


@dataclass(frozen=True, kw_only=True)
class Config(_Section):
    """Everything a Monitor can be told; docs/config.md is the reference."""

    run_id: str | None = field(
        default=None,
        metadata=_meta(
            "Run label on every series; None means an id generated once per process.",
            env="STABMON_RUN_ID",
            nonempty=True,
            max_length=128,
            pattern=RUN_ID_PATTERN,
        ),
    )
    port: int = field(
        default=9400,
        metadata=_meta(
            "Base HTTP port of the exporter, which listens on port + LOCAL_RANK; "
            "0 picks a free port.",
            env="STABMON_PORT",
            ge=0,
            le=65535,
        ),
    )
    address: str = field(
        default="0.0.0.0",
        metadata=_meta("Bind address of the exporter.", nonempty=True),
    )
    port_attempts: int = field(
        default=8,
        metadata=_meta(
            "How many ports to try, counting up, when the first is busy.", ge=1, le=1000
        ),
    )
    scrape_cache_seconds: float = field(
        default=1.0,
        metadata=_meta(
            "A scrape body is reused for this long: a flood of scrapes then costs training one "
            "body per interval (ranks and daemon). 0 builds one per scrape.",
            ge=0,
            le=60,
        ),
    )
    serve_metrics: bool = field(
        default=True,
        metadata=_meta("Start the HTTP exporter at all."),
    )
    device_check: str = field(
        default="warn",
        metadata=_meta(
            "Where parameters, buffers, optimizer state and forward inputs live: 'warn' logs "
            "and counts a device_mismatch anomaly, 'raise' raises DeviceMismatchError, 'off' "
            "skips the check (models split over devices on purpose).",
            choices=("warn", "raise", "off"),
        ),
    )
    measure_every: int = field(
        default=1,
        metadata=_meta("Measure gradients every N optimizer steps.", ge=1),
    )
    judge_seconds: float = field(
        default=0.05,
        metadata=_meta(
            "How long measured gradients and losses may wait on the host before they are "
            "checked (non-finite values, spikes, dead gradients) and exported: at the first "
            "step end this long after the last check, or by a background thread (within 0.25 s "
            "more) when no step ends for this long and twice the median step. Checked in "
            "batches, fast steps share the host-side work. 0 checks each result as soon as it "
            "is on the host. Epoch ends, named phases, state_dict(), "
            "load_state_dict(), detach() and interpreter exit check everything on the host.",
            ge=0,
        ),
    )
    module_depth: int = field(
        default=1,
        metadata=_meta("Module-name depth of gradient-norm groups (1 = top-level children).", ge=1),
    )
    max_modules: int = field(
        default=32,
        metadata=_meta(
            "Most module groups exported (bounded label cardinality); the rest are summed "
            "into 'other'.",
            ge=1,
            le=1024,
        ),
    )
    window_steps: int = field(
        default=1000,
        metadata=_meta(
            "When neither epoch_end() nor track() marks epochs, an epoch is this many steps.",
            ge=1,
        ),
    )
    spike_threshold: float = field(
        default=6.0,
        metadata=_meta("Z-score above which a loss or gradient-norm value is a spike.", gt=0),
    )
    spike_warmup_steps: int = field(
        default=50,
        metadata=_meta("Values seen before spikes can be flagged.", ge=1),
    )
    spike_ema_alpha: float = field(
        default=0.02,
        metadata=_meta("EMA weight of the spike statistics.", gt=0, lt=1),
    )
    loss_spike_min_delta: float = field(
        default=1e-4,
        metadata=_meta(
            "A loss spike must also exceed the running mean by this much (absolute): the float "
            "noise of a converged loss is no spike, whatever its z-score.",
            ge=0,
        ),
    )
    loss_spike_min_ratio: float = field(
        default=1.5,
        metadata=_meta(
            "A loss spike must also be at least this multiple of the running mean (when it is "
            "positive).",
            ge=1,
        ),
    )
    grad_spike_min_ratio: float = field(
        default=10.0,
        metadata=_meta(
            "A gradient-norm spike must also be at least this multiple of the running "
            "(geometric) mean of the pre-clip norm.",
            ge=1,
        ),
    )
    spike_episode_gap: int = field(
        default=20,
        metadata=_meta(
            "Spikes (and non-finite values) less than this many measured values apart are one "
            "episode: one anomaly, one record.",
            ge=1,
        ),
    )
    leak_rule: str = field(
        default="both",
        metadata=_meta(
            "Which leak rule raises memory_leak: 'trend' (a robust slope over memory floors "
            "sampled every leak_sample_steps steps, any loop shape), 'epoch_windows' (the "
            "leak_threshold x leak_windows rule over epoch-end samples) or 'both'.",
            choices=("trend", "epoch_windows", "both"),
        ),
    )
    leak_sample_steps: int = field(
        default=10,
        metadata=_meta(
            "Steps between two memory samples of the trend leak rule (host RSS, CUDA "
            "allocated bytes).",
            ge=1,
        ),
    )
    leak_trend_bucket: int = field(
        default=10,
        metadata=_meta(
            "Samples per floor of the trend rule: only each bucket's minimum is kept.", ge=1
        ),
    )
    leak_trend_window: int = field(
        default=24,
        metadata=_meta(
            "Floors the trend rule judges (a sliding window; it judges from half of it).",
            ge=8,
            le=256,
        ),
    )
    leak_trend_z: float = field(
        default=4.0,
        metadata=_meta("Mann-Kendall z score the trend rule needs (one-sided).", gt=0),
    )
    leak_trend_min_growth: float = field(
        default=0.02,
        metadata=_meta(
            "Growth over the trend window, relative to its level, that the trend rule needs "
            "(0.02 = +2%; its second half must grow by half of it).",
            ge=0,
        ),
    )
    leak_trend_warmup_steps: int = field(
        default=200,
        metadata=_meta("Steps before the trend rule takes memory samples.", ge=0),
    )
    leak_threshold: float = field(
        default=0.03,
        metadata=_meta(
            "Relative memory growth per window that counts toward a leak (0.03 = +3%).", gt=0
        ),
    )
    leak_windows: int = field(
        default=3,
        metadata=_meta("Consecutive growing windows that make a leak suspected.", ge=1),
    )
    leak_window_epochs: int = field(
        default=10,
        metadata=_meta("Epochs per leak window.", ge=1),
    )
    leak_warmup_epochs: int = field(
        default=1,
        metadata=_meta("Epochs ignored before the baseline epoch is taken.", ge=0),
    )
    dead_grad_steps: int = field(
        default=100,
        metadata=_meta(
            "Measured steps for which a trainable parameter's gradient must stay exactly zero "
            "(or None) before its module is reported as a dead branch.",
            ge=1,
        ),
    )
    amp_skip_run: int = field(
        default=8,
        metadata=_meta(
            "Consecutive optimizer steps skipped by GradScaler (Inf/NaN gradients) that make a "
            "nonfinite_grad anomaly; isolated skips are GradScaler's normal scale search.",
            ge=1,
        ),
    )
    memory_snapshot_steps: int = field(
        default=0,
        metadata=_meta(
            "When the leak rule fires on a CUDA device, record the allocator's history for this "
            "many steps and dump a snapshot into the run directory (0: off).",
            ge=0,
        ),
    )
    stall_seconds: float | None = field(
        default=None,
        metadata=_meta(
            "No completed step for this long means stalled; None means the larger of 60 s "
            "and 10 x the median step time.",
            gt=0,
        ),
    )
    phase_stall_seconds: float = field(
        default=3600.0,
        metadata=_meta(
            "Stall limit inside named phases (eval, checkpoint) and before the first step.",
            gt=0,
        ),
    )
    stall_action: str = field(
        default="none",
        metadata=_meta(
            "What a rank does once it stalls, after recording its hang evidence (stacks, phase, "
            "step, collectives issued) in the event log: 'none' nothing more, 'dump' also "
            "writes rank-<rank>.stall.txt in the run directory, 'raise' raises "
            "stabmon.TrainingStalled in the main thread at its next Python instruction, 'exit' "
            "ends the process with status 75 after stall_grace_seconds unless a step completes.",
            choices=("none", "dump", "raise", "exit"),
        ),
    )
    stall_grace_seconds: float = field(
        default=30.0,
        metadata=_meta(
            "With stall_action 'exit': seconds between the stall and the exit, in which the "
            "ranks of a node compare their evidence and name the culprit.",
            ge=0,
        ),
    )
    sample_seconds: float = field(
        default=5.0,
        metadata=_meta("Interval of background sampling (memory now, heartbeat).", gt=0),
    )
    sample_every: int = field(
        default=50,
        metadata=_meta(
            "Write a step_sample record (loss, gradient norms, step time, input wait, AMP "
            "scale) to the event log every N steps, for `stabmon report`.",
            ge=1,
        ),
    )
    run_dir: str | None = field(
        default=None,
        metadata=_meta(
            "Directory for run records and event logs; None means /var/tmp/stabmon.",
            env="STABMON_DIR",
            nonempty=True,
        ),
    )
    event_log: bool = field(
        default=True,
        metadata=_meta("Write anomalies and epoch summaries as JSON lines in the run directory."),
    )
    log_rate_per_minute: int = field(
        default=10,
        metadata=_meta("Log lines per anomaly kind per minute (the event log keeps all).", ge=0),
    )
    tls_certfile: str | None = field(
        default=None,
        metadata=_meta(
            "PEM certificate (chain) for HTTPS on the exporters (ranks and daemon); None "
            "serves plain HTTP. Unreadable, no endpoint is served (fail closed).",
            nonempty=True,
        ),
    )
    tls_keyfile: str | None = field(
        default=None,
        metadata=_meta(
            "PEM private key of tls_certfile; None when the certificate file holds the key.",
            nonempty=True,
        ),
    )
    basic_auth_file: str | None = field(
        default=None,
        metadata=_meta(
            "File whose first line is username:password; set, every scrape needs HTTP basic "
            "auth (401 without). Unreadable, no endpoint is served (fail closed).",
            nonempty=True,
        ),
    )
    daemon: DaemonConfig = field(
        default_factory=DaemonConfig,
        metadata=_meta("The node daemon section: daemon.port, daemon.address, daemon.interval."),
    )
    throughput: ThroughputConfig = field(
        default_factory=ThroughputConfig,
        metadata=_meta("Throughput, MFU and slowdown detection: throughput.<key>."),
    )


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Build the effective ``Config`` from defaults, ``source``, ``env`` and ``overrides``.

    ``source`` is a YAML file path, a mapping shaped like the file, a ``Config``, or
    None (then the file in ``STABMON_CONFIG``, if set). ``overrides`` take plain keys
    (``port=9500``), nested sections (``daemon={"interval": 2}``) or dotted keys
    (``{"daemon.interval": 2}``). ``env`` defaults to ``os.environ``.

    Raises ``ConfigError`` naming the dotted key and its source for an unknown key, a
    value of the wrong type or out of range, and a file that is missing, too large
    or not a YAML mapping.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if not isinstance(environ, Mapping):
        raise ConfigError(
            f"expected a mapping of variable names to values, got {_show(environ, typed=True)}",
            key=None,
            source="load_config(env=...)",
            allowed="a mapping",
        )
    layers: list[dict[str, Any]] = []
    if isinstance(source, Config):
        base = source
    else:
        base = Config()
        layers.append(_read_source(source, environ))
        layers.append(_read_env(Config, environ))
    if overrides is not None:
        if not isinstance(overrides, Mapping):
            raise ConfigError(
                f"expected a mapping of keys to values, got {_show(overrides, typed=True)}",
                key=None,
                source=_OVERRIDE_SOURCE,
                allowed="a mapping",
            )
        layers.append(_flatten(Config, overrides, source=_OVERRIDE_SOURCE))
    values: dict[str, Any] = {}
    for layer in layers:
        values.update(layer)
    return _apply(base, values)


@dataclass(frozen=True)
class _Spec:
    """One field as the checker sees it: a bool/int/float/str or section type, and rules."""

    kind: type
    optional: bool
    meta: Mapping[str, Any]


_SectionT = TypeVar("_SectionT", bound=_Section)


def _specs(cls: type[_Section]) -> dict[str, _Spec]:
    hints = typing.get_type_hints(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        members = typing.get_args(hints[f.name]) or (hints[f.name],)
        kinds = [member for member in members if member is not type(None)]
        if len(kinds) != 1 or not (kinds[0] in _TYPE_NAMES or _is_section(kinds[0])):
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported annotation {hints[f.name]}")
        specs[f.name] = _Spec(kinds[0], len(kinds) != len(members), f.metadata)
    return specs


def _is_section(kind: object) -> typing.TypeGuard[type[_Section]]:
    return isinstance(kind, type) and issubclass(kind, _Section)


def _read_source(
    source: str | os.PathLike[str] | Mapping[str, Any] | None, environ: Mapping[str, str]
) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return _flatten(Config, source, source=_MAPPING_SOURCE)
    if source is not None:
        if not isinstance(source, (str, os.PathLike)) or not isinstance(os.fspath(source), str):
            raise ConfigError(
                "expected a YAML file path, a mapping or a Config, got "
                + _show(source, typed=True),
                key=None,
                source="load_config(source=...)",
                allowed="str, os.PathLike[str], Mapping, Config or None",
            )
        path, advice = os.fspath(source), "check the path"
    else:
        path = environ.get(_CONFIG_FILE_VARIABLE, "")
        if not path:
            return {}
        advice = f"check environment variable {_CONFIG_FILE_VARIABLE}, or unset it"
    return _flatten(Config, _read_yaml(path, advice), source=path)


def _read_yaml(path: str, advice: str) -> Mapping[Any, Any]:
    too_large = f"config file is larger than 1 MiB, too large for a stabmon config; {advice}"
    if "\0" in path or not _encodable(path):
        raise ConfigError(
            f"the path holds a NUL byte or is not valid UTF-8; {advice}",
            key=None,
            source=_show(path),
        )
    try:
        # Never blocking: a FIFO named as the config would hang attach() for ever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"config file not found; {advice}", key=None, source=path) from None
    except OSError as error:
        raise ConfigError(
            f"cannot read config file ({error.strerror or error}); {advice}",
            key=None,
            source=path,
        ) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError(
                f"cannot read config file (Is a directory); {advice}", key=None, source=path
            )
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(
                f"not a regular file (a FIFO or device); {advice}",
                key=None,
                source=path,
            )
        # Refuse before reading: a wrong path can name a log or a dataset.
        if info.st_size > _MAX_FILE_BYTES:
            raise ConfigError(too_large, key=None, source=path)
        chunks: list[bytes] = []
        size = 0
        while size <= _MAX_FILE_BYTES:
            chunk = os.read(fd, _MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as error:
        raise ConfigError(
            f"cannot read config file ({error.strerror or error}); {advice}",
            key=None,
            source=path,
        ) from None
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:  # grew while read
        raise ConfigError(too_large, key=None, source=path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file is not UTF-8 text (bad byte at offset {error.start})",
            key=None,
            source=path,
        ) from None
    try:
        loader = _LimitedLoader(text)
        try:
            document = loader.get_single_data()
        finally:
            loader.dispose()
    except _TooLarge as error:
        raise ConfigError(
            f"{error}; a config is a flat list of keys", key=None, source=path
        ) from None
    except yaml.constructor.ConstructorError as error:
        raise ConfigError(
            f"unsupported YAML{_position(error)}: {error.problem}; a config holds plain "
            "strings, numbers, booleans, null and mappings, and tags such as "
            "!!python/object are not allowed",
            key=None,
            source=path,
        ) from None
    except yaml.MarkedYAMLError as error:
        raise ConfigError(
            f"malformed YAML{_position(error)}: {error.problem}", key=None, source=path
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"malformed YAML: {_show(str(error))}", key=None, source=path) from None
    except (ValueError, RecursionError, OverflowError) as error:
        # An integer of more than 4300 digits, a nesting deeper than Python's stack.
        raise ConfigError(
            f"a value cannot be read ({type(error).__name__}: {_show(str(error))})",
            key=None,
            source=path,
        ) from None
    if document is None:  # empty, or only comments
        return {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"expected a mapping of keys to values at the top level, got a "
            f"{type(document).__name__}; write one 'key: value' per line",
            key=None,
            source=path,
            allowed="a YAML mapping",
        )
    return document


class _TooLarge(Exception):
    """A YAML document over the node, alias or depth limit."""


class _LimitedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with bounded nodes, aliases and nesting, checked while composing.

    Aliases share one node, so a small file can describe a structure of billions
    of nodes (the "billion laughs"); walking it (a message that shows the value)
    is then exponential. Depth is bounded before Python's stack is.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._nodes = 0
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > _MAX_YAML_ALIASES:
                raise _TooLarge(f"more than {_MAX_YAML_ALIASES} YAML aliases (*name)")
        self._nodes += 1
        if self._nodes > _MAX_YAML_NODES:
            raise _TooLarge(f"more than {_MAX_YAML_NODES} YAML nodes")
        self._depth += 1
        try:
            if self._depth > _MAX_YAML_DEPTH:
                raise _TooLarge(f"nested more than {_MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _position(error: yaml.MarkedYAMLError) -> str:
    mark = error.problem_mark
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"


def _read_env(cls: type[_Section], environ: Mapping[str, str], prefix: str = "") -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, spec in _specs(cls).items():
        key = prefix + name
        if _is_section(spec.kind):
            values.update(_read_env(spec.kind, environ, key + "."))
            continue
        variable = spec.meta.get("env")
        text = environ.get(variable, "") if variable else ""
        if text and not isinstance(text, str):
            raise ConfigError(
                f"expected text, got {_show(text, typed=True)}",
                key=key,
                source=f"environment variable {variable}",
                allowed=_expected(spec),
            )
        if text:
            values[key] = _from_text(spec, text, key=key, source=f"environment variable {variable}")
    return values


def _from_text(spec: _Spec, text: str, *, key: str, source: str) -> Any:
    word = text.strip()
    value: Any = text
    if spec.kind is bool and word.lower() in _TRUE_WORDS | _FALSE_WORDS:
        value = word.lower() in _TRUE_WORDS
    elif spec.kind is int and _DECIMAL.fullmatch(word):
        try:
            value = int(word)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ConfigError(
                f"expected {_TEXT_FORMS[spec.kind]}, got {len(word)} digits",
                key=key,
                source=source,
                allowed=_expected(spec),
            ) from None
    elif spec.kind is float:
        try:
            value = float(word)
        except ValueError:
            pass
    if spec.kind is not str and isinstance(value, str):
        raise ConfigError(
            f"expected {_TEXT_FORMS[spec.kind]}, got {_show(text)}",
            key=key,
            source=source,
            allowed=_expected(spec),
        )
    return _check_value(spec, value, key=key, source=source)


def _flatten(
    cls: type[_Section], mapping: Mapping[Any, Any], *, source: str, prefix: str = ""
) -> dict[str, Any]:
    """Check every key and value of ``mapping`` and return them by dotted key."""
    specs = _specs(cls)
    allowed = ", ".join(prefix + name for name in sorted(specs))
    values: dict[str, Any] = {}
    for raw_key, value in mapping.items():
        if not isinstance(raw_key, str):
            raise ConfigError(
                f"keys must be strings, got {_show(raw_key, typed=True)}",
                key=prefix[:-1] or None,
                source=source,
                allowed=allowed,
            )
        name, dotted, rest = raw_key.partition(".")
        key = prefix + name
        spec = specs.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, list(specs), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ";"
            raise ConfigError(
                f"unknown key{hint} allowed: {allowed}",
                key=prefix + raw_key,
                source=source,
                allowed=allowed,
            )
        if _is_section(spec.kind):
            section = {rest: value} if dotted else _section_mapping(spec, value, key, source)
            values.update(_flatten(spec.kind, section, source=source, prefix=key + "."))
        elif dotted:
            raise ConfigError(
                f"unknown key; {key} is a single value, not a section",
                key=prefix + raw_key,
                source=source,
                allowed=allowed,
            )
        else:
            values[key] = _check_value(spec, value, key=key, source=source)
    return values


def _section_mapping(spec: _Spec, value: object, key: str, source: str) -> Mapping[Any, Any]:
    if isinstance(value, spec.kind):
        return typing.cast(_Section, value).to_dict()
    if isinstance(value, Mapping):
        return value
    raise ConfigError(
        f"expected a mapping of {key}.* keys, got {_show(value, typed=True)}",
        key=key,
        source=source,
        allowed="a mapping",
    )


def _apply(base: _SectionT, values: Mapping[str, Any], prefix: str = "") -> _SectionT:
    """Return ``base`` with the dotted ``values`` under ``prefix`` replaced."""
    changes: dict[str, Any] = {}
    for name, spec in _specs(type(base)).items():
        key = prefix + name
        if _is_section(spec.kind):
            current = getattr(base, name)
            updated = _apply(current, values, key + ".")
            if updated is not current:
                changes[name] = updated
        elif key in values:
            changes[name] = values[key]
    return dataclasses.replace(base, **changes) if changes else base


def _check_value(spec: _Spec, value: Any, *, key: str, source: str) -> Any:
    """Return ``value`` (ints widened for float fields) or raise if type or range is off."""
    if value is None and spec.optional:
        return None
    or_none = " or None" if spec.optional else ""
    accepted = (int, float) if spec.kind is float else spec.kind
    if not isinstance(value, accepted) or (spec.kind is not bool and isinstance(value, bool)):
        raise ConfigError(
            f"expected {_TYPE_NAMES[spec.kind]}{or_none}, got {_show(value, typed=True)}"
            + _quote_hint(spec, value),
            key=key,
            source=source,
            allowed=_expected(spec) + or_none,
        )
    checked = value
    if spec.kind is float:
        try:
            checked = float(typing.cast(float, value))
        except OverflowError:
            checked = math.inf
        if not math.isfinite(checked):
            raise ConfigError(
                f"expected a finite number, got {_show(value)}",
                key=key,
                source=source,
                allowed=_expected(spec) + or_none,
            )
    if isinstance(checked, str) and ("\0" in checked or not _encodable(checked)):
        raise ConfigError(
            "expected text without NUL bytes that is valid UTF-8 (a value taken from bytes "
            f"in another encoding?), got {_show(checked)}",
            key=key,
            source=source,
            allowed=_expected(spec) + or_none,
        )
    if not _within(spec.meta, checked):
        long_text = isinstance(value, str) and bool(value) and "choices" not in spec.meta
        shown = f"{len(str(value))} characters" if long_text else _show(value)
        raise ConfigError(
            f"expected {_expected(spec)}, got {shown}",
            key=key,
            source=source,
            allowed=_expected(spec) + or_none,
        )
    pattern = spec.meta.get("pattern")
    if isinstance(checked, str) and pattern is not None and not re.fullmatch(pattern, checked):
        raise ConfigError(
            "expected letters, digits, '.', '_' and '-' only, not starting with '.' (it names "
            f"a directory), got {_show(checked)}",
            key=key,
            source=source,
            allowed=f"text matching {pattern}" + or_none,
        )
    return checked


def _within(meta: Mapping[str, Any], value: Any) -> bool:
    if isinstance(value, str):
        if "choices" in meta:
            return value in meta["choices"]
        too_long = len(value) > meta.get("max_length", len(value))
        return not too_long and not (meta.get("nonempty") and not value)
    return all(compare(value, meta[name]) for name, (compare, _) in _BOUNDS.items() if name in meta)


def _expected(spec: _Spec) -> str:
    """Describe what a field accepts, e.g. 'an integer from 0 to 65535'."""
    meta = spec.meta
    if spec.kind is str:
        if "choices" in meta:
            return "one of " + ", ".join(repr(choice) for choice in meta["choices"])
        phrase = "a non-empty string" if meta.get("nonempty") else "a string"
        if "max_length" in meta:
            phrase += f" of at most {meta['max_length']} characters"
        return phrase
    phrase = _TYPE_NAMES[spec.kind]
    if "ge" in meta and "le" in meta:
        return f"{phrase} from {meta['ge']} to {meta['le']}"
    bounds = [f"{symbol} {meta[name]}" for name, (_, symbol) in _BOUNDS.items() if name in meta]
    return " ".join([phrase, " and ".join(bounds)]) if bounds else phrase


def _quote_hint(spec: _Spec, value: object) -> str:
    """Suggest dropping the quotes from a number written as text, as in ``port: "9400"``."""
    if not isinstance(value, str) or spec.kind not in (int, float):
        return ""
    if spec.kind is int:
        return "; write it without quotes" if _DECIMAL.fullmatch(value.strip()) else ""
    try:
        float(value)
    except ValueError:
        return ""
    return "; write it without quotes"


def _show(value: object, *, typed: bool = False) -> str:
    """Render a bad value for a message: short, and safe for huge integers and deep nesting.

    A container is shown two levels deep at most (reprlib): a shared, aliased or
    deeply nested structure must cost a message nothing.
    """
    if isinstance(value, int) and value.bit_length() > 64:
        text = f"<an integer of {value.bit_length()} bits>"
    else:
        try:
            text = _REPR.repr(value) if isinstance(value, _CONTAINERS) else repr(value)[:200]
        except Exception:  # a huge integer inside a list, a hostile __repr__
            text = f"<a {type(value).__name__}>"
        if len(text) > 60:
            text = text[:57] + "..."
    return f"{text} ({type(value).__name__})" if typed else text


_CONTAINERS = (list, tuple, dict, set, frozenset, Mapping)
_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxstring = _REPR.maxother = 40
