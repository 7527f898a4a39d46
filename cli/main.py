"""The `llm-pretrain` command line.

Owns: argument parsing, turning errors into one line and a documented exit
code (contracts.protocol.ExitCode), and dispatch. Subcommands that need MindSpore
(`train`) import it inside the subcommand, so the others start fast and work
where MindSpore is not installed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Sequence

from checkpointing import CheckpointError
from contracts.config import config_hash, load_config
from contracts.errors import CantCreateError, ConfigError, DataError
from contracts.protocol import ENV_STANDBY_FD, FAULTS, ExitCode, InjectRequest
from contracts.runs import RunNotFoundError, resolve_run_dir

_EXIT_MEANINGS = {
    ExitCode.OK: "finished, or stopped on request",
    ExitCode.SOAK_FAILED: "chaos: a fault not recovered from, the run unfinished, or not bit-exact",
    ExitCode.USAGE: "command-line usage error (also: no such run)",
    ExitCode.GAVE_UP_CRASH_LOOP: "gave up: restarts made no progress",
    ExitCode.GAVE_UP_NUMERICS: "gave up: numerical incidents beyond the policy's limits",
    ExitCode.LOCKED: "another daemon holds this run's lock",
    ExitCode.DATA_ERROR: "bad data (or too much of the corpus corrupt), a bad checkpoint, a corrupt state.json",
    ExitCode.NO_DAEMON: "a request (pause, stop, inject, …) for a run no daemon is running (--queue leaves it); "
                        "plan --dry-run without the Ascend toolkit",
    ExitCode.INTERNAL_ERROR: "internal error (systemd restarts the service)",
    ExitCode.CANT_CREATE: "an output cannot be created (permissions, a read-only or virtual filesystem)",
    ExitCode.TEMP_FAIL: "multi-node: etcd (run.coordinator) unreachable (systemd restarts the service)",
    ExitCode.CONFIG_ERROR: "bad configuration",
}


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("llm-pretrain")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config (default: the embedded tiny config, configs/tiny.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable (e.g. --set train.steps=50)")


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {int(c):>3}  {_EXIT_MEANINGS[c]}" for c in ExitCode)
    parser = argparse.ArgumentParser(prog="llm-pretrain", description="Fault-tolerant LLM pretraining on MindSpore.",
                                     epilog=f"exit codes:\n{codes}", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"llm-pretrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train in this process (also the entry point of each rank)")
    _add_config_args(train)
    train.add_argument("--until-step", type=int, metavar="N",
                       help="checkpoint and stop after step N (resume later with the same command)")
    _add_allow_config_change(train)
    _add_log_format(train, "console: the default on a terminal when no daemon supervises this process")

    run = sub.add_parser("run", help="the daemon: start this node's ranks, watch them, bring them back")
    _add_config_args(run)
    _add_allow_config_change(run)
    _add_log_format(run, "console: the default on a terminal; events.jsonl is always JSON")

    _add_operations(sub)
    _add_tools(sub)
    from chaos.command import add_parser as add_chaos

    _add_config_args(add_chaos(sub))           # the config of the run `--start` starts
    return parser


def _add_allow_config_change(parser) -> None:
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even if trajectory-defining config keys differ from the checkpoint's (e.g. a "
                             "new optim.cosine_steps to train on with a longer schedule); the keys are named")


def _add_log_format(parser, when: str) -> None:
    parser.add_argument("--log-format", choices=("auto", "console", "json"), default="auto",
                        help=f"the stream's events: one line each for people ({when}) or JSON (elsewhere: "
                             "journald, pipes)")


def _console(args: argparse.Namespace, *, default: bool, total_steps: int | None = None):
    """stdout rendered for people when asked, or by default on a terminal; None: JSON lines."""
    if args.log_format == "console" or (args.log_format == "auto" and default and sys.stdout.isatty()):
        from cli.console import ConsoleStream

        return ConsoleStream(sys.stdout, total_steps=total_steps)
    return None


def _add_operations(sub) -> None:
    """What an operator runs against a live or finished run."""
    ckpts = sub.add_parser("checkpoints", help="list, show or verify a run's checkpoints")
    ckpts.add_argument("action", choices=("list", "show", "verify"))
    ckpts.add_argument("run", metavar="RUN", help="a run directory, or a run name (./runs/NAME or "
                                                  "$STATE_DIRECTORY/NAME)")
    ckpts.add_argument("--step", type=int, help="show/verify this step (default: the newest; verify: all)")
    ckpts.add_argument("--json", action="store_true", help="machine-readable output")

    inject = sub.add_parser("inject", help="fault drill: ask a running daemon's ranks for a fault (needs "
                                           "health.allow_fault_injection = true)")
    inject.add_argument("fault", choices=FAULTS, help="nan: non-finite gradients once; spike: a window of random-token "
                        "batches (bad data: a rerun reads it again); bitflip: one exponent bit flipped once, the rank's "
                        "gradients overflow (a transient device fault); faulty-rank: the rank's device multiplies its "
                        "gradients by 32 every step from then on (a device fault); corrupt-weight: one bit of one weight, "
                        "silently (the replica fingerprints catch it); hang; crash (SIGKILL); slow: sleep before each "
                        "step; oom: exceed the memory limit")
    inject.add_argument("run", metavar="RUN", help="a run directory, or a run name")
    inject.add_argument("--rank", type=int, default=0, help="the rank that misbehaves (default 0)")
    inject.add_argument("--at-step", type=int, metavar="S", help="the first step affected (default: the next)")
    inject.add_argument("--steps", type=int, metavar="N", help="steps affected (nan 1, spike 8, slow 100)")
    inject.add_argument("--seconds", type=float, help="hang: how long (default 3600); slow: per step (0.5)")
    inject.add_argument("--reason", help="a note for the log")
    inject.add_argument("--queue", action="store_true", help=_QUEUE_HELP)

    status = sub.add_parser("status", help="a run's state, step, loss, speed, ETA, restarts, last incident")
    status.add_argument("run", metavar="RUN", help="a run directory, or a run name")
    status.add_argument("--json", action="store_true", help="machine-readable output")

    logs = sub.add_parser("logs", help="a run's daemon events, pretty-printed and filtered")
    logs.add_argument("run", metavar="RUN", help="a run directory, or a run name")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing new events (across rotations)")
    logs.add_argument("--level", choices=("debug", "info", "warning", "error", "critical"),
                      help="this level and above")
    logs.add_argument("--event", action="append", default=[], help="only these event names; repeatable")
    logs.add_argument("--rank", type=int, help="only events about this rank")
    logs.add_argument("--json", action="store_true", help="the JSON lines as they are")

    incident = sub.add_parser("incident", help="a run's incidents and their post-mortem bundles (events, rank log "
                                               "tails, config, environment); one's summary, or a .tar.gz of it")
    incident.add_argument("run", metavar="RUN", help="a run directory, or a run name")
    incident.add_argument("index", metavar="N", type=int, nargs="?", help="the incident's number (as listed): "
                          "its bundle's summary")
    incident.add_argument("--bundle", metavar="OUT", help="write incident N's bundle as a .tar.gz to OUT")

    from daemon.judging.requests import VERBS

    for name, verb in VERBS.items():
        if name == "inject":
            continue                       # its own arguments, above
        ctl = sub.add_parser(name, help=f"{verb.help} (a file in the run's control directory)")
        ctl.add_argument("run", metavar="RUN", help="a run directory, or a run name")
        ctl.add_argument("--reason", help="a note for the log")
        ctl.add_argument("--queue", action="store_true", help=_QUEUE_HELP)



def _add_prepare_data(sub) -> None:
    prep = sub.add_parser("prepare-data", help="tokenize text files into a corpus for training")
    prep.add_argument("--input", dest="inputs", action="append", required=True, metavar="PATH",
                      help="a file, directory or glob (.txt, .md, .jsonl, source files), or @stdlib; repeatable")
    prep.add_argument("--output", required=True, metavar="DIR", help="corpus directory to create")
    prep.add_argument("--tokenizer", default="byte", metavar="byte|PATH",
                      help="'byte' (default: UTF-8 bytes + <|endoftext|>) or a Hugging Face tokenizer.json")
    prep.add_argument("--eos-token", help="end-of-document token of a tokenizer.json (default: detected)")
    prep.add_argument("--workers", type=int, default=0, help="tokenizer processes (default: one per core)")
    prep.add_argument("--text-field", default="text", help="field holding the text in .jsonl records")
    prep.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    prep.add_argument("--block-bytes", type=int, default=1 << 20, metavar="N",
                      help="bytes per CRC32C-checked block (a multiple of 4096; default 1 MiB)")
    prep.add_argument("--validation-fraction", type=float, default=0.0, metavar="F",
                      help="hold out about this fraction of the documents (by a hash of each: the same text always "
                           "lands on the same side) as the corpus's validation split, never trained on (default 0)")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing corpus at --output")
    _add_log_format(prep, "console: the default when stderr is a terminal (a progress bar, then lines)")


def _add_tools(sub) -> None:
    """Data, interop, plots, services and configs."""
    _add_prepare_data(sub)

    export = sub.add_parser("export", help="write a checkpoint as Hugging Face LLaMA or mindformers weights")
    export.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint directory (…/checkpoints/step-N), or a run (its newest checkpoint)")
    export.add_argument("--format", choices=("hf", "mindformers", "mindspore-sliced"), required=True,
                        help="hf, mindformers: whole weights; mindspore-sliced: a semi-auto run's slices per rank "
                             "with its strategy files, for MindSpore's transform_checkpoints")
    export.add_argument("-o", "--output", required=True, metavar="DIR",
                        help="the directory to write (hf: with the run's tokenizer files where it is known)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing non-empty DIR")

    imp = sub.add_parser("import-config", help="map a mindformers model/training YAML onto this project's TOML")
    imp.add_argument("yaml", metavar="YAML", help="a mindformers YAML (model, runner, parallel, lr schedule …)")
    imp.add_argument("-o", "--output", required=True, metavar="TOML", help="the config file to write")

    plot = sub.add_parser("plot", help="loss and lr over steps, with incidents, rollbacks and skipped windows")
    plot.add_argument("run", metavar="RUN", help="a run directory, or a run name")
    plot.add_argument("-o", "--output", default="loss.png", help="the PNG to write (default loss.png)")

    svc = sub.add_parser("install-service", help="write the systemd units for this virtual environment and config")
    svc.add_argument("--config", metavar="FILE", help="the config of llm-pretrain.service (validated now); the "
                     "template llm-pretrain@NAME.service reads /etc/llm-pretrain/NAME.toml")
    svc.add_argument("--venv", help="the virtual environment llm-pretrain is installed in (default: this one)")
    svc.add_argument("--user", default="llm-pretrain", help="the unprivileged user the service runs as")
    svc.add_argument("--dest", default="/etc/systemd/system", help="where unit files go")
    svc.add_argument("--tmpfiles-dest", default="/etc/tmpfiles.d", help="where the tmpfiles.d entry goes")
    svc.add_argument("--etc", default="/etc/llm-pretrain", help="configs and the Ascend EnvironmentFile")

    plan = sub.add_parser("plan", help="check a dp x tp x pp layout's rules and per-device memory; propose layouts "
                                       "that fit N devices (--dry-run: MindSpore's own compile, on an Ascend host)")
    _add_config_args(plan)
    plan.add_argument("--devices", type=int, required=True, metavar="N", help="devices (NPUs) in the whole run")
    plan.add_argument("--device-memory-gib", type=float, metavar="G",
                      help="memory of one device (default: the config's parallel.device_memory_gib)")
    plan.add_argument("--devices-per-node", type=int, default=8, metavar="K",
                      help="devices per machine (tensor parallelism stays within one; default 8)")
    plan.add_argument("--dry-run", action="store_true",
                      help="also compile each pipeline stage with MindSpore's simulation (MS_SIMULATION_LEVEL) and "
                           "print the compiler's peak memory next to the estimate; needs the Ascend toolkit")

    show = sub.add_parser("config", help="validate a config and print it resolved (TOML, a file `--config` "
                                         "reads back), with its trajectory hash")
    _add_config_args(show)
    show.add_argument("--json", action="store_true", help="JSON: {config, config_hash}")

def _load_config(path, overrides):
    """A config as every command that runs one takes it: the schema's rules, then the planner's fit
    check (an Ascend layout that cannot fit its device memory is refused before any cluster time)."""
    cfg = load_config(path, overrides)
    if cfg.train.device != "ascend" or cfg.script.command:     # a script's model is not this project's to plan
        return cfg
    from engine.layout import plan

    return plan.check_fits(cfg)


def _check_inputs(cfg) -> None:
    """What a rank would refuse, found here rather than inside a rank after the cluster formed: a
    prepared corpus at data.path (its manifest and shard sizes; content is checked as it is read)
    whose vocabulary the model embeds (its validation split's too), and a model.init_from whose config.json
    matches model.* and whose safetensors files are whole (read only while the run has no checkpoint, as the
    ranks read it). A script's inputs are its own (cli/script_command.py checks what it can)."""
    if cfg.script.command:
        return
    if cfg.data.source == "prepared" and cfg.data.path:
        from engine.data.corpus import Corpus
        from engine.data.order import check_vocabulary

        corpus = Corpus(cfg.data.path, verify_checksums=False)
        check_vocabulary(corpus, cfg)
        held_out = cfg.data.validation_path or (corpus.validation_path if cfg.train.eval_interval_steps else None)
        if held_out and cfg.train.eval_interval_steps:          # the validation split the ranks will embed too
            check_vocabulary(Corpus(held_out, verify_checksums=False), cfg)
    if cfg.model.init_from:
        from pathlib import Path

        from engine.interop import hf
        from engine.rank.resume_check import newest_run_state

        if newest_run_state(cfg.run.resolved_dir() / "checkpoints") is None:
            hf.check_init_from(Path(cfg.model.init_from.removeprefix("hf:")), cfg.model)


def _cmd_config(args: argparse.Namespace) -> int:
    from contracts.config import to_toml

    cfg = _load_config(args.config, args.overrides)
    _check_inputs(cfg)
    if args.json:
        print(json.dumps({"config": cfg.to_dict(), "config_hash": config_hash(cfg)}, indent=2))
    else:
        print(to_toml(cfg, [f"resolved by `llm-pretrain config`; trajectory hash {config_hash(cfg)}"]), end="")
    return ExitCode.OK


def _cmd_plan(args: argparse.Namespace) -> int:
    from engine.layout import plan

    if args.devices < 1 or args.devices_per_node < 1:
        raise ConfigError(f"--devices = {args.devices} and --devices-per-node = {args.devices_per_node} must be >= 1")
    if args.device_memory_gib is not None and args.device_memory_gib <= 0:
        raise ConfigError(f"--device-memory-gib = {args.device_memory_gib:g} must be > 0")
    cfg, layout, problem = plan.planned(args.config, args.overrides)
    memory = args.device_memory_gib or cfg.parallel.device_memory_gib
    hw = plan.Hardware(memory_gib=memory, devices_per_node=args.devices_per_node)
    lines, verdict = plan.report(cfg, args.devices, hw, layout=layout)
    print("\n".join(lines))
    if args.dry_run:
        from engine.layout import dry_run

        try:
            dry_run.run(args.config, args.overrides, cfg, layout)
        except dry_run.DryRunUnavailableError as e:
            print(f"llm-pretrain: {e}", file=sys.stderr)
            return ExitCode.NO_DAEMON
    if verdict:
        print(f"llm-pretrain: plan: the config cannot run as written on {args.devices} devices: {verdict}",
              file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    return ExitCode.OK


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load_config(args.config, args.overrides)   # validated before MindSpore is loaded
    import os

    if os.environ.get("MS_ROLE") == "MS_SCHED":      # msrun starts the same command as the cluster's scheduler
        from engine.rank import scheduler

        scheduler.main()
        return ExitCode.OK
    from contracts.event_sink import TolerantStream

    # a full disk under the log; whole lines (the log is shared with the ranks being torn down)
    sys.stdout, sys.stderr = TolerantStream(sys.stdout), TolerantStream(sys.stderr)
    if os.environ.get(ENV_STANDBY_FD):               # a warm standby: form the cluster, wait to be a rank
        import importlib

        from engine.rank import idle_cpu

        started = time.monotonic()
        with idle_cpu.only() as idle:                 # its imports on the CPU the training leaves idle
            _prestart_ram_writer(cfg)                   # (its child inherits SCHED_IDLE, and keeps it)
            importlib.import_module("engine.rank.trainer")   # MindSpore and the engine: what a standby saves
            from engine.rank import standby
        if idle:
            print(f"standby: MindSpore and the engine imported on idle CPU only (SCHED_IDLE) in "
                  f"{time.monotonic() - started:.1f} s, then back to normal scheduling", flush=True)
        standby.hold(cfg, int(os.environ[ENV_STANDBY_FD]))
        cfg = load_config(args.config, args.overrides)
    else:
        _prestart_ram_writer(cfg)                       # beside MindSpore's import, not beside the first steps
    from engine.rank import runtime

    runtime.check_process_count(cfg)
    cfg = _resumable(cfg, allow_config_change=args.allow_config_change)
    if args.until_step is not None and args.until_step < 1:
        raise ConfigError(f"--until-step = {args.until_step} must be >= 1")
    from contracts.protocol import ENV_EVENT_SOCKET
    from engine.rank import trainer

    out = _console(args, default=not os.environ.get(ENV_EVENT_SOCKET), total_steps=args.until_step or cfg.train.steps)
    try:
        trainer.train(cfg, out=out or sys.stdout, until_step=args.until_step,
                     allow_config_change=args.allow_config_change)
    except trainer.CheckpointSaveError as e:
        print(f"llm-pretrain: {e}", file=sys.stderr)
        return ExitCode.INTERNAL_ERROR
    return ExitCode.OK


def _prestart_ram_writer(cfg) -> None:
    """The RAM tier's writer process started now (checkpointing.writer_process.prestart): started at the
    first save, its interpreter's start slowed the first steps of every generation and the next save
    waited for it."""
    if cfg.checkpoint.memory_interval_steps:
        from checkpointing import writer_process

        writer_process.prestart()


def _resumable(cfg, *, allow_config_change: bool = False):
    """The config to resume the run's newest checkpoint with (its lr schedule kept when train.steps
    grew); a config that cannot resume it is a ConfigError here, before anything is spawned. A script's
    trajectory is its own: its checkpoints are resumed as they are."""
    if cfg.script.command:
        return cfg
    from engine.rank.resume_check import check_resume

    cfg, note = check_resume(cfg, cfg.run.resolved_dir() / "checkpoints", allow_config_change=allow_config_change)
    if note:
        print(f"llm-pretrain: {note}", file=sys.stderr, flush=True)
    return cfg


def _cmd_run(args: argparse.Namespace) -> int:
    from daemon.supervisor import Supervisor

    from cli import script_command

    cfg = _resumable(_load_config(args.config, args.overrides), allow_config_change=args.allow_config_change)
    _check_inputs(cfg)
    # The ranks get the daemon's resolved config file (`--config <run.dir>/config.resolved.toml`; a script's
    # client: LLM_PRETRAIN_CONFIG), not the operator's: an edit of that file mid-run cannot split the ranks'
    # config from the daemon's. Allowed a config change, they are for this daemon's life: a rollback may go
    # back to a checkpoint trained before the change.
    cfg, worker_cmd, scheduler_cmd = script_command.commands(cfg, allow_config_change=args.allow_config_change)
    return Supervisor(cfg, worker_cmd=worker_cmd, scheduler_cmd=scheduler_cmd,
                      stream=_console(args, default=True)).run()


_QUEUE_HELP = "leave the request for the run's next daemon when none is running (default: refuse, exit 69)"


class NoDaemonError(RuntimeError):
    """A request for a run whose daemon is not running: it would wait, unseen, for a future daemon."""


def _control_dir(run: str, *, queue: bool = False):
    """The run's control directory; on a multi-node run, that of the node whose daemon runs on this
    machine (its lock held here), else that of the first node whose daemon runs anywhere, else node 0's:
    a request on any node reaches the decider and acts on all."""
    from cli.status import node_dirs
    from daemon.processes.lock import holder

    run_dir = resolve_run_dir(run)
    nodes = node_dirs(run_dir)
    here = [d for d in nodes if _local_pid(holder(d))]
    running = [d for d in nodes if holder(d) is not None]
    control_dir = (here or running or nodes or [run_dir])[0] / "control"
    if not control_dir.is_dir():
        raise RunNotFoundError(f"{control_dir} does not exist: has a daemon run here?")
    if not queue and holder(control_dir.parent) is None:
        raise NoDaemonError(f"no daemon is running for {control_dir.parent} (its daemon.lock is not held), so nothing "
                            "would act on the request now; start the daemon, or pass --queue to leave it for the next one")
    return control_dir


def _local_pid(pid: str | None) -> bool:
    """A lock's holder is a process of this machine (a shared run directory's lock may be another's)."""
    import os

    return pid is not None and pid.isdigit() and os.path.exists(f"/proc/{pid}")


def _cmd_control(args: argparse.Namespace) -> int:
    from daemon.processes import control

    control_dir = _control_dir(args.run, queue=args.queue)
    path = control.write_request(control_dir, args.command, {"reason": args.reason} if args.reason else {})
    print(f"requested: {path} (acknowledged by a `control` event in the run's log)")
    return ExitCode.OK


def _cmd_status(args: argparse.Namespace) -> int:
    from cli import status

    s = status.summary(resolve_run_dir(args.run))
    print(json.dumps(s, indent=2) if args.json else status.render(s))
    return ExitCode.OK


def _cmd_logs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cli import status
    from daemon.records.state import RunState, StateCorruptError

    run_dir = resolve_run_dir(args.run)
    try:
        log_dir = Path(RunState.load(run_dir).log_dir or run_dir / "logs")
    except StateCorruptError as e:        # the log is what one reads then: from its default place
        log_dir = run_dir / "logs"
        print(f"llm-pretrain: {e}; reading {log_dir}", file=sys.stderr)
    path = log_dir / "events.jsonl"
    if not path.exists():
        print(f"llm-pretrain: no {path} yet: has a daemon run here?", file=sys.stderr)
        return ExitCode.USAGE
    try:
        status.logs(path, follow=args.follow, level=args.level, events=args.event, rank=args.rank,
                        as_json=args.json)
    except BrokenPipeError:
        pass
    return ExitCode.OK


def _resolve_checkpoint(text: str):
    from pathlib import Path

    from checkpointing import layout, reader

    path = Path(text)
    if (path / layout.MANIFEST).exists():
        return path
    found = reader.find_latest(resolve_run_dir(text) / "checkpoints", set_aside_failed=False)
    if found is None:
        raise RunNotFoundError(f"{text}: no committed checkpoint to export")
    return found[0]


def _cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.interop import hf

    hf.check_output(Path(args.output), args.overwrite)      # before hashing the checkpoints
    checkpoint = _resolve_checkpoint(args.checkpoint)
    fallback = None if checkpoint == Path(args.checkpoint) else hf.passed_over(checkpoint)
    if fallback:
        print(f"llm-pretrain: warning: {fallback}", file=sys.stderr)
    if args.format == "hf":
        info = hf.export(checkpoint, Path(args.output), overwrite=args.overwrite)
        if info["tokenizer_note"]:
            print(f"llm-pretrain: no tokenizer files exported: {info['tokenizer_note']}", file=sys.stderr)
    elif args.format == "mindformers":
        from engine.interop import mindformers

        info = mindformers.export(checkpoint, Path(args.output), overwrite=args.overwrite)
    else:
        from engine.interop import sliced

        info = sliced.export(checkpoint, Path(args.output), overwrite=args.overwrite)
        print(f"llm-pretrain: {info['ranks']} ranks' slices; to resume on another layout, transform them onto its "
              f"strategy file: {sliced.transform_command(Path(args.output), info['strategy'])}", file=sys.stderr)
        if info["note"]:
            print(f"llm-pretrain: warning: {info['note']}", file=sys.stderr)
    tokenizer = f" with the {info['tokenizer']} tokenizer" if info.get("tokenizer") else ""
    print(f"exported {checkpoint} as {args.format}: {info['tensors']} tensors, {info['parameters']:,} parameters"
          f"{tokenizer} -> {args.output}")
    return ExitCode.OK


def _cmd_import_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    import yaml

    from engine.interop import import_config

    try:
        doc = yaml.safe_load(Path(args.yaml).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{args.yaml}: cannot read it as YAML: {e}") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{args.yaml}: not a mindformers YAML (no top-level mapping)")
    cfg, unmapped = import_config.convert(doc)
    Path(args.output).write_text(import_config.to_toml(cfg, unmapped, args.yaml))
    print(f"wrote {args.output}; {len(unmapped)} key(s) not mapped" + (":" if unmapped else ""))
    for key in unmapped:
        print(f"  {key}", file=sys.stderr)
    return ExitCode.OK


def _cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cli import plot

    try:
        info = plot.plot(resolve_run_dir(args.run), Path(args.output))
    except plot.NoStepsError as e:
        print(f"llm-pretrain: {e}", file=sys.stderr)
        return ExitCode.USAGE
    print(f"wrote {args.output}: {info['steps']} step(s) in {info['generations']} generation(s), "
          f"{info['incidents']} incident(s)")
    return ExitCode.OK


def _cmd_inject(args: argparse.Namespace) -> int:
    from daemon.processes import control

    body = {"fault": args.fault, "rank": args.rank, "at_step": args.at_step, "steps": args.steps,
            "seconds": args.seconds}
    try:
        request = InjectRequest.from_dict({k: v for k, v in body.items() if v is not None})
    except ValueError as e:
        raise ConfigError(f"inject: {e}") from None
    body = {**request.to_dict(), **({"reason": args.reason} if args.reason else {})}
    control_dir = _control_dir(args.run, queue=True)
    resolved = resolve_run_dir(args.run) / "config.resolved.toml"    # what the running daemon runs with
    running = load_config(resolved) if resolved.exists() else None
    if running is not None and not running.health.allow_fault_injection:
        raise ConfigError(f"fault drills are off for this run ({resolved}): set health.allow_fault_injection = "
                          "true and restart the daemon")
    if running is not None:
        try:
            InjectRequest.from_dict(request.to_dict(), world=running.parallel.world_size, dp=running.parallel.dp)
        except ValueError as e:
            raise ConfigError(f"inject: {e}") from None
    _control_dir(args.run, queue=args.queue)                          # a daemon to act on it, or --queue
    path = control.write_request(control_dir, "inject", body)
    print(f"requested: {path} (the daemon's log acknowledges it with a `control` event)")
    return ExitCode.OK


def _cmd_install_service(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from cli import service

    if args.config:
        _load_config(args.config, [])            # the planner's fit check too, not only the schema's
    absolute = lambda p: Path(os.path.abspath(p))     # the units name them: relative paths mean nothing there
    written = service.install(venv=str(absolute(args.venv or service.default_venv())), config=args.config,
                              user=args.user, dest=absolute(args.dest), tmpfiles_dest=absolute(args.tmpfiles_dest),
                              etc_dir=absolute(args.etc))
    for path in written:
        print(f"wrote {path}")
    print(f"not done by install-service; to start the service, as root: {service.next_steps(args.user, written)}")
    return ExitCode.OK


def _cmd_checkpoints(args: argparse.Namespace) -> int:
    from cli import checkpoints

    return checkpoints.run(args.action, args.run, step=args.step, as_json=args.json)


def _cmd_incident(args: argparse.Namespace) -> int:
    from cli import incidents

    return incidents.run(args.run, args.index, bundle_out=args.bundle)


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    from engine.data.prepare import prepare

    prepare(args.inputs, args.output, tokenizer=args.tokenizer, eos_token=args.eos_token, workers=args.workers,
            text_field=args.text_field, shard_tokens=args.shard_tokens, overwrite=args.overwrite,
            block_bytes=args.block_bytes, human={"json": False, "console": True}.get(args.log_format),
            validation_fraction=args.validation_fraction)
    return ExitCode.OK


def _cmd_chaos(args: argparse.Namespace) -> int:
    from chaos.command import main as chaos_main

    return chaos_main(args)


COMMANDS = {"train": _cmd_train, "config": _cmd_config, "prepare-data": _cmd_prepare_data,
            "checkpoints": _cmd_checkpoints, "run": _cmd_run, "inject": _cmd_inject,
            "install-service": _cmd_install_service, "status": _cmd_status, "logs": _cmd_logs, "incident": _cmd_incident, "plot": _cmd_plot, "export": _cmd_export,
            "import-config": _cmd_import_config, "plan": _cmd_plan,
            "pause": _cmd_control, "resume": _cmd_control, "checkpoint": _cmd_control, "stop": _cmd_control,
            "chaos": _cmd_chaos}


# Commands that only print: a closed pipe (`status --json | head`) ends them as it ends any Unix tool,
# quietly by SIGPIPE. The long-running ones keep Python's default: their output is never worth dying for.
_PRINTING = {"status", "logs", "incident", "config", "plan", "checkpoints", "plot", "export", "import-config", "install-service",
             "pause", "resume", "checkpoint", "stop", "inject"}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in _PRINTING and argv is None:
        import signal

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return int(COMMANDS[args.command](args))
    except BrokenPipeError:          # the reader went away (in-process calls keep Python's SIGPIPE)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return ExitCode.OK
    except RunNotFoundError as e:
        print(f"llm-pretrain: {e}", file=sys.stderr)
        return ExitCode.USAGE
    except NoDaemonError as e:
        print(f"llm-pretrain: {e}", file=sys.stderr)
        return ExitCode.NO_DAEMON
    except ConfigError as e:
        print(f"llm-pretrain: config error: {e}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    except CheckpointError as e:
        print(f"llm-pretrain: checkpoint error: {e}", file=sys.stderr)
        return ExitCode.DATA_ERROR
    except CantCreateError as e:
        print(f"llm-pretrain: {e}", file=sys.stderr)
        return ExitCode.CANT_CREATE
    except DataError as e:
        print(f"llm-pretrain: data error: {e}", file=sys.stderr)
        return ExitCode.DATA_ERROR
    except KeyboardInterrupt:
        print("llm-pretrain: interrupted", file=sys.stderr)
        return 130
    except Exception:  # the process boundary: anything unforeseen is an internal error, which systemd restarts
        traceback.print_exc()
        print("llm-pretrain: internal error (exit 70); the traceback is above", file=sys.stderr)
        return ExitCode.INTERNAL_ERROR

