"""Runs the real Supervisor with the fake worker in place of `llm-pretrain train`.

    python -m tests.integration.supervise_fake [--config FILE] --set k=v ... -- FAKE_WORKER_ARGS...
"""
import sys

from daemon.supervisor import Supervisor
from engine.config import load_config


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    overrides = [argv[i + 1] for i in range(0, split, 2) if argv[i] == "--set"]
    config = next((argv[i + 1] for i in range(0, split, 2) if argv[i] == "--config"), None)
    cfg = load_config(config, overrides)
    worker = [sys.executable, "-m", "tests.integration.fake_worker",
              "--run-dir", str(cfg.run.resolved_dir().resolve()), *argv[split + 1:]]
    return Supervisor(cfg, worker_cmd=worker, scheduler_cmd=None).run()


if __name__ == "__main__":
    sys.exit(main())
