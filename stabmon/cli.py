"""The ``stabmon`` command: ``demo``, ``daemon``, ``check-config``, ``env``, ``report``,
``compare``, ``status``.

Errors are one line on stderr and exit code 2; nothing prints a traceback for
a mistake the user can fix.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from stabmon._version import __version__
from stabmon.config import Config, load_config
from stabmon.errors import ConfigError, StabmonError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse declares NoReturn
        sys.stderr.write(f"stabmon: error: {message} (see `stabmon --help`)\n")
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stabmon", description="Stability monitoring for long PyTorch runs.")
    parser.add_argument("--version", action="version", version=f"stabmon {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_running(commands)
    _add_report(commands)
    _add_compare(commands)
    _add_status(commands)
    for choice in commands._choices_actions:  # `stabmon X --help` opens with what X does
        sub = commands.choices[choice.dest]
        sub.description = sub.description or choice.help
    return parser


def _add_running(commands: argparse._SubParsersAction[_Parser]) -> None:
    """The commands that run something: demo, env, check-config, daemon."""
    demo = commands.add_parser(
        "demo", help="train a small CPU model with faults injected and show what stabmon detects"
    )
    demo.add_argument("--port", type=int, default=9400, help="exporter port (0: any free port)")
    demo.add_argument("--run-dir", help="where the event log goes (default: /var/tmp/stabmon)")
    demo.add_argument(
        "--fast",
        action="store_true",
        help="the same story compressed: 480 steps, about 15 s on 2 busy cores",
    )
    demo.add_argument(
        "--serve", type=float, default=0.0, metavar="SECONDS",
        help="keep serving the metrics this long after training (in phase 'serve': no stall)",
    )  # fmt: skip

    env = commands.add_parser(
        "env", help="print what stabmon records about this machine's environment at attach"
    )
    env.add_argument("--json", action="store_true", help="the record as JSON")

    check = commands.add_parser("check-config", help="validate a YAML config file (exit 0 or 2)")
    check.add_argument("file")

    daemon = commands.add_parser(
        "daemon", help="serve GPU, process and liveness telemetry of this node (one per node)"
    )
    daemon.add_argument("--config", help="YAML config file (the same schema as the library)")
    daemon.add_argument("--port", type=int, help="HTTP port (default 9399; 0: any free port)")
    daemon.add_argument("--address", help="bind address (default 0.0.0.0)")
    daemon.add_argument("--run-dir", help="run directory to watch (default /var/tmp/stabmon)")
    daemon.add_argument("--interval", type=float, help="poll interval in seconds (default 5)")


def _add_report(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``stabmon report``: a run's event logs as one page."""
    report = commands.add_parser(
        "report", help="write one self-contained HTML page about a run, from its event logs"
    )
    report.add_argument(
        "run_dir", metavar="RUN_DIR",
        help="<run_dir>/<run_id> (or one rank's event log, or the root: its latest run)",
    )  # fmt: skip
    report.add_argument(
        "-o", "--output", default="report.html", help="default: report.html in this directory"
    )
    report.add_argument(
        "--module-rank", type=int, metavar="RANK",
        help="whose per-module gradient norms to plot (default: the lowest rank)",
    )  # fmt: skip


def _add_status(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``stabmon status``: scrape running exporters."""
    status = commands.add_parser(
        "status", help="scrape running exporters; one line per rank; exit 1 when any is unhealthy"
    )
    status.add_argument(
        "urls", nargs="*", metavar="URL",
        help="exporter URLs (default: those registered in the run directory)",
    )  # fmt: skip
    status.add_argument(
        "--run-dir", help="run directory (default: $STABMON_DIR or /var/tmp/stabmon)"
    )
    status.add_argument("--run", help="only this run id's ranks")
    status.add_argument(
        "--all", action="store_true",
        help="every user's runs in the run directory (default: only yours; never sent "
        "--basic-auth-file)",
    )  # fmt: skip
    status.add_argument(
        "--timeout", type=float, default=5.0,
        help="seconds for the whole command: every rank is scraped at once (default 5)",
    )  # fmt: skip
    status.add_argument(
        "--cafile", help="PEM certificate(s) to trust for https:// exporters (their tls_certfile)"
    )
    status.add_argument(
        "--basic-auth-file", help="file whose first line is username:password (basic_auth_file)"
    )


def _add_compare(commands: argparse._SubParsersAction[_Parser]) -> None:
    compare = commands.add_parser(
        "compare",
        help="why run B is slower, bigger or noisier than run A: exit 1 when B regressed",
    )
    compare.add_argument("run_a", metavar="RUN_A", help="the reference run: <run_dir>/<run_id>")
    compare.add_argument("run_b", metavar="RUN_B", help="the run compared with it")
    compare.add_argument("--rank", type=int, help="compare only this rank (default: every rank)")
    compare.add_argument("--json", action="store_true", help="the comparison as JSON on stdout")
    compare.add_argument(
        "-o", "--output", help="also write an HTML page with both runs on the same plots"
    )


def _load_with_flags(
    config_file: str | None, given: dict[str, object], flags: dict[str, str]
) -> Config:
    """load_config with the command line's values as overrides; a bad one names its flag."""
    overrides = {key: value for key, value in given.items() if value is not None}
    try:
        return load_config(config_file, overrides, env=os.environ)
    except ConfigError as error:
        if error.key not in overrides or error.key not in flags:
            raise
        # The command line's values reach load_config as overrides: name the flag, not attach().
        raise ConfigError(
            error.problem, key=flags[error.key], source="the command line", allowed=error.allowed
        ) from None


def _directory_or_absent(path: str | None, flag: str) -> None:
    """A run directory that exists must be a directory (one that does not yet is made later)."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise StabmonError(
            f"{flag} {path} is not a directory; name the folder where stabmon keeps its run records"
        )


def _safe_root(run_dir: str | None, flag: str) -> None:
    """The daemon's run-directory root must be one no other user controls (a ConfigError)."""
    from stabmon.shared.rundir import DEFAULT_RUN_DIR, check_root
    from stabmon.shared.safefs import UnsafePathError

    try:
        check_root(Path(run_dir) if run_dir else DEFAULT_RUN_DIR)
    except UnsafePathError as error:
        raise ConfigError(
            str(error), key=flag, source="the command line" if flag.startswith("--") else "config"
        ) from None


def _demo(args: argparse.Namespace) -> int:
    from stabmon.demo import DemoPlan, run_demo

    _load_with_flags(None, {"port": args.port, "run_dir": args.run_dir},
                     {"port": "--port", "run_dir": "--run-dir"})  # fmt: skip
    _directory_or_absent(args.run_dir, "--run-dir")
    if not (args.serve >= 0 and math.isfinite(args.serve)):
        raise StabmonError(f"--serve must be a number of seconds >= 0, got {args.serve}")
    plan = DemoPlan.fast() if args.fast else DemoPlan()
    detected = run_demo(plan, port=args.port, run_dir=args.run_dir, serve_seconds=args.serve)
    return 0 if detected else 1


def _report(args: argparse.Namespace) -> int:
    from stabmon.report.html import write_report  # lazily: matplotlib is an optional extra

    run_path, output = Path(args.run_dir), Path(args.output)
    folder = output.parent
    if not folder.is_dir():
        raise StabmonError(
            f"cannot write the report to {output}: the folder {folder} does not exist; "
            "create it, or name a file in an existing folder with -o"
        )
    try:
        run = write_report(run_path, output, module_rank=args.module_rank)
    except OSError as error:  # a folder we may not write to, a full disk
        raise StabmonError(
            f"cannot write the report to {output}: {error.strerror or error}; "
            "name a file in a folder you can write to with -o"
        ) from None
    for note in run.notes:
        print(f"stabmon report: {note}")
    print(f"stabmon report: {output} ({len(run.ranks)} rank(s) of run {run.run_id})")
    return 0


def _compare(args: argparse.Namespace) -> int:
    """``stabmon compare``: exit 0, 1 when B regressed (CI gates on it), 2 on any error."""
    try:
        return _compare_runs(args)
    except (StabmonError, KeyboardInterrupt):
        raise
    except Exception as error:  # a run directory holds anything: never a traceback, never 1
        raise StabmonError(
            f"compare failed on what the runs hold ({type(error).__name__}: {error}); "
            "please report it with the two run directories"
        ) from None


def _compare_runs(args: argparse.Namespace) -> int:
    import json

    from stabmon.report.compare import compare_runs, read_for_compare
    from stabmon.report.compare_text import format_comparison

    output = Path(args.output) if args.output else None
    if output is not None:
        from stabmon.report.plots import require_matplotlib

        require_matplotlib()  # before reading: a missing extra is the first thing to say
        if not output.parent.is_dir():
            raise StabmonError(
                f"cannot write the page to {output}: the folder {output.parent} does not exist; "
                "create it, or name a file in an existing folder with -o"
            )
    comparison = compare_runs(
        read_for_compare(Path(args.run_a), "A"), read_for_compare(Path(args.run_b), "B"), args.rank
    )
    if output is not None:
        from stabmon.report.compare_html import write_page

        try:
            write_page(comparison, output)
        except OSError as error:  # a folder we may not write to, a full disk
            raise StabmonError(
                f"cannot write the page to {output}: {error.strerror or error}; "
                "name a file in a folder you can write to with -o"
            ) from None
    if args.json:
        text = json.dumps(comparison.to_json(), indent=2, allow_nan=False)
    else:
        text = format_comparison(comparison)
        text += f"\n\nstabmon compare: {output}" if output is not None else ""
    _print_to_pipe(text)
    return 1 if comparison.verdict.regressed else 0


def _print_to_pipe(text: str) -> None:
    """Print ``text``; a reader that stopped early (``| head -1``) is no error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that says nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _status(args: argparse.Namespace) -> int:
    from stabmon.report.status import Credentials, format_table, require_urls, scrape_status
    from stabmon.report.status_targets import RegisteredTarget, registered
    from stabmon.shared.rundir import DEFAULT_RUN_DIR, check_root
    from stabmon.shared.safefs import UnsafePathError

    if not (args.timeout > 0 and args.timeout < 86400):
        raise StabmonError(f"--timeout must be a number of seconds above 0, got {args.timeout}")
    credentials = Credentials.from_files(args.cafile, args.basic_auth_file)
    targets: list[str | RegisteredTarget] = list(args.urls)
    if not targets:
        source = "--run-dir" if args.run_dir else "$STABMON_DIR"
        given = args.run_dir or os.environ.get("STABMON_DIR")
        _directory_or_absent(given, source)
        root = Path(given or DEFAULT_RUN_DIR)
        try:  # a root another user owns (or a symlink) could list anything as ours
            check_root(root.parent if any(root.glob("rank-*.json")) else root)
        except UnsafePathError as error:
            raise StabmonError(f"{source}: {error}") from None
        # Keyed by record: each row is one record's run and rank, never a shared URL's.
        found = registered(root, args.run, everyone=args.all)
        targets = list(found.targets)
        require_urls(targets, root, found.others)
    statuses = scrape_status(targets, timeout=args.timeout, credentials=credentials)
    print(format_table(statuses))
    from stabmon.report.hang import format_verdicts

    for line in format_verdicts(statuses):
        print(line)
    if not args.urls:  # the run directory's event logs say where a NaN came from
        from stabmon.report.status_provenance import provenance_lines

        for line in provenance_lines(statuses, targets, root):
            print(line)
    return 0 if all(status.healthy for status in statuses) else 1


def _run_daemon(args: argparse.Namespace) -> int:
    from stabmon.daemon.app import DaemonApp  # lazily: the library never loads the daemon
    from stabmon.export.exporter import Security

    flags = {"daemon.port": "--port", "daemon.address": "--address",
             "daemon.interval": "--interval", "run_dir": "--run-dir"}  # fmt: skip
    given = {"daemon.port": args.port, "daemon.address": args.address,
             "daemon.interval": args.interval, "run_dir": args.run_dir}  # fmt: skip
    config = _load_with_flags(args.config, given, flags)
    _directory_or_absent(
        config.run_dir, "--run-dir" if args.run_dir else "run_dir (config file or $STABMON_DIR)"
    )
    _safe_root(config.run_dir, "--run-dir" if args.run_dir else "run_dir")
    address = config.daemon.address
    try:
        socket.getaddrinfo(address, None)
    except (OSError, UnicodeError) as error:
        raise StabmonError(
            f"--address {address} is not an address this machine can bind "
            f"({getattr(error, 'strerror', None) or error}); use 0.0.0.0 for every interface, "
            "127.0.0.1, or one of this node's own addresses"
        ) from None
    problem = Security.from_config(config).problem()
    if problem is not None:
        where = f" in {args.config}" if args.config else ""
        raise StabmonError(f"{problem}{where}; fix it, or remove it to serve plain HTTP")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = DaemonApp(config)
    if not app.start():
        sys.stderr.write(
            f"stabmon: error: could not bind {address}:{config.daemon.port}: the port is in use "
            "or the address is not one of this machine's; choose a free --port (0: any) or "
            "another --address\n"
        )
        return 2
    from stabmon.export.exporter import address_note

    line = f"stabmon daemon: serving {app.url}{address_note(address)}"
    app.run_until_signalled(ready=lambda: print(line, flush=True))  # once signals stop it
    return 0


def _print_environment(as_json: bool) -> int:
    import json

    import torch

    from stabmon.probes.environment import build_info, environment_record, format_environment
    from stabmon.probes.identity import identify_gpus

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    driver, identities = identify_gpus([torch.device("cuda", i) for i in range(visible)])
    gpus = [{**identity.labels(), "driver_version": driver} for identity in identities]
    record = environment_record(build_info(__version__), gpus, driver, os.environ)
    print(json.dumps(record, indent=2) if as_json else format_environment(record))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "check-config":
            config = load_config(args.file, env={})
            print(f"{args.file}: ok ({len(config.to_dict())} keys)")
            return 0
        if args.command == "daemon":
            return _run_daemon(args)
        if args.command == "env":
            return _print_environment(args.json)
        if args.command == "report":
            return _report(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "status":
            return _status(args)
        if args.command == "demo":
            return _demo(args)
    except StabmonError as error:
        sys.stderr.write(f"stabmon: error: {error}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
