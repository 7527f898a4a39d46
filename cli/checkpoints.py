"""`llm-pretrain checkpoints list|show|verify RUN`: look at a run's checkpoints without MindSpore."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from checkpointing import CheckpointError, layout, reader
from contracts.protocol import ExitCode
from contracts.runs import resolve_run_dir


def _rows(root: Path) -> list[dict]:
    latest = (root / layout.LATEST).read_text().strip() if (root / layout.LATEST).exists() else ""
    rows = []
    for step in layout.committed_steps(root):
        path = layout.step_dir(root, step)
        try:
            m = reader.read_manifest(path)
        except CheckpointError as e:
            rows.append({"step": step, "path": str(path), "error": str(e)})
            continue
        state = m.get("run_state", {})
        rows.append({"step": step, "path": str(path), "latest": path.name == latest,
                     "created": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m["created_unix_s"])),
                     "shards": len(m["shards"]), "size_bytes": sum(s["size_bytes"] for s in m["shards"]),
                     "loss": state.get("metrics", {}).get("loss"), "data_cursor": state.get("data_cursor")})
    return rows


def run(action: str, run_name: str, *, step: int | None = None, as_json: bool = False) -> int:
    try:
        root = resolve_run_dir(run_name) / "checkpoints"
    except FileNotFoundError as e:
        print(f"llm-pretrain: {e}", file=sys.stderr)
        return ExitCode.USAGE
    steps = layout.committed_steps(root)
    if action == "list":
        rows = _rows(root)
        others = sorted(p.name for p in root.glob("step-*") if p.is_dir() and layout.parse_step(p.name) is None) \
            if root.is_dir() else []
        if as_json:
            print(json.dumps({"checkpoints": rows, "other": others}, indent=2))
            return ExitCode.OK
        if not rows:
            print(f"no committed checkpoints in {root}")
        else:
            print(f"{'step':>10}  {'created (UTC)':<19}  {'shards':>6}  {'size MB':>9}  {'loss':>8}  {'cursor':>9}")
            for r in rows:
                if "error" in r:
                    print(f"{r['step']:>10}  unreadable: {r['error']}")
                    continue
                loss = f"{r['loss']:.4f}" if isinstance(r["loss"], float) else "-"
                print(f"{r['step']:>10}  {r['created']:<19}  {r['shards']:>6}  {r['size_bytes'] / 1e6:>9.2f}  "
                      f"{loss:>8}  {r['data_cursor']!s:>9}{'  LATEST' if r['latest'] else ''}")
        for name in others:
            print(f"  also: {name} ({'in progress or interrupted' if name.endswith('.tmp') else 'quarantined'})")
        return ExitCode.OK
    if not steps:
        print(f"llm-pretrain: no committed checkpoints in {root}", file=sys.stderr)
        return ExitCode.DATA_ERROR
    if step is not None and step not in steps:
        print(f"llm-pretrain: no committed checkpoint at step {step} in {root}; there are: "
              f"{', '.join(map(str, steps))}", file=sys.stderr)
        return ExitCode.USAGE
    if action == "show":
        chosen = step if step is not None else steps[-1]
        try:
            m = reader.read_manifest(layout.step_dir(root, chosen))
        except CheckpointError as e:
            print(f"llm-pretrain: checkpoint error: {e}", file=sys.stderr)
            return ExitCode.DATA_ERROR
        summary = {k: m[k] for k in ("step", "world_size", "created_unix_s", "versions", "shards", "run_state")}
        summary["tensors"] = len(m["tensors"])
        print(json.dumps(summary, indent=2))
        return ExitCode.OK
    # verify
    chosen = [step] if step is not None else steps
    failed = 0
    for s in chosen:
        problems = reader.verify(layout.step_dir(root, s))
        failed += bool(problems)
        if as_json:
            print(json.dumps({"step": s, "ok": not problems, "problems": problems}))
        else:
            print(f"{layout.step_name(s)}: " + ("ok" if not problems else "FAILED: " + "; ".join(problems)))
    return ExitCode.DATA_ERROR if failed else ExitCode.OK
