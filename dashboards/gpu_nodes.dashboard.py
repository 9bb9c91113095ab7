"""GPU nodes: what the node daemon (``stabmon daemon``) sees from outside the training processes.

GPUs through NVML, and each monitored process's liveness, heartbeat, memory and CPU
through psutil: the view that still works when a training process is frozen or killed.
Legends name the scrape target (``{{instance}}``) so GPUs of different nodes stay apart.
"""

from grafanalib.core import GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR, Dashboard, Templating, Time
from panels import (
    GPUS,
    Query,
    datasource_variable,
    equals,
    gpu_variable,
    increase,
    layout,
    matches,
    rate,
    recorded,
    selector,
    stat,
    steps,
    sum_by,
    timeseries,
    value_text,
)

from stabmon import contract as c
from stabmon.detectors.stall import MIN_AUTO_STALL_SECONDS

GPU = "GPU {{gpu}} · {{instance}}"
WHO = "{{run}}/{{rank}}"
#: Throttle reasons that cost speed; gpu_idle, sync_boost and clock settings are benign.
SLOWDOWNS = tuple(
    reason for reason in c.THROTTLE_REASONS if "slowdown" in reason or reason == "sw_power_cap"
)
#: The daemon's own series carry no rank; the training processes' always do.
DAEMON_ONLY = equals("rank", "")

# --- overview ---------------------------------------------------------------------------------

nvml_up = stat(
    "NVML",
    [Query(f"min({selector(c.DAEMON_NVML_UP)})")],
    unit="none",
    description="Whether NVML answers on every node daemon (the worst node shows).",
    thresholds=steps("red", (1, "green")),
    mappings=value_text(("0", "down", "red"), ("1", "up", "green")),
)
processes_down = stat(
    "Processes down",
    [Query(f"sum(1 - {selector(c.PROCESS_UP)})")],
    unit="none",
    description="Monitored training processes that died without detaching (kept for an hour).",
    thresholds=steps("green", (1, "red")),
    no_value="0",
)
oldest_heartbeat = stat(
    "Oldest heartbeat",
    [Query(f"max({selector(c.HEARTBEAT_AGE)})")],
    unit="s",
    description="Seconds since the slowest monitored process completed a step, seen from "
    "outside: it keeps growing while a process is frozen.",
    thresholds=steps("green", (MIN_AUTO_STALL_SECONDS, "orange")),
)
slowed_down = selector(c.GPU_THROTTLE_ACTIVE, *GPUS, matches("reason", "|".join(SLOWDOWNS)))
throttled = stat(
    "GPUs slowed down",
    [Query(f"sum({sum_by(('uuid',), slowed_down, aggregation='max')})")],
    unit="none",
    description=f"GPUs with a clock slowdown active now ({', '.join(SLOWDOWNS)}).",
    thresholds=steps("green", (1, "orange")),
    no_value="0",
)
wrong_gpu = stat(
    "Wrong-GPU detections in range",
    [
        Query(
            f"sum({increase(c.ANOMALIES, equals('kind', 'device_mismatch'), window='$__range')})",
            instant=True,
        )
    ],
    unit="none",
    description="Processes found holding memory on a GPU they did not declare, over the time "
    "range (CUDA_VISIBLE_DEVICES mix-ups).",
    thresholds=steps("green", (0.5, "red")),
    no_value="0",
    width=8,
)

# --- GPUs -------------------------------------------------------------------------------------

utilization = timeseries(
    "GPU utilization",
    [Query(selector(c.GPU_UTILIZATION, *GPUS), GPU)],
    unit="percentunit",
    description="NVML utilization per GPU. Below the dashed 50% line a training GPU mostly "
    "waits (input, communication, host).",
    min_value=0,
    max_value=1,
    thresholds=steps("red", (0.5, "green")),
    legend_calcs=("mean", "lastNotNull"),
)
memory = timeseries(
    "GPU memory used / total",
    [
        Query(selector(c.GPU_MEMORY_USED, *GPUS), f"used {GPU}"),
        Query(selector(c.GPU_MEMORY_TOTAL, *GPUS), f"total {GPU}"),
    ],
    unit="bytes",
    description="Framebuffer memory used, against each GPU's total.",
)
temperature = timeseries(
    "GPU temperature",
    [Query(selector(c.GPU_TEMPERATURE, *GPUS), GPU)],
    unit="celsius",
    description="Core temperature. Around the dashed 85 °C line most GPUs start thermal "
    "slowdown (see throttle reasons).",
    thresholds=steps("green", (85, "red")),
)
power = timeseries(
    "GPU power",
    [Query(selector(c.GPU_POWER, *GPUS), GPU)],
    unit="watt",
    description="Power draw per GPU; a flat line at the power limit comes with sw_power_cap.",
)
sm_clock = timeseries(
    "SM clock",
    [Query(selector(c.GPU_SM_CLOCK, *GPUS), GPU)],
    unit="hertz",
    description="Streaming-multiprocessor clock; dips line up with throttle reasons.",
)
throttle = timeseries(
    "Throttle reasons active",
    [Query(f"{selector(c.GPU_THROTTLE_ACTIVE, *GPUS)} == 1", "{{reason}} " + GPU)],
    unit="none",
    description="Each clock-throttle reason while it is active (1). gpu_idle is harmless; "
    "thermal and power slowdowns cost speed.",
    steps_after=True,
    min_value=0,
    max_value=1,
)
xid = timeseries(
    "XID errors",
    [
        Query(
            sum_by(("instance", "gpu", "xid"), increase(c.GPU_XID_ERRORS, *GPUS)),
            "XID {{xid}} " + GPU,
        )
    ],
    unit="none",
    description="XID error events per interval. 48, 63, 64, 74, 79, 92, 94, 95 point at "
    "hardware or driver trouble; 13, 31, 43 usually at the application.",
    bars=True,
    thresholds=steps("green", (1, "red")),
)
ecc = timeseries(
    "ECC errors",
    [
        Query(
            sum_by(("instance", "gpu", "type"), increase(c.GPU_ECC_ERRORS, *GPUS)),
            "{{type}} " + GPU,
        )
    ],
    unit="none",
    description="ECC errors per interval: corrected ones are a warning, uncorrected ones "
    "corrupt results.",
    bars=True,
    thresholds=steps("green", (1, "red")),
)

# --- training processes -----------------------------------------------------------------------

process_gpu_memory = timeseries(
    "GPU memory per process",
    [
        Query(
            sum_by(("instance", "gpu", "rank", "pid"), selector(c.PROCESS_GPU_MEMORY, *GPUS)),
            "GPU {{gpu}} · rank {{rank}} · pid {{pid}}",
        )
    ],
    unit="bytes",
    description="Memory each monitored process (and its workers) holds on each physical GPU. "
    "A rank on two GPUs, or two ranks on one, is a placement mistake.",
    stacked=True,
)
heartbeat_age = timeseries(
    "Heartbeat age",
    [Query(selector(c.HEARTBEAT_AGE), WHO)],
    unit="s",
    description="Seconds since each process last completed a step (since attach before the "
    "first), from its run-directory record.",
    thresholds=steps("green", (MIN_AUTO_STALL_SECONDS, "orange")),
)
process_up = timeseries(
    "Process up",
    [Query(selector(c.PROCESS_UP), WHO + " · pid {{pid}}")],
    unit="none",
    description="1 while a monitored process is alive; 0 once it died without detaching "
    "(crash, OOM kill, SIGKILL).",
    steps_after=True,
    min_value=0,
    max_value=1,
    thresholds=steps("red", (1, "green")),
)
process_memory = timeseries(
    "Process memory: main vs workers",
    [Query(sum_by(("run", "rank", "scope"), selector(c.PROCESS_MEMORY)), "{{scope}} " + WHO)],
    unit="bytes",
    description="Proportional set size of each training process (main) and of its children "
    "(workers): a slow leak in data loader workers shows in workers.",
    width=12,
)
process_cpu = timeseries(
    "Process CPU: main vs workers",
    [Query(sum_by(("run", "rank", "scope"), rate(c.PROCESS_CPU_SECONDS)), "{{scope}} " + WHO)],
    unit="suffix: cores",
    description="CPU seconds per second of each training process and its workers: workers "
    "pinned at their count mean the input pipeline is CPU-bound.",
    width=12,
)

# --- nodes: recorded per-node aggregates and forecasts (issue 39) ------------------------------
# One series a node (a daemon target), recorded each minute by the stabmon.aggregates and
# stabmon.forecasts rules: the fleet view of a thousand nodes, where the per-GPU panels are
# best filtered to a few GPUs.

NODE = "{{instance}} {{node}}"

node_utilization = timeseries(
    "GPU utilization per node (mean of its GPUs)",
    [Query(recorded("node:stabmon_gpu_utilization_ratio:avg"), NODE)],
    unit="percentunit",
    description="The mean NVML utilization of each node's GPUs. A node well below the others "
    "in one run starves its GPUs (input, host) or waits for a slower one.",
    min_value=0,
    max_value=1,
    legend_calcs=("lastNotNull", "min"),
    width=12,
)
node_forecast = timeseries(
    "Memory in 72 h at the last hour's trend, per node",
    [
        Query(
            recorded("node:stabmon_gpu_memory_used_bytes:max_predict72h_ratio"),
            "worst GPU " + NODE,
        ),
        Query(recorded("node:stabmon_process_memory_bytes:predict72h_ratio"), "host " + NODE),
    ],
    unit="percentunit",
    description="The node's GPU whose framebuffer fills first and the host memory of its "
    "training processes, 72 hours ahead at the last hour's trend, as a share of the total: "
    "what StabmonMemoryExhaustionForecast reads (above 100% while over half is used).",
    thresholds=steps("green", (1, "red")),
    width=12,
)
node_host_memory = timeseries(
    "Host memory held by training, per node",
    [Query(recorded("node:stabmon_process_memory_bytes:ratio"), NODE)],
    unit="percentunit",
    description="Memory (PSS) of every monitored process and its data loader workers as a "
    "share of the node's memory.",
    min_value=0,
    max_value=1,
    width=12,
)
node_xids = timeseries(
    "XID errors per node (last hour)",
    [Query(recorded("node:stabmon_gpu_xid_errors:increase1h") + " > 0", NODE)],
    unit="none",
    description="XID events on any GPU of the node over the last hour: a node that keeps "
    "reporting them is one to drain.",
    bars=True,
    width=12,
)

# --- the daemon itself ------------------------------------------------------------------------

poll_duration = timeseries(
    "Daemon poll duration",
    [Query(selector(c.DAEMON_POLL_DURATION), "{{poller}} · {{instance}}")],
    unit="s",
    description="Wall time of each poller's last pass. One approaching --interval (5 s by "
    "default) makes the figures late.",
)
since_last_poll = timeseries(
    "Since last poll",
    [Query(f"time() - {selector(c.DAEMON_LAST_POLL)}", "{{poller}} · {{instance}}")],
    unit="s",
    description="Seconds since each poller last completed: a hung NVML call grows here while "
    "the process poller goes on.",
)
daemon_errors = timeseries(
    "Daemon internal errors",
    [
        Query(
            sum_by(("instance", "component"), increase(c.INTERNAL_ERRORS, DAEMON_ONLY)),
            "{{component}} · {{instance}}",
        )
    ],
    unit="none",
    description="Failures inside the daemon that were contained, per interval.",
    bars=True,
)

dashboard = Dashboard(
    title="stabmon · GPU nodes",
    uid="stabmon-gpu-nodes",
    description="GPUs (NVML) and monitored training processes, from stabmon's node daemon.",
    tags=["stabmon"],
    timezone="browser",
    refresh="30s",
    time=Time("now-6h", "now"),
    graphTooltip=GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
    schemaVersion=39,
    templating=Templating([datasource_variable(), gpu_variable()]),
    panels=layout(
        ("Overview", [nvml_up, processes_down, oldest_heartbeat, throttled, wrong_gpu]),
        ("Nodes", [node_utilization, node_forecast, node_host_memory, node_xids]),
        ("GPUs", [utilization, memory, temperature, power, sm_clock, throttle, xid, ecc]),
        (
            "Training processes",
            [process_gpu_memory, heartbeat_age, process_up, process_memory, process_cpu],
        ),
        ("Daemon", [poll_duration, since_last_poll, daemon_errors]),
    ),
)
