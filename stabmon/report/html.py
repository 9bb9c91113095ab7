"""``stabmon report``: one self-contained HTML page about a run, from its event logs.

The page needs nothing but a browser: styles are inline, plots are inline SVG,
no script and no network request. Every section has a fixed ``id`` (listed in
``SECTION_IDS``) so tools and tests can find it. Everything taken from a log is
escaped: run ids, module names and stack traces are user data.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Mapping
from html import escape
from pathlib import Path
from typing import Any

from stabmon.errors import StabmonError
from stabmon.report.events import RankLog, Run, number, read_run
from stabmon.report.goodput import goodput_section
from stabmon.report.incidents import incidents_section
from stabmon.report.plots import KIND_COLORS, Plots, require_matplotlib
from stabmon.report.verdict import judge, when

__all__ = ["SECTION_IDS", "STYLE", "render", "write_page_atomically", "write_report"]

SECTION_IDS = (
    "verdict",
    "environment",
    "loss",
    "grad-norm",
    "step-time",
    "memory",
    "gpu-utilization",
    "anomalies",
    "notes",
)
_STACK_CHARS = 6000

#: The page's inline style sheet (``stabmon compare``'s page uses it too).
STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;
 color:#1a202c;background:#f7fafc}
main{max-width:1180px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:0 0 10px}
.sub{color:#4a5568;font-size:13px}
section{background:#fff;border:1px solid #e2e8f0;border-radius:6px;padding:16px 18px;margin:16px 0}
.verdict{font-size:17px;font-weight:600;padding:12px 14px;border-radius:5px}
.ok{background:#e6f6ec;color:#1c5e35;border-left:6px solid #2f855a}
.bad{background:#fdecec;color:#822727;border-left:6px solid #c53030}
table{border-collapse:collapse;font-size:13px;width:100%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #edf2f7;vertical-align:top}
th{color:#4a5568;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.kind{display:inline-block;padding:1px 7px;border-radius:10px;color:#fff;font-size:12px}
.empty{color:#718096;font-style:italic}
svg{width:100%;height:auto;display:block}
pre{font-size:11px;max-height:320px;overflow:auto;background:#f7fafc;padding:8px}
ul{margin:6px 0;padding-left:20px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:0 24px}
"""


def write_report(run_path: Path, output: Path, *, module_rank: int | None = None) -> Run:
    """Read the run at ``run_path`` and write its report to ``output`` (atomically)."""
    require_matplotlib()  # before reading: a missing extra is the first thing to say
    run = read_run(run_path)
    ranks = sorted(log.rank for log in run.ranks)
    if module_rank is not None and module_rank not in ranks:
        raise StabmonError(
            f"module rank {module_rank}: run {run.run_id} has no rank {module_rank} (its ranks: "
            f"{', '.join(map(str, ranks)) or 'none'}); pass one of them to --module-rank"
        )
    write_page_atomically(output, render(run, module_rank=module_rank))
    return run


def write_page_atomically(output: Path, page: str) -> None:
    """Write ``page`` to ``output`` through a new temporary file beside it, then rename.

    rename(2) is atomic, so a browser reloading the page never sees half of it, and it
    replaces a symlink at ``output`` rather than writing through it. The temporary name
    is unique (pid and random) and opened with O_EXCL and O_NOFOLLOW: in a shared folder,
    a link planted under a predictable name would otherwise redirect the write.
    """
    temporary = output.with_name(f".{output.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(page)
        os.replace(temporary, output)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def render(run: Run, *, module_rank: int | None = None, now: float | None = None) -> str:
    """The report of ``run`` as one HTML document."""
    plots = Plots(run, module_rank=module_rank)
    verdict = judge(run)
    generated = when(time.time() if now is None else now)
    running = any(log.state == "running" for log in run.ranks)
    snapshot = (
        " The run is still going: this is a snapshot; run the command again for more."
        if running
        else ""
    )
    sections = [
        _verdict_section(run, verdict.healthy, verdict.headline, verdict.findings),
        _environment_section(run),
        _plot_section(
            "loss", "Loss", plots.loss(), "No loss was observed (mon.observe(loss=...))."
        ),
        _plot_section(
            "grad-norm", "Gradient norm", plots.grad_norm(), "No gradient norm was measured."
        ),
        _plot_section(
            "step-time", "Step time and input wait", plots.step_time(), "No step was timed."
        ),
        goodput_section(run),
        _plot_section(
            "memory",
            "Memory per epoch",
            plots.memory(),
            "No epoch has ended yet, so no epoch-end memory sample was taken.",
            caption="Dotted: the leak rule's threshold for each window (the window's first "
            "sample plus leak_threshold); a leak is suspected after leak_windows windows "
            "in a row end above theirs.",
        ),
        _plot_section(
            "gpu-utilization",
            "GPU utilization",
            plots.gpu_utilization(),
            "Not recorded: this run used no CUDA device.",
        ),
        _anomaly_section(run),
        incidents_section(run),
        _notes_section(run),
    ]
    title = f"stabmon report: {run.run_id}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body><main>"
        f'<h1>{escape(title)}</h1><div class="sub">{escape(str(run.directory))} &middot; '
        f"generated {escape(generated)}{escape(snapshot)}</div>"
        + "".join(sections)
        + "</main></body></html>\n"
    )


def _verdict_section(run: Run, healthy: bool, headline: str, findings: tuple[str, ...]) -> str:
    rows = "".join(_rank_row(log) for log in run.ranks)
    listing = "".join(f"<li>{escape(line)}</li>" for line in findings)
    return (
        '<section id="verdict"><h2>Verdict</h2>'
        f'<div class="verdict {"ok" if healthy else "bad"}">{escape(headline)}</div>'
        + (f"<ul>{listing}</ul>" if listing else "")
        + "<table><tr><th>rank</th><th>host</th><th>pid</th><th>state</th>"
        '<th class="num">last step</th><th class="num">epochs</th><th>started</th>'
        f"<th>last record</th></tr>{rows}</table></section>"
    )


def _rank_row(log: RankLog) -> str:
    attach = log.attach
    environment = _dict(attach.get("environment"))
    last = log.records[-1] if log.records else {}
    resumes = len(log.of("attach")) - 1
    state = log.state + (f" (resumed {resumes}x)" if resumes > 0 else "")
    cells = (
        str(log.rank),
        str(environment.get("hostname", "")),
        # Every process of the rank, in order: a resumed run is several.
        ", ".join(dict.fromkeys(str(a["pid"]) for a in log.of("attach") if "pid" in a)),
        state,
        "-" if log.last_step is None else f"{log.last_step:,}",
        str(len(log.of("epoch"))),
        when(number(attach.get("time"))),
        when(number(last.get("time"))),
    )
    classes = ("", "", "", "", ' class="num"', ' class="num"', "", "")
    return (
        "<tr>"
        + "".join(f"<td{css}>{escape(cell)}</td>" for css, cell in zip(classes, cells, strict=True))
        + "</tr>"
    )


def _environment_section(run: Run) -> str:
    first = next((log for log in run.ranks if log.attach), None)
    if first is None:
        return _plot_section("environment", "Environment", None, "No attach record was read.")
    attach = first.attach
    environment = _dict(attach.get("environment"))
    versions = _dict(environment.get("versions"))
    facts: list[tuple[str, Any]] = [*versions.items()]
    facts += [
        ("driver_version", environment.get("driver_version") or "- (no NVML driver)"),
        ("hostname", environment.get("hostname")),
        ("platform", environment.get("platform")),
        ("python", environment.get("python_executable")),
        ("cpus", f"{environment.get('cpu_count')} (torch threads "
                 f"{environment.get('torch_threads')})"),
        ("CUDA devices", environment.get("cuda_device_count")
                         if environment.get("cuda_available") else "not available"),
        ("CUDA_VISIBLE_DEVICES", environment.get("cuda_visible_devices") or "unset"),
        ("parameters", attach.get("parameters")),
        ("module groups", ", ".join(map(str, attach.get("module_groups") or [])) or "-"),
    ]  # fmt: skip
    left = _key_table(facts)
    gpus = environment.get("gpus")
    gpus = gpus if isinstance(gpus, list) else []
    gpu_rows = "".join(
        "<tr>" + "".join(f"<td>{escape(str(gpu.get(c, '')))}</td>" for c in
                         ("device", "gpu", "uuid", "pci_bus_id", "name")) + "</tr>"
        for gpu in gpus if isinstance(gpu, dict)
    )  # fmt: skip
    variables = _dict(environment.get("variables"))
    inside = environment.get("set_in_process")
    inside = set(map(str, inside)) if isinstance(inside, list) else set()
    shown = {
        name: f"{value} (set inside the process, by torch or stabmon)" if name in inside else value
        for name, value in variables.items()
    }
    right = '<h3 style="font-size:14px;margin:0 0 6px">Variables</h3>' + (
        _key_table(sorted(shown.items())) if shown else '<p class="empty">none set</p>'
    )
    if gpu_rows:
        right += (
            '<h3 style="font-size:14px;margin:10px 0 6px">GPUs</h3><table><tr><th>device</th>'
            f"<th>gpu</th><th>uuid</th><th>pci</th><th>name</th></tr>{gpu_rows}</table>"
        )
    differing = [
        log.rank
        for log in run.ranks
        if log.attach and isinstance(log.attach.get("environment"), dict)
        and log.attach["environment"].get("versions") != versions
    ]  # fmt: skip
    warning = (
        f'<p class="bad verdict">Ranks {", ".join(map(str, differing))} run other versions '
        f"than rank {first.rank}.</p>"
        if differing
        else ""
    )
    config = json.dumps(first.config, indent=2, sort_keys=True)
    return (
        f'<section id="environment"><h2>Environment (rank {first.rank}, at attach)</h2>{warning}'
        f'<div class="grid"><div>{left}</div><div>{right}</div></div>'
        f"<details><summary>Effective config</summary><pre>{escape(config)}</pre></details>"
        "</section>"
    )


def _key_table(pairs: list[tuple[str, Any]]) -> str:
    rows = "".join(
        f"<tr><th>{escape(str(key))}</th><td>{escape(_text(value))}</td></tr>"
        for key, value in pairs
    )
    return f"<table>{rows}</table>"


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _plot_section(
    section_id: str, title: str, svg: str | None, empty: str, *, caption: str = ""
) -> str:
    body = svg if svg is not None else f'<p class="empty">{escape(empty)}</p>'
    note = f'<p class="sub">{escape(caption)}</p>' if caption and svg is not None else ""
    return f'<section id="{section_id}"><h2>{escape(title)}</h2>{body}{note}</section>'


def _anomaly_section(run: Run) -> str:
    anomalies = run.anomalies()
    if not anomalies:
        return (
            '<section id="anomalies"><h2>Anomalies</h2>'
            '<p class="empty">None: no anomaly was recorded.</p></section>'
        )
    rows = []
    for record in anomalies:
        kind = str(record.get("kind"))
        color = KIND_COLORS.get(kind, "#444444")
        stacks = record.get("stacks")
        extra = ""
        if isinstance(stacks, (str, Mapping, list)):
            text = stacks if isinstance(stacks, str) else json.dumps(stacks, indent=1)
            extra = (
                "<details><summary>stacks</summary>"
                f"<pre>{escape(text[:_STACK_CHARS])}</pre></details>"
            )
        rows.append(
            f'<tr class="anomaly"><td class="num">{escape(str(record.get("step")))}</td>'
            f"<td>{escape(when(number(record.get('time'))))}</td>"
            f'<td class="num">{escape(str(record.get("rank")))}</td>'
            f'<td><span class="kind" style="background:{color}">{escape(kind)}</span></td>'
            f"<td>{escape(_detail(record))}{extra}</td></tr>"
        )
    return (
        f'<section id="anomalies"><h2>Anomalies ({len(anomalies)})</h2><table>'
        '<tr><th class="num">step</th><th>time</th><th class="num">rank</th><th>kind</th>'
        f"<th>detail</th></tr>{''.join(rows)}</table></section>"
    )


_PLAIN_FIELDS = frozenset({"time", "event", "run", "rank", "kind", "step", "epoch", "stacks"})


def _detail(record: Mapping[str, Any]) -> str:
    detail = record.get("detail")
    if isinstance(detail, str):
        return detail
    # Logs written before anomalies carried their message: the fields say it.
    return ", ".join(f"{key}={value}" for key, value in record.items() if key not in _PLAIN_FIELDS)


def _notes_section(run: Run) -> str:
    notes = [*run.notes, *(note for log in run.ranks for note in log.notes)]
    body = (
        "<ul>" + "".join(f"<li>{escape(note)}</li>" for note in notes) + "</ul>"
        if notes
        else '<p class="empty">Every line of every event log was read.</p>'
    )
    logs = "".join(
        f"<li>{escape(str(log.path))} ({len(log.records)} records)</li>" for log in run.ranks
    )
    return (
        f'<section id="notes"><h2>Notes</h2>{body}<p class="sub">Read:</p><ul>{logs}</ul></section>'
    )
