"""What a supervised script's step events carry, and what follows from what they lack (docs/bring-your-own-script.md).

A script's rank (llm_pretrain_client) names in its first PhaseEvent what it reports, of contracts.protocol.REPORTS.
The health monitor already treats a missing value as no signal (a NaN grad norm feeds no grad-norm detector); this
module says so — which detectors or actions are off and why — once, for the event log and status. Pure.
"""
from __future__ import annotations

from typing import Any, Sequence

from contracts.protocol import REPORTS

# What is off, or what the policy does instead, without each report.
WITHOUT = {
    "loss": "the loss spike, collapse and stall detectors and the NaN check (only crashes and hangs are seen)",
    "grad_norm": "the grad-norm spike and burst detectors and the rank-outlier check (the loss detectors stay on)",
    "loss_scale": "the overflow-storm detector and the loss-scale cap after one",
    "lr": "the lr shown by status and plot (a rollback's lr cut is still sent)",
    "data_position": "a rollback's data position: the script restarts its data where it chooses",
    "skip_data": "skipping a rolled-back data window (a rollback cuts the lr and trains the window again)",
}


def describe(reports: Sequence[str]) -> dict[str, Any]:
    """{reports, missing, off, detail}: `off` the consequence of each missing report, `detail` one line for the
    event log and status ("" when nothing is missing). Names not in REPORTS are kept but mean nothing."""
    known = [r for r in REPORTS if r in reports]
    missing = [r for r in REPORTS if r not in reports]
    off = {r: WITHOUT[r] for r in missing}
    detail = ("the script reports no " + ", no ".join(missing) + ": off: "
              + "; ".join(f"{r}: {what}" for r, what in off.items())) if missing else ""
    return {"reports": known, "missing": missing, "off": off, "detail": detail}
