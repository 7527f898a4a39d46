"""What the daemon hands a script's rank, read once from its environment (contracts.protocol's ENV_* variables):
who it is, where its events, commands, directives and checkpoints go, and the run's resolved config."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping

from contracts.config import Config, load_config
from contracts.protocol import (
    ENV_COMMANDS,
    ENV_CONFIG,
    ENV_EVENT_SOCKET,
    ENV_GENERATION,
    ENV_PHASE_BOARD,
    ENV_RECOVERY,
    ENV_RERUN,
    RecoveryDirective,
    RerunDirective,
)


@dataclasses.dataclass(frozen=True)
class RankSettings:
    supervised: bool                  # started by the daemon (its config is in the environment)
    rank: int
    world: int
    generation: int
    config: Config | None
    socket: str | None                # the daemon's event socket
    commands: str | None              # the commands file
    phase_board: str | None           # contracts.phase_board prefix
    recovery: RecoveryDirective | None
    rerun: RerunDirective | None

    @property
    def run_dir(self) -> Path | None:
        return Path(self.config.run.dir) if self.config is not None else None


def _directive(env: Mapping[str, str], name: str, kind):
    path = env.get(name)
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return kind.from_json(f.read())


def from_env(env: Mapping[str, str] = os.environ) -> RankSettings:
    """This rank's settings; unsupervised (no LLM_PRETRAIN_CONFIG) when the script runs on its own."""
    config_path = env.get(ENV_CONFIG)
    cfg = load_config(config_path) if config_path else None
    world = cfg.parallel.world_size if cfg is not None else int(env.get("MS_WORKER_NUM", "1"))
    return RankSettings(supervised=cfg is not None, rank=int(env.get("MS_NODE_ID", env.get("RANK_ID", "0"))),
                        world=world, generation=int(env.get(ENV_GENERATION, "0")), config=cfg,
                        socket=env.get(ENV_EVENT_SOCKET), commands=env.get(ENV_COMMANDS),
                        phase_board=env.get(ENV_PHASE_BOARD),
                        recovery=_directive(env, ENV_RECOVERY, RecoveryDirective),
                        rerun=_directive(env, ENV_RERUN, RerunDirective))
