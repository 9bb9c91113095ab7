"""Training stability: one run's (or many runs') steps, gradients, losses, memory and heartbeat.

Every series here comes from the training processes' own exporters (``stabmon.attach``);
the node's view (GPUs, liveness from outside) is in ``gpu_nodes.dashboard.py``.
"""

from grafanalib.core import (
    GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
    Annotations,
    Dashboard,
    Templating,
    Time,
)
from panels import (
    RUN_RANK,
    Query,
    anomaly_annotation,
    datasource_variable,
    equals,
    increase,
    layout,
    matches,
    quantile,
    rank_variable,
    rate,
    recorded,
    run_variable,
    selector,
    stat,
    steps,
    sum_by,
    timeseries,
)
from throughput_panels import THROUGHPUT_PANELS

from stabmon import contract as c
from stabmon.config import Config
from stabmon.detectors.stall import MIN_AUTO_STALL_SECONDS

RANK = ("run", "rank")
WHO = "{{run}}/{{rank}}"
QUANTILES = (0.5, 0.9, 0.99)
SPIKES = matches("kind", "loss_spike|grad_spike")
LEAK_THRESHOLD = Config().leak_threshold  # the default leak rule: +3% per window

# --- overview ---------------------------------------------------------------------------------

stalled = stat(
    "Stalled ranks",
    [Query(f"sum({selector(c.STALLED, *RUN_RANK)})")],
    unit="none",
    description="Ranks with no completed step for longer than their stall limit, now.",
    thresholds=steps("green", (1, "red")),
    no_value="0",
)
leaking = stat(
    "Leak suspected (rank × device)",
    [Query(f"sum({selector(c.MEMORY_LEAK_SUSPECTED, *RUN_RANK)})")],
    unit="none",
    description="Devices (and host memory) of any rank where the in-process leak rule holds.",
    thresholds=steps("green", (1, "red")),
    no_value="0",
)
oldest_heartbeat = stat(
    "Oldest heartbeat",
    [Query(f"max(time() - {selector(c.LAST_STEP_TIMESTAMP, *RUN_RANK)})")],
    unit="s",
    description="Seconds since the slowest rank completed a step. Amber at the smallest "
    "automatic stall limit.",
    thresholds=steps("green", (MIN_AUTO_STALL_SECONDS, "orange")),
)
epoch = stat(
    "Epoch",
    [Query(f"max({selector(c.EPOCH, *RUN_RANK)})")],
    unit="none",
    description="Highest current epoch index among the selected ranks.",
    thresholds=steps("blue"),
)
anomalies_in_range = stat(
    "Anomalies in range",
    [
        Query(
            sum_by(("kind",), increase(c.ANOMALIES, *RUN_RANK, window="$__range")),
            "{{kind}}",
            instant=True,
        )
    ],
    unit="none",
    description="Anomalies of each kind detected in-process over the dashboard's time range.",
    thresholds=steps("green", (0.5, "red")),
    width=8,
    text_mode="value_and_name",
)
environment = stat(
    "Environment (ranks per build)",
    [
        Query(
            sum_by(
                ("stabmon_version", "torch_version", "cuda_version", "python_version"),
                selector(c.BUILD_INFO, *RUN_RANK),
                aggregation="count",
            ),
            "stabmon {{stabmon_version}} · torch {{torch_version}} · CUDA {{cuda_version}} "
            "· Python {{python_version}}",
        )
    ],
    unit="none",
    description="How many ranks run each build; more than one line means ranks differ.",
    thresholds=steps("blue"),
    text_mode="value_and_name",
    width=24,
    height=3,
)

# --- runs: recorded per-run and per-node aggregates (stabmon.aggregates, issue 39) -------------
# One series a run or a node of a run, recorded each minute: what to open first on a run of
# thousands of ranks, where the per-rank panels below are best filtered to a few ranks.

RUN_ONLY = (matches("run", "$run"),)

run_pace = timeseries(
    "Step rate per run: mean and slowest rank",
    [
        Query(recorded("run:stabmon_steps:avg_rate5m", *RUN_ONLY), "mean {{run}}"),
        Query(recorded("run:stabmon_steps:min_rate5m", *RUN_ONLY), "slowest rank {{run}}"),
    ],
    unit="suffix: steps/s",
    description="Optimizer steps per second over 5 minutes: the mean of the run's ranks and its "
    "slowest rank (recorded by the stabmon.aggregates rules). The slowest apart from the mean "
    "is a straggler (see Stragglers); both at 0 is a stall.",
    width=8,
)
run_ranks = timeseries(
    "Ranks attached and stalled per run",
    [
        Query(recorded("run:stabmon_build_info:count", *RUN_ONLY), "attached {{run}}"),
        Query(recorded("run:stabmon_stalled:sum", *RUN_ONLY), "stalled {{run}}"),
    ],
    unit="none",
    description="Ranks serving metrics (from attach to detach) and those the in-process "
    "watchdog reports stalled. A drop in attached ranks is a crash or a lost target.",
    width=8,
)
run_anomalies = timeseries(
    "Anomalies per run (5 min)",
    [Query(recorded("run:stabmon_anomalies:increase5m", *RUN_ONLY), "{{kind}} {{run}}")],
    unit="none",
    description="Anomalies of each kind the run's ranks recorded over the last 5 minutes.",
    bars=True,
    width=8,
)
node_pace = timeseries(
    "Step rate per node of the run",
    [Query(recorded("run_node:stabmon_steps:avg_rate5m", *RUN_ONLY), "{{node}} {{run}}")],
    unit="suffix: steps/s",
    description="The mean step rate of each node's ranks over 5 minutes (by the node label the "
    "PodMonitor adds; one line per run without it): a slow node stands out here before its "
    "ranks are looked at one by one.",
    legend_calcs=("lastNotNull", "min"),
    width=12,
)
node_anomalies = timeseries(
    "Anomalies per node of the run (5 min)",
    [
        Query(
            recorded("run_node:stabmon_anomalies:increase5m", *RUN_ONLY) + " > 0",
            "{{kind}} {{node}} {{run}}",
        )
    ],
    unit="none",
    description="Anomalies each node's ranks recorded over the last 5 minutes: one node "
    "recording them all points at its hardware.",
    bars=True,
    width=12,
)

# --- throughput -------------------------------------------------------------------------------

step_rate = timeseries(
    "Step rate",
    [Query(sum_by(RANK, rate(c.STEPS, *RUN_RANK)), WHO)],
    unit="suffix: steps/s",
    description="Optimizer steps completed per second, per rank. A rank below the others is a "
    "straggler; a drop to 0 is a stall.",
    legend_calcs=("lastNotNull", "min"),
)
step_time = timeseries(
    "Step time p50 / p90 / p99",
    [Query(quantile(q, c.STEP_DURATION, *RUN_RANK), f"p{round(q * 100)} {WHO}") for q in QUANTILES],
    unit="s",
    description="Host wall time from one optimizer step's end to the next. A p99 far above "
    "p50 means periodic pauses (checkpoints, evaluation, input hiccups).",
)
stragglers = timeseries(
    "Stragglers: rank vs run median",
    [
        Query(
            recorded("run_rank:stabmon_step_duration_seconds:ratio_to_run_median10m", *RUN_RANK),
            "{{leg}} " + WHO,
        )
    ],
    unit="none",
    description="What StabmonStragglerRank reads (recorded each minute by the stabmon.throughput "
    "rules over 10-minute windows, so each run's median is computed once, not per panel "
    "refresh over every rank): each rank's mean step time (leg step), and its input wait "
    "(data_wait) and forward time (forward; device time on CUDA) beyond the run's median added "
    "to a median step, as multiples of the run's median step. 1.0 is the pack; the alert fires "
    "above 1.2 for 15 minutes. Under DDP every rank shows the slowest one's step time, so the "
    "straggler is the rank whose input wait or forward time stands out.",
    thresholds=steps("green", (1.2, "orange")),
)
data_wait_share = timeseries(
    "Input wait share",
    [
        Query(
            f"{sum_by(RANK, rate(c.PHASE_SECONDS, *RUN_RANK, equals('phase', 'data_wait')))}"
            f" / {sum_by(RANK, rate(c.PHASE_SECONDS, *RUN_RANK))}",
            WHO,
        )
    ],
    unit="percentunit",
    description="Share of the host's loop time spent waiting for the next batch. Above 20% the "
    "input pipeline is a bottleneck (on CUDA, read with 'Which figure is which' in the README).",
    min_value=0,
    max_value=1,
    thresholds=steps("green", (0.2, "orange")),
)
data_wait = timeseries(
    "Input wait p50 / p99",
    [Query(quantile(q, c.DATA_WAIT, *RUN_RANK), f"p{round(q * 100)} {WHO}") for q in (0.5, 0.99)],
    unit="s",
    description="Time from a step's end to the next forward's start (inside the loader's next() "
    "with track()).",
)
host_phases = timeseries(
    "Host time per phase (mean over ranks)",
    [
        Query(
            sum_by(("run", "phase"), rate(c.PHASE_SECONDS, *RUN_RANK), aggregation="avg"),
            "{{phase}} {{run}}",
        )
    ],
    unit="percentunit",
    description="Share of wall time the host spends in each phase (seconds per second). On "
    "CUDA a device-bound loop shows its device time where the host waits.",
    stacked=True,
)
device_phases = timeseries(
    "Device time per phase (CUDA)",
    [
        Query(
            sum_by(("run", "phase"), rate(c.DEVICE_PHASE_SECONDS, *RUN_RANK), aggregation="avg"),
            "{{phase}} {{run}}",
        )
    ],
    unit="percentunit",
    description="CUDA only, beyond contract v1: device time between CUDA events per phase; "
    "data_wait here is the GPU idle for input.",
    stacked=True,
)
device_step_time = timeseries(
    "Device step time p50 / p99 (CUDA)",
    [
        Query(quantile(q, c.DEVICE_STEP_DURATION, *RUN_RANK), f"p{round(q * 100)} {WHO}")
        for q in (0.5, 0.99)
    ],
    unit="s",
    description="CUDA only, beyond contract v1: device time from one step's end to the next.",
    width=12,
)
device_utilization = timeseries(
    "GPU utilization (process view, CUDA)",
    [Query(selector(c.DEVICE_UTILIZATION, *RUN_RANK), "{{device}} " + WHO)],
    unit="percentunit",
    description="Utilization of each device a rank uses, sampled by the rank. Below 50% the "
    "GPU waits on something else.",
    min_value=0,
    max_value=1,
    thresholds=steps("red", (0.5, "green")),
    width=12,
)

# --- optimisation health ----------------------------------------------------------------------

loss = timeseries(
    "Loss",
    [Query(selector(c.LOSS, *RUN_RANK), WHO)],
    unit="none",
    description="Last observed training loss per rank (not losses inside named phases).",
    legend_calcs=("lastNotNull", "min"),
)
_RUN = (matches("run", "$run"),)
#: The run's global norm from every rank's export: the shards of all ranks, one replica.
_GLOBAL_NORM = (
    f"sqrt({sum_by(('run',), selector(c.GRAD_NORM_SQUARED, *_RUN, equals('placement', 'sharded')))}"
    f" + {sum_by(('run',), selector(c.GRAD_NORM_SQUARED, *_RUN, equals('placement', 'replicated')), aggregation='max')})"  # noqa: E501
)
grad_norm = timeseries(
    "Global gradient norm",
    [Query(_GLOBAL_NORM, "{{run}} (all ranks)"), Query(selector(c.GRAD_NORM, *RUN_RANK), WHO)],
    unit="none",
    description="L2 norm of all gradients at the last measured step, log scale: a jump of a "
    "decade is a spike; a slow climb precedes divergence. 'all ranks' combines every rank's "
    "squared norms (exact under FSDP and tensor parallelism, where a rank's own line is the norm "
    "of its shards only; under DDP every line is the global norm).",
    log_base=10,
    legend_calcs=("lastNotNull", "max"),
)
module_grad_norm = timeseries(
    "Gradient norm per module",
    [Query(selector(c.MODULE_GRAD_NORM, *RUN_RANK), "{{module}} " + WHO)],
    unit="none",
    description="L2 gradient norm per module group, log scale: which part of the model blew up "
    "or stopped learning.",
    log_base=10,
)
zero_grads = timeseries(
    "Parameters without gradient",
    [
        Query(selector(c.ZERO_GRAD_PARAMS, *RUN_RANK), "zero now " + WHO),
        Query(f"{selector(c.DEAD_GRAD_PARAMS, *RUN_RANK)} > 0", "dead: {{module}} " + WHO),
    ],
    unit="none",
    description="Trainable parameter tensors whose gradient was None or all zero at the last "
    "measured step (frozen by mistake, or unused in forward), and per module those zero for a "
    "whole dead_grad_steps window: a dead branch, named in the event log.",
    steps_after=True,
)
nonfinite = timeseries(
    "Non-finite gradients and losses",
    [
        Query(sum_by(RANK, increase(c.NONFINITE_GRAD_STEPS, *RUN_RANK)), f"grad steps {WHO}"),
        Query(sum_by(RANK, increase(c.NONFINITE_LOSS, *RUN_RANK)), f"losses {WHO}"),
    ],
    unit="none",
    description="Steps whose gradients held NaN/Inf and losses that were NaN/Inf, per interval. "
    "Anything above 0 without a GradScaler is a bug or a divergence.",
    bars=True,
    thresholds=steps("green", (1, "red")),
)
spikes = timeseries(
    "Loss and gradient spikes",
    [
        Query(
            sum_by(("run", "rank", "kind"), increase(c.ANOMALIES, *RUN_RANK, SPIKES)),
            "{{kind}} " + WHO,
        )
    ],
    unit="none",
    description="Spikes flagged by the robust z-score detectors, per interval.",
    bars=True,
)
loss_scale = timeseries(
    "AMP loss scale",
    [Query(selector(c.AMP_LOSS_SCALE, *RUN_RANK), WHO)],
    unit="none",
    description="GradScaler scale (log 2). Halvings are overflows; a scale stuck low means "
    "gradients overflow every few steps.",
    log_base=2,
    steps_after=True,
    width=12,
)
skipped = timeseries(
    "AMP skipped steps",
    [Query(sum_by(RANK, increase(c.AMP_SKIPPED_STEPS, *RUN_RANK)), WHO)],
    unit="none",
    description="Optimizer steps GradScaler skipped for Inf/NaN gradients, per interval. A few "
    "early on are normal; a steady stream is not.",
    bars=True,
    width=12,
)

# --- memory -----------------------------------------------------------------------------------

epoch_memory = timeseries(
    "Memory at epoch end",
    [Query(selector(c.EPOCH_MEMORY, *RUN_RANK), "{{device}} " + WHO)],
    unit="bytes",
    description="Memory sampled at each epoch end per device (host: process RSS). A staircase "
    "that keeps climbing is a leak.",
    steps_after=True,
    width=12,
)
drift = timeseries(
    "Memory drift vs baseline epoch",
    [Query(selector(c.MEMORY_DRIFT, *RUN_RANK), "{{device}} " + WHO)],
    unit="percentunit",
    description="Growth of the epoch-end sample against the baseline epoch. The dashed line is "
    "the default leak threshold (leak_threshold).",
    thresholds=steps("green", (LEAK_THRESHOLD, "red")),
    steps_after=True,
    legend_calcs=("lastNotNull", "max"),
    width=12,
)
device_memory = timeseries(
    "Device memory now",
    [
        Query(selector(c.DEVICE_MEMORY_ALLOCATED, *RUN_RANK), "allocated {{device}} " + WHO),
        Query(selector(c.DEVICE_MEMORY_RESERVED, *RUN_RANK), "reserved {{device}} " + WHO),
        Query(selector(c.DEVICE_MEMORY_PEAK, *RUN_RANK), "epoch peak {{device}} " + WHO),
    ],
    unit="bytes",
    description="CUDA allocator: allocated now, reserved now, and the peak since the last "
    "epoch end.",
    width=12,
)
host_rss = timeseries(
    "Host RSS",
    [Query(selector(c.HOST_MEMORY_RSS, *RUN_RANK), WHO)],
    unit="bytes",
    description="Resident set size of each training process (its data loader workers are on "
    "the GPU nodes dashboard).",
    width=12,
)

# --- liveness and stabmon itself --------------------------------------------------------------

heartbeat = timeseries(
    "Heartbeat age",
    [Query(f"time() - {selector(c.LAST_STEP_TIMESTAMP, *RUN_RANK)}", WHO)],
    unit="s",
    description="Seconds since each rank completed its last step, as the rank reports it. A "
    "frozen process stops reporting; the daemon's heartbeat age (GPU nodes) keeps counting.",
    thresholds=steps("green", (MIN_AUTO_STALL_SECONDS, "orange")),
    width=12,
)
internal_errors = timeseries(
    "stabmon internal errors",
    [
        Query(
            sum_by(("run", "rank", "component"), increase(c.INTERNAL_ERRORS, *RUN_RANK)),
            "{{component}} " + WHO,
        )
    ],
    unit="none",
    description="Failures inside stabmon that were contained, per interval: training went on, "
    "but the figures of that component may be missing.",
    bars=True,
    width=12,
)

# --- hang triage (docs/runbooks.md#reading-a-hang-verdict) -------------------------------------

hang_state = timeseries(
    "Stalled ranks: what each waits on",
    [Query(f"{selector(c.HANG_STATE, *RUN_RANK)} == 1", "{{state}} " + WHO)],
    unit="none",
    description="While a rank is stalled: what its main thread does (collective, data_wait, "
    "lock_wait, io, compute). The rank whose state differs from the others' is the one the "
    "others wait on; the StabmonTrainingStalled alert names it and the reason.",
    steps_after=True,
    width=12,
)
loop_phase = timeseries(
    "Loop phase by rank",
    [Query(f"{selector(c.LOOP_PHASE, *RUN_RANK)} == 1", "{{phase}} " + WHO)],
    unit="none",
    description="The loop phase each rank is in now (startup, data_wait, forward, backward, "
    "optimizer, eval, checkpoint...). A rank alone in checkpoint while the others stall in a "
    "barrier is saving, not hung.",
    steps_after=True,
    width=12,
)

dashboard = Dashboard(
    title="stabmon · Training stability",
    uid="stabmon-training",
    description="Steps, gradients, losses, memory and heartbeat of stabmon-monitored training.",
    tags=["stabmon"],
    timezone="browser",
    refresh="30s",
    time=Time("now-6h", "now"),
    graphTooltip=GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
    schemaVersion=39,
    templating=Templating([datasource_variable(), run_variable(), rank_variable()]),
    annotations=Annotations(
        [anomaly_annotation(f"{increase(c.ANOMALIES, *RUN_RANK, window='1m')} > 0")]
    ),
    panels=layout(
        ("Overview", [stalled, leaking, oldest_heartbeat, epoch, anomalies_in_range, environment]),
        ("Runs and nodes", [run_pace, run_ranks, run_anomalies, node_pace, node_anomalies]),
        (
            "Throughput",
            [
                step_rate,
                step_time,
                stragglers,
                data_wait_share,
                data_wait,
                host_phases,
                device_phases,
                device_step_time,
                device_utilization,
            ],
        ),
        ("Throughput, MFU and goodput", THROUGHPUT_PANELS),
        (
            "Optimisation health",
            [loss, grad_norm, module_grad_norm, nonfinite, spikes, zero_grads, loss_scale, skipped],
        ),
        ("Memory", [epoch_memory, drift, device_memory, host_rss]),
        ("Liveness and stabmon itself", [heartbeat, internal_errors]),
        ("Hang triage", [hang_state, loop_phase]),
    ),
)
