"""`llm-pretrain plot RUN -o loss.png`: the picture an operator looks at first.

Loss, learning rate and tokens/s over steps, one colour per generation. The
lineage that leads to the final state is solid; a generation's tail that a
later generation trained again (after a rollback or a restart) is dashed and
faded. Every incident is shaded over its steps and numbered in a strip above
the loss, where its rollback is drawn back to the checkpoint it went to and
committed checkpoints sit as small triangles; the steps whose samples a
rollback skips are hatched. The numbered list, the legend and the title stay
outside the data area, so no text ever covers a curve; the validation loss is a
dotted line of points on the loss panel; under tokens/s, the run's goodput so far
(the daemon's ledger, daemon.judging.goodput) at the steps its `goodput` events were
said. Data: rank 0's log (step, checkpoint, phase and eval events), the incident log
of state.json and the `goodput` events of events.jsonl.

The pure parts (sample window -> steps, superseded steps, incident labels,
marker placement, list folding) are small functions the unit tests call
without matplotlib. matplotlib (Agg) is imported only inside `plot` and its
drawing helpers; no engine module, no MindSpore.
"""
from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Mapping, Sequence

from contracts.protocol import ExitCode
from daemon.judging.incidents import Halt, IncidentRecord, Restart, Rollback
from daemon.records.state import RunState

COLORS = {"loss_spike": "tab:red", "loss_collapse": "tab:cyan", "non_finite": "tab:purple",
          "overflow_storm": "tab:orange", "grad_norm_spike": "tab:pink", "crash": "tab:gray", "hang": "tab:brown",
          "oom": "tab:olive"}
MAX_LISTED = 15          # incidents listed beside the plot; the rest are folded into "… and N more"
LABEL_WIDTH_CHARS = 60   # a listed incident wraps at this width ...
LABEL_MAX_LINES = 3      # ... to this many lines at most
MAX_MARKER_ROWS = 3      # rows of numbered markers in the strip; beyond, numbers share a marker ("4,5")


class NoStepsError(FileNotFoundError):
    """The run has no step events to draw."""


@dataclasses.dataclass
class RankLog:
    """What the plot reads from a rank's log."""

    steps: dict[int, list[dict]]                 # generation -> its step events, in log order
    checkpoints: list[tuple[int, int]]           # (generation, step) of each committed checkpoint
    resumed_at: dict[int, int]                   # generation -> the step it resumed from (its compile phase)
    validations: list[tuple[int, float]] = dataclasses.field(default_factory=list)   # (step, loss) of eval events


_DRAWN = ('"kind": "step"', '"kind": "checkpoint"', '"kind": "phase"', '"kind": "eval"')   # as to_json writes them


def read_rank_log(log_path: Path) -> RankLog:
    steps: dict[int, list[dict]] = defaultdict(list)
    checkpoints: list[tuple[int, int]] = []
    resumed_at: dict[int, int] = {}
    validations: list[tuple[int, float]] = []
    with open(log_path) as f:
        for line in f:
            # the rank log mixes JSON events with free text; parse only the lines we draw
            if not line.startswith("{") or not any(k in line for k in _DRAWN):
                continue
            try:
                e = json.loads(line)
            except ValueError:
                continue
            kind = e.get("kind")
            if kind == "step":
                steps[e["generation"]].append(e)
            elif kind == "checkpoint" and e.get("stage") == "committed":
                checkpoints.append((e["generation"], e["step"]))
            elif kind == "phase" and e.get("phase") == "compile":
                resumed_at[e["generation"]] = e.get("step", 0)
            elif kind == "eval":
                validations.append((e["step"], _number(e.get("loss"))))
    return RankLog(dict(steps), checkpoints, resumed_at, validations)


# Pure helpers ---------------------------------------------------------------------------------

def steps_for_samples(ranges: Sequence[tuple[int, int, int]], window: tuple[int, int]) -> tuple[int, int] | None:
    """The first and last step that consumed any sample of `window` = [a, b), from one generation's
    logged (step, sample_start, sample_end), in step order; None when it consumed none of them.

    A log written every N steps has gaps: a sample past a logged step's range is placed by that
    step's samples per step, if that lands before the next logged step (else no step read it: an
    earlier skip stepped over it). Past the generation's last logged step, the same within N - 1
    steps (N: the widest gap between its logged steps): a rank that died between two log lines."""
    a, b = window
    if b <= a:
        return None
    interval = max((b_[0] - a_[0] for a_, b_ in zip(ranges, ranges[1:])), default=1)   # N: steps between lines

    def step_of(sample: int) -> int | None:
        before = [i for i, (_, start, _) in enumerate(ranges) if start <= sample]
        if not before:
            return None
        i = before[-1]
        step, start, end = ranges[i]
        if sample < end:
            return step
        guess = step + (sample - start) // max(end - start, 1)
        bound = ranges[i + 1][0] if i + 1 < len(ranges) else step + interval     # the next logged step
        return guess if guess < bound else None

    inside = [step for step, start, end in ranges if start < b and end > a]
    first, last = step_of(a), step_of(b - 1)
    first = first if first is not None else min(inside, default=None)
    last = last if last is not None else max(inside, default=None)
    if first is None or last is None or last < first:
        return None
    return first, last


def superseded_steps(steps_by_gen: Mapping[int, Sequence[int]],
                     resumed_at: Mapping[int, int] | None = None) -> dict[int, tuple[int, int]]:
    """generation -> the first and last of its steps that a later generation trained again.

    A later generation starts training at the step after the one it resumed from (its compile phase
    says which; failing that, its first logged step). Every step of an earlier generation from there
    on was replaced: it is not part of the lineage that leads to the final state."""
    resumed_at = resumed_at or {}
    starts = {g: resumed_at[g] + 1 if g in resumed_at else min(steps)
              for g, steps in steps_by_gen.items() if steps or g in resumed_at}
    starts.update({g: s + 1 for g, s in resumed_at.items() if g not in starts})
    out: dict[int, tuple[int, int]] = {}
    for gen, steps in steps_by_gen.items():
        later = [start for g, start in starts.items() if g > gen]
        if not later:
            continue
        tail = [s for s in steps if s >= min(later)]
        if tail:
            out[gen] = (min(tail), max(tail))
    return out


def goodput_points(events: Sequence[Mapping]) -> list[tuple[int, float]]:
    """(step, goodput ratio) of each `goodput` event that has both, in the log's order; a step said again (the
    daemon's start, a generation's end) keeps its last value."""
    points: dict[int, float] = {}
    for e in events:
        step, ratio = e.get("step"), e.get("ratio")
        if e.get("event") == "goodput" and isinstance(step, int) and isinstance(ratio, (int, float)) and step > 0:
            points.pop(step, None)
            points[step] = float(ratio)
    return list(points.items())


def step_span(first: int, last: int) -> str:
    return f"step {first}" if last <= first else f"steps {first}\u2013{last}"


def incident_label(record: IncidentRecord, skipped_steps: tuple[int, int] | None = None) -> str:
    """One line for an incident and what was done about it, e.g.
    "loss_spike -> rollback to 25, skip steps 30–32 (samples 232–256), lr x0.5"."""
    inc, action = record.incident, record.action
    label = inc.kind.value
    if "drill" in inc.evidence:            # injected on purpose: not a problem of the run
        label += " (drill)"
    if action is None:
        return label + " (warning)"
    if isinstance(action, Rollback):
        label += f" -> rollback to {action.checkpoint_step}"
        if action.skip:
            samples = f"samples {action.skip[0]}\u2013{action.skip[1]}"
            label += f", skip {step_span(*skipped_steps)} ({samples})" if skipped_steps else f", skip {samples}"
        if action.quarantine:
            label += f", quarantine {len(action.quarantine)} block(s)"
        if action.lr_overrides:
            label += f", lr x{action.lr_overrides[0].factor:g}"
        if action.loss_scale:
            label += f", scale {action.loss_scale:g}"
    elif isinstance(action, Restart):
        label += " -> restart"
        if action.config_changes:
            label += ", " + ", ".join(f"{k}={v}" for k, v in action.config_changes.items())
    elif isinstance(action, Halt):
        try:
            label += f" -> halt ({ExitCode(action.code).name.lower()})"
        except ValueError:
            label += f" -> halt (exit {action.code})"
    return label


def listing(entries: Sequence[str], *, max_entries: int = MAX_LISTED, width: int = LABEL_WIDTH_CHARS,
            max_lines: int = LABEL_MAX_LINES) -> list[str]:
    """The numbered list beside the plot: each entry wrapped to `max_lines` lines at most (cut with
    "…"), and past `max_entries`, the first max_entries - 1 and one last line "… and N more"."""
    shown = entries if len(entries) <= max_entries else entries[:max(max_entries - 1, 0)]
    out = []
    for n, text in enumerate(shown, 1):
        prefix = f"{n}. "
        lines = textwrap.wrap(text, width, initial_indent=prefix, subsequent_indent=" " * len(prefix))
        if len(lines) > max_lines:
            lines = [*lines[:max_lines - 1], lines[max_lines - 1][:width - 1].rstrip() + "\u2026"]
        out.append("\n".join(lines))
    if len(shown) < len(entries):
        out.append(f"\u2026 and {len(entries) - len(shown)} more")
    return out


@dataclasses.dataclass
class Marker:
    """One numbered box in the strip above the loss."""

    x: float                 # centre, in steps
    row: int                 # 0: the lowest row of the strip
    numbers: list[int]       # 1-based incident numbers it stands for

    @property
    def text(self) -> str:
        """Its label: 4; 4,5; 4\u20137 (a run of three or more numbers is shortened)."""
        parts, run = [], [self.numbers[0]]
        for n in self.numbers[1:]:
            if n == run[-1] + 1:
                run.append(n)
            else:
                parts.append(run)
                run = [n]
        parts.append(run)
        return ",".join(f"{r[0]}\u2013{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in parts)


def place_markers(xs: Sequence[float], *, char_width: float, max_rows: int = MAX_MARKER_ROWS) -> list[Marker]:
    """Numbered markers, one per x (numbered 1, 2, … in the order given), placed so none overlaps
    another: each goes to the lowest row with room at its x; where every row is taken there, its
    number joins the nearest marker ("4,5"). `char_width` is one character's width in x units."""
    def half_width(text: str) -> float:
        return char_width * (len(text) + 1.5) / 2     # the text and its round box

    markers: list[Marker] = []
    last_in_row: dict[int, Marker] = {}
    for n, x in sorted(enumerate(xs, 1), key=lambda p: (p[1], p[0])):
        free = [r for r in range(max_rows) if r not in last_in_row or
                last_in_row[r].x + half_width(last_in_row[r].text) <= x - half_width(str(n))]
        if free:
            marker = Marker(x, free[0], [n])
            markers.append(marker)
            last_in_row[free[0]] = marker
        else:
            nearest = min(last_in_row.values(), key=lambda m: (abs(m.x - x), m.row))
            nearest.numbers = sorted([*nearest.numbers, n])
    return sorted(markers, key=lambda m: m.numbers[0])


# The figure -----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Run:
    """Everything drawn, read and worked out before matplotlib is touched."""

    name: str
    state: RunState
    incidents: list[IncidentRecord]              # those acted on: warnings are not drawn as incidents
    log: RankLog
    superseded: dict[int, tuple[int, int]]       # generation -> its steps trained again later
    skipped: list[tuple[int, int] | None]        # per incident: the steps its rollback's skip covers
    labels: list[str]                            # per incident
    xlim: tuple[float, float]
    goodput: list[tuple[int, float]] = dataclasses.field(default_factory=list)   # (step, ratio) as the daemon said it


def _read_run(run_dir: Path) -> _Run:
    state = RunState.load(run_dir)
    log_dir = Path(state.log_dir) if state.log_dir else run_dir / "logs"
    log_path = log_dir / "rank-0.log"
    log = read_rank_log(log_path) if log_path.exists() else RankLog({}, [], {})
    if not log.steps:
        raise NoStepsError(f"no step events in {log_path}: has this run trained yet?")
    superseded = superseded_steps({g: [e["step"] for e in ev] for g, ev in log.steps.items()}, log.resumed_at)
    skipped: list[tuple[int, int] | None] = []
    incidents = state.acted_on()
    for record in incidents:
        action, found = record.action, None
        if isinstance(action, Rollback) and action.skip:
            # the samples were read by the generation the incident happened in
            events = log.steps.get(record.generation, [])
            found = steps_for_samples([(e["step"], e["sample_start"], e["sample_end"]) for e in events
                                       if "sample_start" in e], tuple(action.skip))
        skipped.append(found)
    labels = [incident_label(r, s) for r, s in zip(incidents, skipped)]
    xs = [e["step"] for ev in log.steps.values() for e in ev] + [r.incident.first_step for r in incidents] + \
        [r.action.checkpoint_step for r in incidents if isinstance(r.action, Rollback)]
    pad = max(1.0, 0.01 * (max(xs) - min(xs)))
    from daemon.records.state_rebuild import read_events

    goodput = goodput_points(read_events(log_dir / "events.jsonl"))
    return _Run(run_dir.name, state, incidents, log, superseded, skipped, labels, (min(xs) - 0.5 - pad, max(xs) + 0.5 + pad),
                goodput)


def plot(run_dir: Path, out: Path) -> dict:
    """Writes the PNG and returns a summary: generations, steps, incidents, checkpoints (committed
    ones seen), superseded_steps ({generation: [first, last]}), skipped_steps ([[first, last], …],
    one per rollback whose skipped samples were found in the log) and labels (one per incident)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = _read_run(run_dir)
    incidents = run.incidents
    # Left: the strip (markers, checkpoints) over loss, lr and tokens/s; right: legend and list.
    size_in, left, right, gap = (14, 9), 0.065, 0.685, 0.015
    char_width = (run.xlim[1] - run.xlim[0]) * 7 * 0.62 / ((right - left) * size_in[0] * 72)  # a 7 pt digit
    markers = place_markers([(r.incident.first_step + max(r.incident.last_step, r.incident.first_step)) / 2
                             for r in incidents], char_width=char_width)
    strip_rows = 1 + max((m.row + 1 for m in markers), default=0)     # the checkpoints' row, then markers'
    fig = plt.figure(figsize=size_in)
    rows = 4 + bool(run.goodput)       # the goodput panel when the daemon said any
    grid = fig.add_gridspec(rows, 1, left=left, right=right, top=0.93, bottom=0.07, hspace=0.08,
                            height_ratios=(0.3 * strip_rows, 3, 1, 1, 1)[:rows])
    ax_strip = fig.add_subplot(grid[0])
    panels = [fig.add_subplot(grid[i], sharex=ax_strip) for i in range(1, rows)]   # loss, lr, tokens/s[, goodput]
    ax_side = fig.add_axes((right + gap, 0.07, 1 - right - gap - 0.01, 0.86))
    ax_side.set_axis_off()
    ax_strip.set_xlim(*run.xlim)
    ax_strip.set_ylim(0, strip_rows)

    handles = _draw_curves(plt, panels, run)
    handles += _draw_incident_spans(panels, run)
    handles += _draw_strip(ax_strip, markers, run)
    legend = ax_side.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 1), fontsize=8, frameon=False,
                            ncol=1 if len(handles) <= 14 else 2, borderaxespad=0)
    if incidents:
        _draw_listing(fig, ax_side, legend, incidents, run.labels)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    drawn = sum(1 for ev in run.log.steps.values() if any(math.isfinite(_number(e.get("loss"))) for e in ev))
    return {"generations": len(run.log.steps), "generations_drawn": drawn,
            "steps": sum(len(ev) for ev in run.log.steps.values()),
            "validations": len(dict(run.log.validations)),
            "incidents": len(incidents), "checkpoints": len(run.log.checkpoints),
            "superseded_steps": {g: list(span) for g, span in sorted(run.superseded.items())},
            "skipped_steps": [list(s) for s in run.skipped if s], "labels": run.labels,
            "goodput": run.goodput[-1][1] if run.goodput else None}


def loss_limits(losses: Sequence[float]) -> tuple[float, float, list[float]] | None:
    """The loss axis's range, and the values above it: one spike (a drill's 16.0 among losses near 3) would
    flatten every other step into a line, so the top is the 99.5th percentile plus half the range below it,
    and what stands above is marked at the top edge instead. None: no finite loss."""
    finite = sorted(v for v in losses if math.isfinite(v))
    if not finite:
        return None
    lo = finite[0]
    q = finite[min(len(finite) - 1, int(0.995 * len(finite)))]
    hi = max(q + 0.5 * (q - lo), lo + 1e-6)
    margin = 0.03 * (hi - lo)
    return lo - margin, hi + margin, [v for v in finite if v > hi + margin]


def _draw_curves(plt, panels, run: _Run) -> list:
    """Loss, lr and tokens/s of each generation: solid where it leads to the final state, dashed and
    faded where a later generation trained the same steps again."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    palette = plt.get_cmap("tab10" if len(run.log.steps) <= 10 else "tab20").colors
    handles = []
    for i, (gen, events) in enumerate(sorted(run.log.steps.items())):
        color = palette[i % len(palette)]
        cut = run.superseded[gen][0] if gen in run.superseded else math.inf
        kept = [e for e in events if e["step"] < cut]
        tail = [e for e in events if e["step"] >= cut]
        if kept and tail:       # join the dashed tail to the solid part
            tail = [kept[-1], *tail]
        if not any(math.isfinite(_number(e.get("loss"))) for e in events):
            continue            # nothing of it would be drawn: not listed either
        for ax, key in zip(panels, ("loss", "lr", "tokens_per_s")):
            for part, style in ((kept, {"lw": 0.9}), (tail, {"lw": 0.9, "ls": "--", "alpha": 0.5})):
                if part:        # one step alone is a dot (a line of one point draws nothing)
                    ax.plot([e["step"] for e in part], [_number(e.get(key)) for e in part], color=color,
                            **style, **({"marker": "o", "ms": 2.5} if len(part) == 1 else {}))
        handles.append(Line2D([], [], color=color, lw=1.2, label=f"generation {gen}"))
    if run.superseded:
        handles.append(Line2D([], [], color="0.4", lw=1, ls="--", alpha=0.6, label="superseded (trained again)"))
    if run.log.validations:     # a rollback's re-measured steps: the later value is the one that stands
        by_step = dict(run.log.validations)
        panels[0].plot(sorted(by_step), [by_step[s] for s in sorted(by_step)], color="black", lw=1, ls=":",
                       marker="o", ms=3.5, zorder=4)
        handles.append(Line2D([], [], color="black", lw=1, ls=":", marker="o", ms=3.5, label="validation loss"))
    limits = loss_limits([_number(e.get("loss")) for ev in run.log.steps.values() for e in ev])
    if limits is not None:
        lo, hi, above = limits
        panels[0].set_ylim(lo, hi)
        if above:
            steps = [e["step"] for ev in run.log.steps.values() for e in ev if _number(e.get("loss")) > hi]
            panels[0].plot(steps, [hi] * len(steps), "^", ms=5, color="tab:red", ls="none", clip_on=False, zorder=5)
            handles.append(Line2D([], [], marker="^", ms=5, color="tab:red", ls="none",
                                  label=f"loss above the axis (max {max(above):.4g})"))
    if run.goodput:
        panels[3].plot([s for s, _ in run.goodput], [100 * r for _, r in run.goodput], color="tab:green", lw=1,
                       marker="o", ms=2)
        panels[3].set_ylim(0, 100)
    for ax, name in zip(panels, ("loss", "learning rate", "tokens/s", "goodput %")):
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.tick_params(labelbottom=ax is panels[-1])
    panels[2].yaxis.set_major_formatter(EngFormatter())
    panels[-1].set_xlabel("step")
    return handles


def _draw_incident_spans(panels, run: _Run) -> list:
    """Each incident shaded over its steps (fainter: a warning; fainter below the loss), and the
    steps whose samples a rollback skips hatched on the loss."""
    from matplotlib.patches import Patch

    for record, found in zip(run.incidents, run.skipped):
        inc = record.incident
        color = COLORS.get(inc.kind.value, "tab:blue")
        for ax in panels:
            ax.axvspan(inc.first_step - 0.5, max(inc.last_step, inc.first_step) + 0.5, color=color,
                       alpha=(0.25 if record.action else 0.1) * (1 if ax is panels[0] else 0.6), lw=0)
        if found:
            panels[0].axvspan(found[0] - 0.5, found[1] + 0.5, fill=False, hatch="///", edgecolor="0.25", lw=0)
    if any(run.skipped):
        return [Patch(fill=False, hatch="///", edgecolor="0.25", lw=0, label="steps whose samples are skipped")]
    return []


def _draw_strip(ax, markers: Sequence[Marker], run: _Run) -> list:
    """Above the loss: committed checkpoints along the bottom (hollow: one a later generation went
    back past), numbered incident markers in the rows above, each rollback's arrow to its checkpoint."""
    from matplotlib.lines import Line2D

    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.spines["bottom"].set_color("0.75")
    ax.tick_params(left=False, labelleft=False, bottom=False, labelbottom=False)
    ax.set_title(f"{run.name}: {run.state.status}, generation {run.state.generation}, "
                 f"{len(run.incidents)} incident(s){verdicts_text(run.state)}", loc="left", fontsize=10)
    handles = []
    if run.log.checkpoints:
        gone = [(g, s) for g, s in run.log.checkpoints if g in run.superseded and s >= run.superseded[g][0]]
        kept = [s for g, s in run.log.checkpoints if (g, s) not in gone]
        ax.plot(kept, [0.3] * len(kept), "v", ms=5, color="black", ls="none", clip_on=False)
        ax.plot([s for _, s in gone], [0.3] * len(gone), "v", ms=5, mfc="none", mec="0.5", ls="none", clip_on=False)
        handles.append(Line2D([], [], marker="v", ms=5, color="black", ls="none", label="checkpoint"))
    for marker in markers:
        color = COLORS.get(run.incidents[marker.numbers[0] - 1].kind.value, "tab:blue")
        y = 1.5 + marker.row
        ax.text(marker.x, y, marker.text, ha="center", va="center", fontsize=7, color=color, zorder=3,
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": color, "lw": 0.8})
        for n in marker.numbers:
            record = run.incidents[n - 1]
            if isinstance(record.action, Rollback):
                ax.annotate("", xy=(record.action.checkpoint_step, y),
                            xytext=(max(record.incident.last_step, record.incident.first_step) + 0.5, y),
                            arrowprops={"arrowstyle": "->", "lw": 0.8, "color": COLORS.get(record.kind.value,
                                                                                         "tab:blue")}, zorder=2)
    return handles


def verdicts_text(state: RunState) -> str:
    """What triage found and what it left out, for the title: `; triage: transient 2, device 1; quarantined:
    node 0 device 1` (empty when neither happened)."""
    parts = []
    if state.triage:
        parts.append("triage: " + ", ".join(f"{v} {n}" for v, n in sorted(state.triage.items())))
    held = sorted(k for k, e in state.lemons.items() if e.get("quarantines"))
    if held:
        parts.append("quarantined: " + ", ".join(held))
    return "".join(f"; {p}" for p in parts)


def _draw_listing(fig, ax_side, legend, incidents: Sequence[IncidentRecord], labels: Sequence[str]) -> None:
    """The numbered incidents under the legend, each in its kind's colour, folded to what fits."""
    from matplotlib.transforms import offset_copy

    fontsize, line_pt = 7.5, 7.5 * 1.3
    box = legend.get_window_extent(fig.canvas.get_renderer()).transformed(ax_side.transAxes.inverted())
    top = box.y0 - 0.03
    room_pt = top * ax_side.get_position().height * fig.get_figheight() * 72 - 2 * line_pt   # less the heading
    entries = [f"{step_span(r.incident.first_step, max(r.incident.last_step, r.incident.first_step))}, "
               f"gen {r.generation}: {label}" for r, label in zip(incidents, labels)]
    max_entries = MAX_LISTED
    while True:        # fold sooner when the legend leaves less room than the list needs
        lines = listing(entries, max_entries=max_entries)
        if sum(t.count("\n") + 1 for t in lines) * line_pt <= room_pt or max_entries <= 1:
            break
        max_entries -= 1
    ax_side.text(0, top, "incidents", transform=ax_side.transAxes, fontsize=8.5, fontweight="bold", va="top")
    used = 1.6
    for i, text in enumerate(lines):
        folded = text.startswith("\u2026")
        color = "0.3" if folded else COLORS.get(incidents[i].kind.value, "tab:blue")
        ax_side.text(0, top, text, fontsize=fontsize, va="top", color=color, linespacing=1.15,
                     transform=offset_copy(ax_side.transAxes, fig=fig, y=-used * line_pt, units="points"))
        used += text.count("\n") + 1 + 0.35


def _number(value) -> float:
    """A logged value as a float; "nan", "inf" (how the log writes non-finite values) and a missing one are NaN,
    so a non-finite step leaves a gap in the curve instead of stretching its axis."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return float("nan")
    return number if math.isfinite(number) else float("nan")
