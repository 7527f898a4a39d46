"""From a policy decision to what the next generation runs with: pure helpers of the supervisor.

Owns: the JSON form of an action (state.json, events), merging a rollback
into the recovery directive in force, and applying restart config changes to
the config and to the ranks' command lines. No files, no processes.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from daemon.policy import Action, Halt, Restart, Rollback
from daemon.protocol import Recovery
from engine.config import Config, config_from_dict


def describe(action: Action | None) -> dict[str, Any] | None:
    if action is None:
        return None
    kind = {Restart: "restart", Rollback: "rollback", Halt: "halt"}[type(action)]
    out = {"type": kind, **dataclasses.asdict(action)}
    if isinstance(action, Rollback):
        out["lr_overrides"] = [o.to_dict() for o in action.lr_overrides]
        out["skip"] = list(action.skip) if action.skip else None
    return out


def merge_recovery(previous: Recovery | None, rollback: Rollback) -> Recovery:
    """The directive after `rollback`: skip ranges accumulate; the lr override list is the policy's
    (it compounds earlier cuts) or, when it decided none (an fp16 storm), the one in force; a new
    loss scale cap replaces the old, else the old one carries on."""
    skips = list(previous.skip_ranges) if previous else []
    if rollback.skip:
        skips.append(tuple(rollback.skip))
    lr = tuple(rollback.lr_overrides) or (previous.lr_overrides if previous else ())
    if rollback.loss_scale is not None:
        cap, until = rollback.loss_scale, rollback.loss_scale_cap_until_step or 0
    elif previous is not None:
        cap, until = previous.loss_scale_cap, previous.loss_scale_cap_until_step
    else:
        cap, until = None, 0
    return Recovery(checkpoint_step=rollback.checkpoint_step, skip_ranges=tuple(skips), lr_overrides=lr,
                    loss_scale=rollback.loss_scale, loss_scale_cap=cap, loss_scale_cap_until_step=until)


def with_changes(cfg: Config, changes: Mapping[str, Any]) -> Config:
    """cfg with "section.key" -> value changes applied (validated like any config)."""
    if not changes:
        return cfg
    data = cfg.to_dict()
    for path, value in changes.items():
        section, key = path.split(".", 1)
        data[section][key] = value
    return config_from_dict(data)


def set_args(changes: Mapping[str, Any]) -> list[str]:
    """`--set section.key=value` arguments for the ranks' command line (TOML values)."""
    args = []
    for path, value in sorted(changes.items()):
        text = ("true" if value else "false") if isinstance(value, bool) else \
            json.dumps(value) if isinstance(value, str) else repr(value)
        args += ["--set", f"{path}={text}"]
    return args
