"""The public metric contract: every exported name, its type, help and labels.

This module is the one source of metric names. The exporter, the daemon, the
dashboards and the rule tests import from here, and a test compares it with
``shared/metrics-contract.md`` so the code and the published contract cannot
drift apart. It imports nothing from torch or prometheus-client on purpose:
tools that only need names stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ALERT_NAMES",
    "ANOMALY_KINDS",
    "BETWEEN_STEPS",
    "DAEMON_EXTENSION_METRICS",
    "DAEMON_HANG_METRICS",
    "DAEMON_METRICS",
    "EXTENSION_ALERT_NAMES",
    "EXTENSION_ANOMALY_KINDS",
    "EXTENSION_METRICS",
    "HANG_METRICS",
    "HANG_REASONS",
    "HANG_STATES",
    "LOOP_PHASES",
    "INTERNAL_COMPONENTS",
    "MetricDef",
    "PHASES",
    "PUBLISHED_ANOMALY_KINDS",
    "STEP_LOOP_PHASES",
    "THROTTLE_REASONS",
    "TRAINING_METRICS",
]

MetricType = Literal["gauge", "counter", "histogram"]

#: Labels on every series a training process exports.
PROCESS_LABELS: tuple[str, ...] = ("rank", "run")

#: Values of ``stabmon_anomalies_total{kind}`` in the published contract v1.
PUBLISHED_ANOMALY_KINDS: tuple[str, ...] = (
    "nonfinite_grad",
    "nonfinite_loss",
    "grad_spike",
    "loss_spike",
    "memory_leak",
    "stall",
    "device_mismatch",
)
#: Kinds beyond contract v1 (proposed in docs/contract-proposals.md): ``dead_grad``, a
#: module group whose gradients stayed exactly zero for ``dead_grad_steps`` measured steps;
#: ``slowdown``, a sustained shift of the step time against the run's recent baseline
#: (detectors/slowdown.py).
EXTENSION_ANOMALY_KINDS: tuple[str, ...] = (
    "dead_grad",
    "slowdown",
    "input_starvation",
    "replica_mismatch",
    "replica_grad_outlier",
)
#: Values of ``stabmon_anomalies_total{kind}``; each is exported as 0 from attach.
ANOMALY_KINDS: tuple[str, ...] = PUBLISHED_ANOMALY_KINDS + EXTENSION_ANOMALY_KINDS

#: Built-in values of ``stabmon_phase_seconds_total{phase}``; user-named phases add to these.
PHASES: tuple[str, ...] = ("data_wait", "forward", "backward", "optimizer")
#: The loop phase (``stabmon_loop_phase``, a stall's ``phase``) between two steps outside a
#: batch fetch: the loop's own code, which is not waiting for input (its time is still
#: booked as ``data_wait`` in ``stabmon_phase_seconds_total`` when no fetch is tracked).
BETWEEN_STEPS = "between_steps"
#: The loop's own phases, which have the step's stall limit (named phases have their own).
STEP_LOOP_PHASES: tuple[str, ...] = (*PHASES, BETWEEN_STEPS)

#: Values of ``stabmon_internal_errors_total{component}`` known at start (exported as 0).
INTERNAL_COMPONENTS: tuple[str, ...] = (
    "hooks",
    "grads",
    "loss",
    "readback",
    "detectors",
    "memory",
    "stall",
    "exporter",
    "event_log",
    "rundir",
)

#: NVML clock event reasons, as the ``reason`` label of ``stabmon_gpu_throttle_active``.
THROTTLE_REASONS: tuple[str, ...] = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)


@dataclass(frozen=True)
class MetricDef:
    """One public metric: name, Prometheus type, help text and extra labels.

    ``labels`` lists the labels beyond the process labels (``rank``, ``run``)
    that every training-process series carries.
    """

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()

    @property
    def base_name(self) -> str:
        """The name prometheus-client wants: counters without ``_total``."""
        if self.type == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name


# --- training process -------------------------------------------------------------------------

BUILD_INFO = MetricDef(
    "stabmon_build_info",
    "gauge",
    "Environment fingerprint of the training process (value is always 1).",
    (
        "stabmon_version",
        "torch_version",
        "cuda_version",
        "cudnn_version",
        "nccl_version",
        "python_version",
    ),
)
STEPS = MetricDef("stabmon_steps_total", "counter", "Optimizer steps completed.")
EPOCH = MetricDef("stabmon_epoch", "gauge", "Current epoch index.")
LAST_STEP_TIMESTAMP = MetricDef(
    "stabmon_last_step_timestamp_seconds",
    "gauge",
    "Unix time at which the last optimizer step completed (heartbeat).",
)
STEP_DURATION = MetricDef(
    "stabmon_step_duration_seconds",
    "histogram",
    "Host wall time from one optimizer step's end to the next step's end.",
)
DATA_WAIT = MetricDef(
    "stabmon_data_wait_seconds",
    "histogram",
    "Host wall time from a step's end to the next forward's start (input pipeline wait).",
)
PHASE_SECONDS = MetricDef(
    "stabmon_phase_seconds_total",
    "counter",
    "Host wall time spent in each phase of the training loop.",
    ("phase",),
)
GRAD_NORM = MetricDef(
    "stabmon_grad_norm", "gauge", "Global L2 norm of all gradients at the last measured step."
)
MODULE_GRAD_NORM = MetricDef(
    "stabmon_module_grad_norm",
    "gauge",
    "L2 gradient norm per module group at the last measured step.",
    ("module",),
)
NONFINITE_GRAD_STEPS = MetricDef(
    "stabmon_nonfinite_grad_steps_total",
    "counter",
    "Measured steps whose gradients held a NaN or Inf.",
)
NONFINITE_LOSS = MetricDef(
    "stabmon_nonfinite_loss_total", "counter", "Observed losses that were NaN or Inf."
)
ZERO_GRAD_PARAMS = MetricDef(
    "stabmon_zero_grad_params",
    "gauge",
    "Trainable parameter tensors whose gradient was None or all zero at the last measured step.",
)
LOSS = MetricDef("stabmon_loss", "gauge", "Last observed loss.")
ANOMALIES = MetricDef(
    "stabmon_anomalies_total", "counter", "Anomalies detected in-process, by kind.", ("kind",)
)
AMP_LOSS_SCALE = MetricDef(
    "stabmon_amp_loss_scale", "gauge", "Current GradScaler loss scale (only with a scaler)."
)
AMP_SKIPPED_STEPS = MetricDef(
    "stabmon_amp_skipped_steps_total",
    "counter",
    "Optimizer steps skipped by GradScaler because of Inf/NaN gradients.",
)
DEVICE_MEMORY_ALLOCATED = MetricDef(
    "stabmon_device_memory_allocated_bytes",
    "gauge",
    "Allocator memory in use now.",
    ("device",),
)
DEVICE_MEMORY_RESERVED = MetricDef(
    "stabmon_device_memory_reserved_bytes",
    "gauge",
    "Allocator memory reserved now.",
    ("device",),
)
DEVICE_MEMORY_PEAK = MetricDef(
    "stabmon_device_memory_peak_bytes",
    "gauge",
    "Peak allocated memory during the current epoch.",
    ("device",),
)
EPOCH_MEMORY = MetricDef(
    "stabmon_epoch_memory_bytes",
    "gauge",
    'Memory sampled at the last epoch end (device="host": process RSS).',
    ("device",),
)
MEMORY_DRIFT = MetricDef(
    "stabmon_memory_drift_ratio",
    "gauge",
    "Relative growth of the epoch-end memory sample against the baseline epoch.",
    ("device",),
)
MEMORY_LEAK_SUSPECTED = MetricDef(
    "stabmon_memory_leak_suspected",
    "gauge",
    "1 while the in-process leak rule holds, else 0.",
    ("device",),
)
HOST_MEMORY_RSS = MetricDef(
    "stabmon_host_memory_rss_bytes", "gauge", "Resident set size of the training process."
)
STALLED = MetricDef(
    "stabmon_stalled",
    "gauge",
    "1 while no step has completed for longer than the stall threshold, else 0.",
)
INTERNAL_ERRORS = MetricDef(
    "stabmon_internal_errors_total",
    "counter",
    "Failures inside stabmon that were contained (training went on).",
    ("component",),
)

TRAINING_METRICS: tuple[MetricDef, ...] = (
    BUILD_INFO,
    STEPS,
    EPOCH,
    LAST_STEP_TIMESTAMP,
    STEP_DURATION,
    DATA_WAIT,
    PHASE_SECONDS,
    GRAD_NORM,
    MODULE_GRAD_NORM,
    NONFINITE_GRAD_STEPS,
    NONFINITE_LOSS,
    ZERO_GRAD_PARAMS,
    LOSS,
    ANOMALIES,
    AMP_LOSS_SCALE,
    AMP_SKIPPED_STEPS,
    DEVICE_MEMORY_ALLOCATED,
    DEVICE_MEMORY_RESERVED,
    DEVICE_MEMORY_PEAK,
    EPOCH_MEMORY,
    MEMORY_DRIFT,
    MEMORY_LEAK_SUSPECTED,
    HOST_MEMORY_RSS,
    STALLED,
    INTERNAL_ERRORS,
)

#: Metrics beyond contract v1: useful, additive, and free to evolve until a contract lists them.
DEVICE_PHASE_SECONDS = MetricDef(
    "stabmon_device_phase_seconds_total",
    "counter",
    "Device time between loop boundaries, from CUDA events (data_wait: device idle for input).",
    ("phase",),
)
DEVICE_STEP_DURATION = MetricDef(
    "stabmon_device_step_duration_seconds",
    "histogram",
    "Device time from one optimizer step's end to the next, from CUDA events.",
)
DEVICE_UTILIZATION = MetricDef(
    "stabmon_device_utilization_ratio",
    "gauge",
    "GPU utilization of a device this process uses, 0..1 (the process's view; the daemon's "
    "stabmon_gpu_utilization_ratio is the node's).",
    ("device",),
)
GRAD_NORM_SQUARED = MetricDef(
    "stabmon_grad_norm_squared",
    "gauge",
    "Squared L2 norm of this rank's gradients at the last measured step, by placement: "
    "'sharded' is this rank's shards of sharded parameters (FSDP, tensor parallelism), "
    "'replicated' the gradients every rank holds whole. Global norm: sqrt(sum over ranks of "
    "sharded + replicated of one rank).",
    ("placement",),
)
DEAD_GRAD_PARAMS = MetricDef(
    "stabmon_dead_grad_params",
    "gauge",
    "Trainable parameter tensors of a module group whose gradient has been exactly zero (or "
    "None) at every measured step of the dead_grad_steps window: a dead branch.",
    ("module",),
)
DEVICE_INFO = MetricDef(
    "stabmon_device_info",
    "gauge",
    "The physical GPU behind each CUDA device of this process (value 1): UUID, NVML index "
    "(nvidia-smi -i), PCI bus id, name and driver version, after CUDA_VISIBLE_DEVICES.",
    ("device", "uuid", "gpu", "pci_bus_id", "name", "driver_version"),
)
DEVICE_MEMORY_CACHE = MetricDef(
    "stabmon_device_memory_cache_bytes",
    "gauge",
    "Allocator cache now: reserved minus allocated. A growing cache with a flat live set is "
    "fragmentation, not a leak.",
    ("device",),
)
GRAD_CLIPPED_STEPS = MetricDef(
    "stabmon_grad_clipped_steps_total",
    "counter",
    "Measured optimizer steps whose gradient clipping scaled the gradients down (pre-clip "
    "norm above max_norm).",
)
GRAD_CLIP_COEFFICIENT = MetricDef(
    "stabmon_grad_clip_coefficient",
    "gauge",
    "min(1, max_norm / pre-clip norm) at the last measured step; 1.0 when it was not clipped.",
)
MEMORY_EXHAUSTION = MetricDef(
    "stabmon_memory_exhaustion_seconds",
    "gauge",
    "Estimated seconds until this device's memory (host: cgroup limit or available memory; "
    "CUDA: device total) runs out at the current growth trend; +Inf while not growing.",
    ("device",),
)
#: Values of ``stabmon_grad_norm_squared{placement}``.
GRAD_PLACEMENTS: tuple[str, ...] = ("replicated", "sharded")

# Throughput (stabmon/pipeline/throughput.py; proposed in docs/contract-proposals.md).
SAMPLES = MetricDef(
    "stabmon_samples_total",
    "counter",
    "Training samples handed to the loop: the leading dimension of each batch track() yields, "
    "or what observe(samples=...) reports.",
)
TOKENS = MetricDef(
    "stabmon_tokens_total",
    "counter",
    "Training tokens: input_ids of shape (batch, sequence) seen by track(), padding included, "
    "or what observe(tokens=...) reports.",
)
MODEL_FLOPS = MetricDef(
    "stabmon_model_flops_total",
    "counter",
    "FLOPs of the optimizer steps done: FLOPs per step (counted once, or throughput."
    "flops_per_step) times steps. Absent until the FLOPs of a step are known.",
)
PEAK_FLOPS = MetricDef(
    "stabmon_peak_flops_per_second",
    "gauge",
    "Peak dense FLOP/s of this rank's GPU for the dtype the step runs in (table or "
    "throughput.peak_flops). Absent on CPU and for GPUs not in the table.",
)
MFU = MetricDef(
    "stabmon_mfu_ratio",
    "gauge",
    "Model FLOPs utilization over the last block of steps: FLOPs per step x steps / training "
    "seconds (named phases excluded) / peak FLOP/s. GPU only.",
)
SLOWDOWN_ACTIVE = MetricDef(
    "stabmon_slowdown_active",
    "gauge",
    "1 while a sustained slowdown holds, on the phase whose time grew most, else 0.",
    ("phase",),
)
INPUT_STARVATION_ACTIVE = MetricDef(
    "stabmon_input_starvation_active",
    "gauge",
    "1 while an input_starvation episode holds (the loop waited on input for at least "
    "throughput.starvation_share of its training time over the window), else 0.",
)
STEP_TIME_BASELINE = MetricDef(
    "stabmon_step_time_baseline_seconds",
    "gauge",
    "The slowdown rule's baseline: median mean step time (built-in phases) of the recent "
    "normal blocks.",
)

REPLICA_CHECKS = MetricDef(
    "stabmon_replica_checks_total",
    "counter",
    "Checks of this rank's parameters against its data-parallel replicas (replica_check_steps); "
    "absent where the model has no replicas.",
)
REPLICA_MISMATCHES = MetricDef(
    "stabmon_replica_mismatches_total",
    "counter",
    "Replica checks in which the data-parallel replicas held different parameters (silent "
    "data corruption: the replica_mismatch anomaly names the outvoted ranks).",
)

EXTENSION_METRICS: tuple[MetricDef, ...] = (
    GRAD_NORM_SQUARED,
    GRAD_CLIPPED_STEPS,
    GRAD_CLIP_COEFFICIENT,
    MEMORY_EXHAUSTION,
    DEAD_GRAD_PARAMS,
    DEVICE_INFO,
    DEVICE_MEMORY_CACHE,
    DEVICE_PHASE_SECONDS,
    DEVICE_STEP_DURATION,
    DEVICE_UTILIZATION,
    SAMPLES,
    TOKENS,
    MODEL_FLOPS,
    PEAK_FLOPS,
    MFU,
    SLOWDOWN_ACTIVE,
    STEP_TIME_BASELINE,
    INPUT_STARVATION_ACTIVE,
    REPLICA_CHECKS,
    REPLICA_MISMATCHES,
)

# --- node daemon ------------------------------------------------------------------------------

_GPU = ("gpu", "uuid")

GPU_UTILIZATION = MetricDef(
    "stabmon_gpu_utilization_ratio", "gauge", "NVML GPU utilization, 0..1.", _GPU
)
GPU_MEMORY_USED = MetricDef(
    "stabmon_gpu_memory_used_bytes", "gauge", "Framebuffer memory used.", _GPU
)
GPU_MEMORY_TOTAL = MetricDef(
    "stabmon_gpu_memory_total_bytes", "gauge", "Framebuffer memory total.", _GPU
)
GPU_TEMPERATURE = MetricDef(
    "stabmon_gpu_temperature_celsius", "gauge", "GPU core temperature.", _GPU
)
GPU_POWER = MetricDef("stabmon_gpu_power_watts", "gauge", "GPU power draw.", _GPU)
GPU_SM_CLOCK = MetricDef("stabmon_gpu_sm_clock_hertz", "gauge", "GPU SM clock.", _GPU)
GPU_THROTTLE_ACTIVE = MetricDef(
    "stabmon_gpu_throttle_active",
    "gauge",
    "1 while that clock-throttle reason is active.",
    (*_GPU, "reason"),
)
GPU_XID_ERRORS = MetricDef(
    "stabmon_gpu_xid_errors_total", "counter", "XID error events seen.", (*_GPU, "xid")
)
GPU_ECC_ERRORS = MetricDef(
    "stabmon_gpu_ecc_errors_total", "counter", "ECC errors by type.", (*_GPU, "type")
)
PROCESS_GPU_MEMORY = MetricDef(
    "stabmon_process_gpu_memory_bytes",
    "gauge",
    "GPU memory held by a monitored training process on that physical GPU.",
    (*_GPU, "rank", "pid"),
)
PROCESS_UP = MetricDef(
    "stabmon_process_up",
    "gauge",
    "1 while a monitored training process is alive.",
    ("rank", "run", "pid"),
)
HEARTBEAT_AGE = MetricDef(
    "stabmon_heartbeat_age_seconds",
    "gauge",
    "Seconds since that training process last completed a step (since attach before the first).",
    ("rank", "run"),
)
PROCESS_CPU_SECONDS = MetricDef(
    "stabmon_process_cpu_seconds_total",
    "counter",
    "CPU time of a monitored training process (main) and of its children (workers).",
    ("rank", "run", "scope"),
)
PROCESS_MEMORY = MetricDef(
    "stabmon_process_memory_bytes",
    "gauge",
    "Proportional set size of a monitored training process (main) and its workers.",
    ("rank", "run", "scope"),
)
DAEMON_NVML_UP = MetricDef("stabmon_daemon_nvml_up", "gauge", "1 while NVML answers, else 0.")

DAEMON_METRICS: tuple[MetricDef, ...] = (
    GPU_UTILIZATION,
    GPU_MEMORY_USED,
    GPU_MEMORY_TOTAL,
    GPU_TEMPERATURE,
    GPU_POWER,
    GPU_SM_CLOCK,
    GPU_THROTTLE_ACTIVE,
    GPU_XID_ERRORS,
    GPU_ECC_ERRORS,
    PROCESS_GPU_MEMORY,
    PROCESS_UP,
    HEARTBEAT_AGE,
    PROCESS_CPU_SECONDS,
    PROCESS_MEMORY,
    DAEMON_NVML_UP,
)

#: The daemon's own health, beyond contract v1 (no labels: one daemon per node and target).
DAEMON_POLL_DURATION = MetricDef(
    "stabmon_daemon_poll_duration_seconds",
    "gauge",
    "Wall time of the daemon's last poll, by poller (nvml, processes).",
    ("poller",),
)
DAEMON_LAST_POLL = MetricDef(
    "stabmon_daemon_last_poll_timestamp_seconds",
    "gauge",
    "Unix time at which each of the daemon's pollers last completed.",
    ("poller",),
)

#: Daemon metrics beyond contract v1 (proposed in docs/contract-proposals.md): what the alert
#: rules need to stay true through daemon restarts and to know each rank's own stall limit.
PROCESS_STALL_LIMIT = MetricDef(
    "stabmon_process_stall_limit_seconds",
    "gauge",
    "The stall limit that applies to that training process now (its current phase's), from its "
    "registration record.",
    ("rank", "run"),
)
PROCESS_EXIT_REASON = MetricDef(
    "stabmon_process_exit_reason",
    "gauge",
    "1 for a monitored training process that is down, labelled with how it ended: exception "
    "(an uncaught error), signal (terminated by a signal it recorded: SIGTERM, SIGINT), or "
    "vanished (no exit record: SIGKILL, the OOM killer, a native crash).",
    ("rank", "run", "pid", "reason"),
)
GPU_XID_LAST_EVENT = MetricDef(
    "stabmon_gpu_xid_last_event_timestamp_seconds",
    "gauge",
    "Unix time of the last XID event of that xid on that GPU (kept across daemon restarts).",
    (*_GPU, "xid"),
)
HOST_MEMORY_TOTAL = MetricDef(
    "stabmon_host_memory_total_bytes",
    "gauge",
    "Physical memory of the node the daemon runs on (what training processes and their workers "
    "share).",
)
#: Values of ``stabmon_process_exit_reason{reason}``.
EXIT_REASONS: tuple[str, ...] = ("exception", "signal", "vanished")

DAEMON_EXTENSION_METRICS: tuple[MetricDef, ...] = (
    PROCESS_STALL_LIMIT,
    PROCESS_EXIT_REASON,
    GPU_XID_LAST_EVENT,
    HOST_MEMORY_TOTAL,
)

# --- alerts (deploy/prometheus/rules) ---------------------------------------------------------

#: Every alert the shipped rules define; each carries `severity`, `summary`, `description`
#: and `runbook_url` (docs/runbooks.md#<alert name in lower case>).
ALERT_NAMES: tuple[str, ...] = (
    "StabmonTrainingStalled",
    "StabmonTrainingProcessDown",
    "StabmonTrainingMetricsAbsent",
    "StabmonNonFiniteGradients",
    "StabmonLossSpike",
    "StabmonDeviceMemoryLeak",
    "StabmonHostMemoryLeak",
    "StabmonGPUUnderutilized",
    "StabmonGPUThermalThrottling",
    "StabmonGPUXidErrors",
    "StabmonStragglerRank",
)
SEVERITIES: tuple[str, ...] = ("critical", "warning", "info")
#: Alerts beyond contract v1 (proposed in docs/contract-proposals.md), held to the same rules:
#: severity, summary, description, runbook_url, a firing and a quiet promtool case each.
EXTENSION_ALERT_NAMES: tuple[str, ...] = (
    "StabmonDaemonDown",
    "StabmonDaemonNvmlDown",
    "StabmonTrainingProcessTerminated",
    "StabmonNonFiniteLoss",
    "StabmonGradientSpike",
    "StabmonDeadGradients",
    "StabmonAmpLossScaleCollapse",
    "StabmonMemoryExhaustionForecast",
    "StabmonMemoryExhaustionImminent",
    "StabmonTrainingSlowdown",
    "StabmonInputStarvation",
    "StabmonReplicaMismatch",
)

# --- hang triage (issue 25; proposed in docs/contract-proposals.md) ---------------------------

#: Values of ``stabmon_hang_state{state}``: what a stalled rank's main thread is doing.
HANG_STATES: tuple[str, ...] = ("collective", "data_wait", "lock_wait", "io", "compute")
#: Reason classes of a hang verdict (event log, ``stabmon status``, the alert's description).
HANG_REASONS: tuple[str, ...] = (
    "data_starvation",
    "compute",
    "collective_not_entered",
    "io",
    "deadlock",
)
#: Built-in values of ``stabmon_loop_phase{phase}`` beyond PHASES (user-named phases add to these).
LOOP_PHASES: tuple[str, ...] = ("startup", *PHASES, BETWEEN_STEPS)
LOOP_PHASE = MetricDef(
    "stabmon_loop_phase",
    "gauge",
    "1 for the loop phase the training thread is in now (startup, data_wait, forward, backward, "
    "optimizer, between_steps or a named phase such as eval or checkpoint), 0 for the others "
    "it has been in.",
    ("phase",),
)
COLLECTIVES = MetricDef(
    "stabmon_collectives_total",
    "counter",
    "Collectives this process issued through torch.distributed's Python API (all_reduce, "
    "barrier, broadcast...), counted at the call without a device sync; DDP's C++ gradient "
    "all-reduces are not among them.",
)
COLLECTIVE_IN_PROGRESS = MetricDef(
    "stabmon_collective_in_progress",
    "gauge",
    "1 while the training thread is inside a torch.distributed collective call, else 0.",
)
HANG_STATE = MetricDef(
    "stabmon_hang_state",
    "gauge",
    "While stalled: 1 for what the main thread is doing (collective, data_wait, lock_wait, io, "
    "compute), read from its Python stack; all 0 while not stalled. PromQL compares ranks.",
    ("state",),
)
HANG_METRICS: tuple[MetricDef, ...] = (LOOP_PHASE, COLLECTIVES, COLLECTIVE_IN_PROGRESS, HANG_STATE)
NODE_HANG_VERDICT = MetricDef(
    "stabmon_node_hang_verdict",
    "gauge",
    "Node daemon: 1 for each rank it names as holding up a hung run of its node (judged over the "
    "ranks' registration records), with the reason class; absent while there is no verdict.",
    ("rank", "run", "reason"),
)
#: Daemon-side hang triage (proposed in docs/contract-proposals.md).
DAEMON_HANG_METRICS: tuple[MetricDef, ...] = (NODE_HANG_VERDICT,)
