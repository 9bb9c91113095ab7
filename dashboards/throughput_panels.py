"""Throughput, MFU, goodput, slowdown and input-starvation panels of the training dashboard.

Kept beside ``panels.py`` rather than in the dashboard file, so the row reads as one
unit: ``training_stability.dashboard.py`` places it with ``("Throughput, MFU and
goodput", THROUGHPUT_PANELS)``.
"""

from __future__ import annotations

from panels import RUN_RANK, Query, matches, rate, selector, steps, sum_by, timeseries

from stabmon import contract as c

RANK = ("run", "rank")
WHO = "{{run}}/{{rank}}"
#: The built-in loop phases: a step's time; named phases (eval, checkpoint) are not training.
TRAINING_PHASES = matches("phase", "forward|backward|optimizer")
LOOP_PHASES = matches("phase", "|".join(c.PHASES))

samples_rate = timeseries(
    "Samples per second",
    [
        Query(sum_by(RANK, rate(c.SAMPLES, *RUN_RANK)), WHO),
        Query(sum_by(("run",), rate(c.SAMPLES, *RUN_RANK)), "{{run}} (all ranks)"),
    ],
    unit="suffix: samples/s",
    description="Training samples handed to the loop per second (the leading dimension of each "
    "batch track() yields, or observe(samples=...)), per rank and summed over the run's ranks.",
    legend_calcs=("lastNotNull", "min"),
)
tokens_rate = timeseries(
    "Tokens per second",
    [
        Query(sum_by(RANK, rate(c.TOKENS, *RUN_RANK)), WHO),
        Query(sum_by(("run",), rate(c.TOKENS, *RUN_RANK)), "{{run}} (all ranks)"),
    ],
    unit="suffix: tokens/s",
    description="Training tokens per second: input_ids seen by track() (padding included) or "
    "observe(tokens=...). Empty when the loop reports no tokens.",
    legend_calcs=("lastNotNull", "min"),
)
mfu = timeseries(
    "MFU (GPU only)",
    [
        Query(sum_by(RANK, selector(c.MFU, *RUN_RANK), aggregation="max"), WHO),
        Query(
            f"{sum_by(RANK, rate(c.MODEL_FLOPS, *RUN_RANK))}"
            f" / {sum_by(RANK, selector(c.PEAK_FLOPS, *RUN_RANK), aggregation='max')}",
            "over wall time " + WHO,
        ),
    ],
    unit="percentunit",
    description="Model FLOPs utilization: FLOPs per step (counted once with FlopCounterMode, or "
    "throughput.flops_per_step) x steps per second / the GPU's peak dense FLOP/s for the step's "
    "dtype. The first line leaves named phases (eval, checkpoint) out; 'over wall time' counts "
    "them. Absent on CPU and for GPUs not in the peak table (set throughput.peak_flops). See "
    "docs/throughput.md for what is counted (recomputation is).",
    min_value=0,
    max_value=1,
)
goodput = timeseries(
    "Goodput: share of time in training phases",
    [
        Query(sum_by(RANK, rate(c.PHASE_SECONDS, *RUN_RANK, TRAINING_PHASES)), WHO),
    ],
    unit="percentunit",
    description="Seconds per second each rank spends in forward, backward and the optimizer step; "
    "the rest is input wait, evaluation, checkpointing and other named phases, start-up and "
    "stalls. A restart shows as a gap. `stabmon report` gives the whole run's goodput across "
    "restarts, with the time lost to each cause.",
    min_value=0,
    max_value=1,
    thresholds=steps("orange", (0.8, "green")),
)
_STEP_TIME = (
    f"{sum_by(RANK, rate(c.PHASE_SECONDS, *RUN_RANK, LOOP_PHASES))}"
    f" / {sum_by(RANK, rate(c.STEPS, *RUN_RANK))}"
)
slowdown = timeseries(
    "Step time against its baseline",
    [
        Query(_STEP_TIME, "step time " + WHO),
        Query(
            sum_by(
                RANK,
                selector(c.STEP_TIME_BASELINE, *RUN_RANK),
                aggregation="max",
            ),
            "baseline " + WHO,
        ),
    ],
    unit="s",
    description="Mean step time over the loop's own phases (named phases left out) and the "
    "slowdown rule's baseline (median of the recent normal blocks). StabmonTrainingSlowdown "
    "fires when the step time stays 10% above the baseline for 5 minutes.",
)
slowdown_active = timeseries(
    "Slowdown held, by phase",
    [
        Query(
            sum_by(
                ("run", "rank", "phase"),
                selector(c.SLOWDOWN_ACTIVE, *RUN_RANK),
                aggregation="max",
            ),
            "{{phase}} " + WHO,
        )
    ],
    unit="none",
    description="1 while the in-process slowdown rule holds, on the phase whose time per step "
    "grew most (data_wait: the input pipeline; forward, backward, optimizer: compute, GPU or "
    "communication).",
    min_value=0,
    max_value=1,
    steps_after=True,
)

_INPUT_SHARE = (
    f"{sum_by(RANK, rate(c.PHASE_SECONDS, *RUN_RANK, matches('phase', 'data_wait')))}"
    f" / {sum_by(RANK, rate(c.PHASE_SECONDS, *RUN_RANK, LOOP_PHASES))}"
)
input_starvation = timeseries(
    "Input starvation: share of training time waiting for batches",
    [
        Query(_INPUT_SHARE, "input wait " + WHO),
        Query(
            sum_by(RANK, selector(c.INPUT_STARVATION_ACTIVE, *RUN_RANK), aggregation="max"),
            "starvation held " + WHO,
        ),
    ],
    unit="percentunit",
    description="The host's input wait over the loop's own phases (named phases left out), and 1 "
    "while the in-process input_starvation rule holds (on CUDA it judges the device's idle time "
    "for input). StabmonInputStarvation fires when the rule holds: at least 30% of the training "
    "time over 30 s, still a minute later.",
    min_value=0,
    max_value=1,
    thresholds=steps("green", (0.3, "orange")),
)

THROUGHPUT_PANELS = [
    samples_rate, tokens_rate, mfu, goodput, slowdown, slowdown_active, input_starvation,
]  # fmt: skip
