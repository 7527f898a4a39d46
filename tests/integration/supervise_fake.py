"""Runs the real Supervisor with the fake worker in place of `llm-pretrain train`.

    python -m tests.integration.supervise_fake [--config FILE] --set k=v ... -- FAKE_WORKER_ARGS...

With FAKE_DAEMON_DIE_AT=<point> in its environment the daemon SIGKILLs itself at that point of
its recovery from the first incident (a real kill -9 at a chosen moment); with FAKE_WORKER_NICE=<n> its
fake ranks run at that niceness (many simulated machines on one: the ranks must not starve the daemons):
    recorded       the decision is in state.json, nothing carried out
    mid_rollback   one later checkpoint renamed aside, the others not yet
    rolled_back    the renames done, the restart not yet counted
    backoff        waiting before the next generation
"""
import os
import signal
import sys

from contracts.config import load_config
from daemon.supervisor import Supervisor


def _die(*_, **__):
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    from checkpointing import layout
    from daemon.acting import decisions
    from daemon.records.ledger import Ledger
    from daemon.supervisor import Supervisor

    if point == "recorded":
        record = Ledger.record
        Ledger.record = lambda self, rec, event, level, **kw: (record(self, rec, event, level, **kw),
                                                               event == "incident" and _die())
    elif point == "mid_rollback":
        def roll_back_one(root, target):
            later = [s for s in layout.committed_steps(root) if s > target]
            if later:
                os.rename(layout.step_dir(root, later[0]), root / f"{layout.step_name(later[0])}.rolledback")
            _die()
        layout.roll_back = roll_back_one
    elif point == "rolled_back":
        decisions.count_restart = _die
    elif point == "backoff":
        Supervisor._sleep = _die
    elif point == "detected":                      # the incident known, nothing of it recorded yet
        decisions.decide_and_record = _die
    elif point == "opened":                        # the next generation's ranks spawned, no step yet
        from daemon.judging import watch

        init = watch.Watch.__init__
        watch.Watch.__init__ = lambda self, cfg, **kw: _die() if kw["generation"] > 1 else init(self, cfg, **kw)


def main() -> int:
    if os.environ.get("FAKE_DAEMON_DIE_AT"):
        _arm(os.environ["FAKE_DAEMON_DIE_AT"])
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    overrides = [argv[i + 1] for i in range(0, split, 2) if argv[i] == "--set"]
    config = next((argv[i + 1] for i in range(0, split, 2) if argv[i] == "--config"), None)
    cfg = load_config(config, overrides)
    nice = ["nice", "-n", os.environ["FAKE_WORKER_NICE"]] if os.environ.get("FAKE_WORKER_NICE") else []
    worker = [*nice, sys.executable, "-m", "tests.integration.fake_worker",
              "--run-dir", str(cfg.run.resolved_dir().resolve()), *argv[split + 1:]]
    return Supervisor(cfg, worker_cmd=worker, scheduler_cmd=None).run()


if __name__ == "__main__":
    sys.exit(main())
