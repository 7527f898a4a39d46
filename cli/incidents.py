"""`llm-pretrain incident RUN [N] [--bundle OUT]`: a run's incidents and their post-mortem bundles.

The bundles are the daemon's (daemon.records.bundles: `<node dir>/incidents/<NNNN>-g<generation>-<kind>/`); this
lists them beside state.json's incidents, prints one's summary, or packs one into a `.tar.gz` for a ticket.
"""
from __future__ import annotations

import json
import sys
import tarfile
import time
from pathlib import Path

from contracts.protocol import ExitCode
from contracts.runs import resolve_run_dir
from daemon.records import bundles
from daemon.records.state import RunState, StateCorruptError


def _node_dirs(run_dir: Path) -> list[Path]:
    """Where state.json and the bundles are: the run directory (one machine), or each node's own directory."""
    nodes = sorted(p for p in (run_dir / "nodes").glob("node-*") if p.is_dir())
    return [run_dir, *nodes] if (run_dir / bundles.INCIDENTS_DIR).is_dir() or not nodes else nodes


def _incidents(node_dir: Path) -> list[dict]:
    try:
        return [r.to_dict() for r in RunState.load(node_dir).incidents]
    except (StateCorruptError, OSError):
        return []


def _lines(run_dir: Path) -> list[str]:
    out = []
    for node_dir in _node_dirs(run_dir):
        kept = {bundles.parse(n)[0]: p for n, p in bundles.listed(node_dir / bundles.INCIDENTS_DIR).items()}
        where = "" if node_dir == run_dir else f"{node_dir.name} "
        for i, rec in enumerate(_incidents(node_dir)):
            action = (rec.get("action") or {}).get("type", "warning")
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.get("unix_s") or 0))
            steps = f"steps {rec.get('first_step')}-{rec.get('last_step')}"
            bundle = str(kept[i]) if i in kept else "(no bundle)"
            out.append(f"{where}{i:4d}  {when}  g{rec.get('generation')}  {rec.get('kind')}  {steps}  {action}  {bundle}")
    return out


def _find(run_dir: Path, index: int) -> Path | None:
    for node_dir in _node_dirs(run_dir):
        for n, path in bundles.listed(node_dir / bundles.INCIDENTS_DIR).items():
            if bundles.parse(n)[0] == index:
                return path
    return None


def render(bundle: Path) -> str:
    """A bundle's summary: the incident, what was done, where the run resumed, the environment, the files."""
    rec = json.loads((bundle / bundles.INCIDENT_FILE).read_text())
    try:
        env = json.loads((bundle / "environment.json").read_text())
    except (OSError, ValueError):
        env = {}
    action = rec.get("action") or {}
    cann, driver = env.get("cann") or {}, env.get("npu_driver") or {}
    lines = [f"incident {rec.get('index')}: {rec.get('kind')} in generation {rec.get('generation')}, steps "
             f"{rec.get('first_step')}-{rec.get('last_step')}" + (f", rank {rec['rank']}" if rec.get("rank") is not None
                                                                  else ""),
             f"  detail:      {rec.get('detail') or '-'}",
             f"  action:      {action.get('type', '-')}: {action.get('reason', '-')}",
             f"  resumed from step {rec.get('resume_step')} (committed: {rec.get('committed_step')}); trajectory "
             f"hash {rec.get('trajectory_hash')}",
             f"  environment: python {env.get('python')}, mindspore {env.get('mindspore') or '-'}, CANN "
             f"{cann.get('version') or '-'}, driver {driver.get('version') or '-'}, host {env.get('hostname')}",
             f"  bundle:      {bundle}"]
    lines += [f"    {p.name}  {p.stat().st_size:,} bytes" for p in sorted(bundle.iterdir()) if p.is_file()]
    return "\n".join(lines)


def pack(bundle: Path, out: Path) -> None:
    """The bundle as a `.tar.gz`, its files under the bundle's own directory name."""
    with tarfile.open(out, "w:gz") as tar:
        tar.add(bundle, arcname=bundle.name)


def run(run_name: str, index: int | None, *, bundle_out: str | None = None) -> int:
    run_dir = resolve_run_dir(run_name)
    if index is None:
        if bundle_out:
            print("llm-pretrain: --bundle needs the incident's number N", file=sys.stderr)
            return ExitCode.USAGE
        lines = _lines(run_dir)
        print("\n".join(lines) if lines else f"no incidents recorded in {run_dir}")
        return ExitCode.OK
    bundle = _find(run_dir, index)
    if bundle is None:
        print(f"llm-pretrain: no bundle for incident {index} of {run_dir} (`llm-pretrain incident {run_name}` lists "
              f"them; old ones are retired with their checkpoints)", file=sys.stderr)
        return ExitCode.USAGE
    if bundle_out:
        pack(bundle, Path(bundle_out))
        print(f"wrote {bundle_out}")
        return ExitCode.OK
    print(render(bundle))
    return ExitCode.OK
