"""`llm-pretrain plot RUN -o loss.png`: the picture an operator looks at first.

Loss (top) and learning rate (bottom) over steps, one colour per generation
(a rolled-back generation's tail stays visible where the next one replays
those steps), with every incident shaded over its steps, each rollback drawn
from where it was decided to the checkpoint it went back to, and skipped
sample windows named. Data: rank 0's step events in its log and the incident
log of state.json. matplotlib (Agg) is imported only here.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from daemon.incidents import Restart, Rollback
from daemon.state import RunState

COLORS = {"loss_spike": "tab:red", "loss_collapse": "tab:cyan", "non_finite": "tab:purple",
          "overflow_storm": "tab:orange", "grad_norm_spike": "tab:pink", "crash": "tab:gray", "hang": "tab:brown",
          "oom": "tab:olive"}


class NoStepsError(FileNotFoundError):
    """The run has no step events to draw."""


def step_series(log_path: Path) -> dict[int, list[dict]]:
    """Step events by generation, from a rank's log."""
    series: dict[int, list[dict]] = defaultdict(list)
    with open(log_path) as f:
        for line in f:
            if not line.startswith("{") or '"kind": "step"' not in line:
                continue
            try:
                e = json.loads(line)
            except ValueError:
                continue
            series[e["generation"]].append(e)
    return dict(series)


def plot(run_dir: Path, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    state = RunState.load(run_dir)
    log_dir = Path(state.log_dir) if state.log_dir else run_dir / "logs"
    log = log_dir / "rank-0.log"
    series = step_series(log) if log.exists() else {}
    if not series:
        raise NoStepsError(f"no step events in {log_dir / 'rank-0.log'}: has this run trained yet?")
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=(3, 1))
    for gen, events in sorted(series.items()):
        steps = [e["step"] for e in events]
        losses = [e["loss"] if not isinstance(e["loss"], str) else float("nan") for e in events]
        ax_loss.plot(steps, losses, lw=0.8, label=f"generation {gen}")
        ax_lr.plot(steps, [e["lr"] for e in events], lw=0.9)
    marked = 0
    for record in state.incidents:
        inc, action = record.incident, record.action
        first, last = inc.first_step, inc.last_step
        color = COLORS.get(inc.kind.value, "tab:blue")
        ax_loss.axvspan(first - 0.5, max(last, first) + 0.5, color=color, alpha=0.25 if action else 0.1, lw=0)
        label = inc.kind.value + ("" if action else " (warning)")
        if isinstance(action, Rollback):
            target = action.checkpoint_step
            ax_loss.annotate("", xy=(target, 0.92), xytext=(last, 0.92), xycoords=("data", "axes fraction"),
                             arrowprops={"arrowstyle": "->", "color": color})
            label += f" -> rollback to {target}"
            if action.skip:
                label += f", skip samples {action.skip[0]}-{action.skip[1]}"
            if action.lr_overrides:
                label += f", lr x{action.lr_overrides[0].factor:g}"
            if action.loss_scale:
                label += f", scale {action.loss_scale:g}"
        elif isinstance(action, Restart) and action.config_changes:
            label += " -> " + ", ".join(f"{k}={v}" for k, v in action.config_changes.items())
        ax_loss.text(first, 0.98 - 0.06 * (marked % 5), label, transform=ax_loss.get_xaxis_transform(),
                     fontsize=7, color=color, va="top")
        marked += 1
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{run_dir.name}: {state.status}, generation {state.generation}, "
                      f"{len(state.incidents)} incident(s)")
    ax_loss.legend(loc="upper right", fontsize=7)
    ax_loss.grid(alpha=0.3)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"generations": len(series), "steps": sum(len(v) for v in series.values()),
            "incidents": len(state.incidents)}
