"""`llm-pretrain chaos`: its arguments, the checks before any fault, and the printed summary."""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from chaos import faults
from chaos.soak import Daemon, Plan, Soak, reference_digest, verdict, write_report
from contracts.config import Config, load_config, with_changes
from contracts.errors import ConfigError
from contracts.protocol import ExitCode
from contracts.runs import RunNotFoundError, resolve_run_dir
from daemon.processes.lock import holder

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(text: str) -> float:
    """'90', '90s', '10m', '1.5h' as seconds (argparse type)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: a positive number with s, m or h")
    return float(match.group(1)) * _UNITS[match.group(2)]


def fault_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in faults.ALL]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(faults.ALL)}")
    return list(dict.fromkeys(names))


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("chaos", help="soak a run with random real faults and report detection, recovery and loss")
    p.add_argument("run", metavar="RUN", nargs="?", help="a live run's directory or name (not with --start)")
    p.add_argument("--start", action="store_true",
                   help="start the daemon from --config/--set, and restart it after each daemon kill")
    p.add_argument("--duration", type=seconds, default=600.0, help="how long to inject faults (default 10m)")
    p.add_argument("--mean-interval", type=seconds, default=30.0,
                   help="mean wait after a recovery before the next fault (exponential; default 30s)")
    p.add_argument("--faults", type=fault_list, default=list(faults.CRASH_ONLY),
                   help=f"comma-separated, from {','.join(faults.ALL)} (default: {','.join(faults.CRASH_ONLY)})")
    p.add_argument("--max-faults", type=int, metavar="N", help="stop injecting after N faults")
    p.add_argument("--seed", type=int, default=0, help="the fault order and timing (default 0)")
    p.add_argument("--reference", action="store_true",
                   help="train the same config without faults beside the run and compare the final parameters")
    p.add_argument("--report", metavar="FILE", help="the JSON report (default RUN_DIR/chaos-report.json)")
    p.add_argument("--recover-timeout", type=seconds, default=600.0, help="per fault (default 10m)")
    p.add_argument("--disk-full-max-bytes", type=int, default=2 << 30, metavar="N",
                   help="disk-full only where the run's filesystem has at most this much free (default 2 GiB)")
    return p


def _target(args) -> tuple[Config, Daemon]:
    if args.start:
        if args.run:
            raise ConfigError("chaos: give RUN or --start (the run then comes from --config/--set), not both")
        cfg = load_config(args.config, args.overrides)
        config_args = [*(["--config", args.config] if args.config else []),
                       *sum((["--set", s] for s in args.overrides), [])]
        return cfg, Daemon(config_args, cfg.run.resolved_log_dir().absolute())
    if not args.run:
        raise RunNotFoundError("chaos: name a live run (RUN), or pass --start to start one")
    run_dir = resolve_run_dir(args.run).absolute()
    resolved = run_dir / "config.resolved.toml"
    if not resolved.exists():
        raise RunNotFoundError(f"{run_dir} has no config.resolved.toml: no daemon has run here")
    cfg = with_changes(load_config(resolved), {"run.dir": str(run_dir)})
    return cfg, Daemon(None, cfg.run.resolved_log_dir())


def _check(cfg: Config, args, daemon: Daemon) -> None:
    if not cfg.health.allow_fault_injection:
        raise ConfigError("chaos: fault injection is off for this run: set health.allow_fault_injection = true")
    run_dir = cfg.run.resolved_dir()
    if not daemon.owned:
        if holder(run_dir) is None:
            raise RunNotFoundError(f"chaos: no live daemon holds {run_dir / 'daemon.lock'}; start one, or use --start")
    if "disk-full" in args.faults:
        existing = next(p for p in [run_dir.absolute(), *run_dir.absolute().parents] if p.exists())
        free = shutil.disk_usage(existing).free
        if free > args.disk_full_max_bytes:
            raise ConfigError(f"chaos: disk-full would fill {free:,} free bytes of the filesystem holding {run_dir} "
                              f"(more than --disk-full-max-bytes = {args.disk_full_max_bytes:,}): put the run on a "
                              "small filesystem, raise the limit, or leave disk-full out of --faults")


def main(args) -> int:
    cfg, daemon = _target(args)
    _check(cfg, args, daemon)
    plan = Plan(faults=args.faults, duration_s=args.duration, mean_interval_s=args.mean_interval,
                max_faults=args.max_faults, seed=args.seed, recover_timeout_s=args.recover_timeout)
    soak = Soak(cfg, plan, daemon)
    report = soak.run()
    reference = None
    if args.reference and report["finished"]:
        soak.say("training the reference run (same config, no faults)")
        reference = reference_digest(cfg, soak.run_dir.parent / f"{soak.run_dir.name}-chaos-reference",
                                     timeout_s=plan.finish_timeout_s)
    report = verdict(report, reference)
    path = Path(args.report) if args.report else soak.run_dir / "chaos-report.json"
    write_report(report, path)
    _summary(report, path)
    return ExitCode.OK if report["ok"] else ExitCode.SOAK_FAILED


def _summary(report: dict, path: Path) -> None:
    print(f"{'fault':<12} {'step':>6} {'detect s':>9} {'recover s':>10} {'lost':>5}  detail")
    for f in report["faults"]:
        print(f"{f['fault']:<12} {f['step']:>6} {f['detection_s'] if f['detection_s'] is not None else '-':>9} "
              f"{f['recovery_s'] if f['recovery_s'] is not None else '-':>10} "
              f"{f['lost_steps'] if f['lost_steps'] is not None else '-':>5}  {f['error'] or f['detail']}")
    exact = {True: "yes", False: "NO", None: f"not compared ({report['bit_exact_note']})"}[report["bit_exact"]]
    print(f"faults {len(report['faults'])}, steps lost {report['lost_steps']}, goodput {report['goodput']:.1%}, "
          f"finished {report['finished']} at step {report['final_step']}, bit-exact {exact}")
    print(f"report: {path}")
    print("chaos: " + ("every fault recovered" if report["ok"] else "FAILED: see the report"),
          file=sys.stdout if report["ok"] else sys.stderr)
