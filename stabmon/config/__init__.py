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

This module is the schema: each field declares its type in its annotation, its
default, and its doc and constraint in its metadata (``gt``, ``ge``, ``lt``, ``le``,
``nonempty``, ``max_length``, ``choices``, ``pattern``, and ``env`` for the variable
that sets it). The generic engine in ``stabmon.config.loading`` reads them, for values
from every source and on direct construction, so a new field or a nested section
needs no loader code. Errors are ``ConfigError`` and read
``<dotted key> in <source>: <problem>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The schema below keeps the engine's two names short and private to this module.
from stabmon.config.loading import Section as _Section
from stabmon.config.loading import field_meta as _meta
from stabmon.config.loading import load_sections
from stabmon.shared.rundir import RUN_ID_PATTERN

__all__ = ["AnomalyPolicyConfig", "Config", "DaemonConfig", "ThroughputConfig", "load_config"]

_CONFIG_FILE_VARIABLE = "STABMON_CONFIG"
#: Every ``*_seconds`` key (and ``daemon.interval``) is at most this (30 days): a longer
#: wait is a typo, and past ~2.9e11 s a thread's wait overflows (issue 40).
MAX_SECONDS = 30 * 86400


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
        metadata=_meta("Seconds between two NVML/psutil polls.", gt=0, le=MAX_SECONDS),
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
            "How long every block of steps must stay slow before a slowdown anomaly.",
            gt=0,
            le=MAX_SECONDS,
        ),
    )
    slowdown_baseline_seconds: float = field(
        default=600.0,
        metadata=_meta(
            "Span of recent normal blocks whose median step time is the baseline.",
            gt=0,
            le=MAX_SECONDS,
        ),
    )
    slowdown_block_seconds: float = field(
        default=10.0,
        metadata=_meta(
            "Steps are judged in blocks at least this long (the mean step time of a block).",
            gt=0,
            le=MAX_SECONDS,
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
    starvation_share: float = field(
        default=0.3,
        metadata=_meta(
            "Share of the training time spent waiting on input (on CUDA: the device idle for "
            "input) over starvation_window_seconds that is an input_starvation anomaly; the "
            "episode ends below half of it.",
            gt=0,
            lt=1,
        ),
    )
    starvation_window_seconds: float = field(
        default=30.0,
        metadata=_meta(
            "Training time (loop clock, named phases left out) over which the input-wait share "
            "is judged, in six blocks; a starvation is caught within about this long.",
            gt=0,
            le=MAX_SECONDS,
        ),
    )
    record_seconds: float = field(
        default=60.0,
        metadata=_meta(
            "Interval of the throughput records in the event log (phase seconds, steps, "
            "samples, FLOPs), which `stabmon report` turns into goodput.",
            gt=0,
            le=MAX_SECONDS,
        ),
    )


#: What each action of ``on_anomaly`` does (docs/policies.md).
POLICY_ACTIONS: tuple[str, ...] = ("none", "skip", "lr_scale", "checkpoint", "stop")
# Checked on the step's own gradients before the optimizer applies them: every action.
_BEFORE_THE_STEP = POLICY_ACTIONS
# Judged a step or more late: no skip (the step is applied); no checkpoint where the
# parameters may already be damaged when the host knows (a NaN loss, diverged replicas).
_JUDGED_LATE = ("none", "lr_scale", "checkpoint", "stop")
_DAMAGED_WHEN_KNOWN = ("none", "lr_scale", "stop")


def _action(kind: str, choices: tuple[str, ...], when: str) -> Any:
    return field(
        default="none",
        metadata=_meta(f"What a {kind} anomaly does ({when}).", choices=choices),
    )


@dataclass(frozen=True, kw_only=True)
class AnomalyPolicyConfig(_Section):
    """``on_anomaly``: what each anomaly kind makes every rank do (docs/policies.md)."""

    nonfinite_grad: str = _action(
        "nonfinite_grad", _BEFORE_THE_STEP, "checked on the step's gradients before it"
    )
    grad_spike: str = _action(
        "grad_spike", _BEFORE_THE_STEP, "the pre-clip norm checked before the step"
    )
    nonfinite_loss: str = _action("nonfinite_loss", _DAMAGED_WHEN_KNOWN, "judged a step late")
    loss_spike: str = _action("loss_spike", _JUDGED_LATE, "judged a step late")
    replica_mismatch: str = _action("replica_mismatch", ("none", "stop"), "judged late")
    stall: str = _action("stall", ("none", "checkpoint", "stop"), "once the loop moves again")
    slowdown: str = _action("slowdown", ("none", "checkpoint", "stop"), "judged late")
    memory_leak: str = _action("memory_leak", ("none", "checkpoint", "stop"), "judged late")
    lr_scale_factor: float = field(
        default=0.1,
        metadata=_meta("What lr_scale multiplies every param group's LR by.", gt=0, le=1),
    )
    lr_scale_steps: int = field(
        default=100,
        metadata=_meta("Optimizer steps lr_scale lasts; then the LR is the loop's own.", ge=1),
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
            le=MAX_SECONDS,
        ),
    )
    module_depth: int = field(
        default=0,
        metadata=_meta(
            "Module-name depth of gradient-norm groups: 0 groups by the model's repeated "
            "blocks (transformer.h.7, model.layers.12), plus its stem and head (top-level "
            "children below any shared wrapper when it repeats none; a multi-layer LSTM's "
            "layers: rnn.l1); 1 = top-level children, 2 = theirs, ...",
            ge=0,
        ),
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
            "Most steps between two memory samples of the trend leak rule (host RSS, CUDA "
            "allocated bytes); fewer when leak_sample_seconds passes first.",
            ge=1,
        ),
    )
    leak_sample_seconds: float = field(
        default=5.0,
        metadata=_meta(
            "Most loop time between two memory samples of the trend leak rule (samples are "
            "taken at step ends: a step longer than this is sampled at each end).",
            gt=0,
            le=3600,
        ),
    )
    leak_trend_bucket: int = field(
        default=10,
        metadata=_meta(
            "Seconds of loop time per floor of the trend rule's fast scale (its slow scale's "
            "floors are 15 times longer); only each floor's minimum is kept.",
            ge=1,
            le=3600,
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
            "Growth over the trend window, relative to its level, that the trend rule's slow "
            "scale needs (0.02 = +2%; the fast scale 5x, the short-run scale 3x; each window's "
            "second half must grow by half of it).",
            ge=0,
        ),
    )
    leak_trend_warmup_steps: int = field(
        default=20,
        metadata=_meta(
            "Steps before the trend rule takes memory samples (or 60 s of loop time, "
            "whichever comes first).",
            ge=0,
        ),
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
    replica_check_steps: int = field(
        default=100,
        metadata=_meta(
            "Every this many optimizer steps, compare the data-parallel replicas' parameters on "
            "the device (integer fingerprints per module group, no sync) and name the rank that "
            "diverged: anomaly replica_mismatch (0: never).",
            ge=0,
        ),
    )
    replica_group: str = field(
        default="auto",
        metadata=_meta(
            "Which ranks the replica check compares: 'auto' finds them (DDP's process group, "
            "an HSDP mesh's replicate dimension); 'world' says every rank holds the same "
            "parameters, for a model stabmon sees without its DDP wrapper (the Lightning and "
            "Hugging Face adapters attach to the unwrapped module).",
            choices=("auto", "world"),
        ),
    )
    replica_local_norms: bool = field(
        default=False,
        metadata=_meta(
            "With the replica check on a DDP model: take each rank's gradient norm before the "
            "all-reduce (a DDP communication hook), and name a rank whose norm stands far "
            "out from the others' at a check: anomaly replica_grad_outlier, a weaker signal "
            "for corruption before the reduction. Opt-in: DDP allows one communication "
            "hook, so a register_comm_hook the loop calls later would raise; never installed "
            "over a hook of the loop's own."
        ),
    )
    provenance_steps: int = field(
        default=3,
        metadata=_meta(
            "After a non-finite gradient or loss, the training steps for which every module's "
            "forward (and, after a non-finite gradient with a finite loss, its backward) is "
            "watched on the device to name the module that produced it (0: never).",
            ge=0,
            le=100,
        ),
    )
    provenance_always: bool = field(
        default=False,
        metadata=_meta(
            "Watch every module's forward and backward from the first step, for a debugging "
            "session (one device reduction per module output and per gradient, each step)."
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
            le=MAX_SECONDS,
        ),
    )
    phase_stall_seconds: float = field(
        default=3600.0,
        metadata=_meta(
            "Stall limit inside named phases (eval, checkpoint) and before the first step.",
            gt=0,
            le=MAX_SECONDS,
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
            le=MAX_SECONDS,
        ),
    )
    sample_seconds: float = field(
        default=5.0,
        metadata=_meta(
            "Interval of background sampling (memory now, heartbeat).", gt=0, le=MAX_SECONDS
        ),
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
    on_anomaly: AnomalyPolicyConfig = field(
        default_factory=AnomalyPolicyConfig,
        metadata=_meta(
            "What each anomaly kind makes every rank do: on_anomaly.<kind> (docs/policies.md)."
        ),
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
    return load_sections(Config, source, overrides, env, file_variable=_CONFIG_FILE_VARIABLE)
