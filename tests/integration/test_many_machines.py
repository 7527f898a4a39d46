"""Eight machines of one run simulated on this one (tests/integration/simulated_machines.py: a real
supervisor per machine, fake ranks, a real etcd): a rank's crash on one machine restarts every machine
in one decided generation; while the run trains no daemon writes to etcd or reads from it, whatever
the step rate (only leases and the watch); the decider killed, another decides and every survivor is
in the next, smaller generation; `status` shows every machine. bench/multinode_scale.py times the
same at 4, 16 and 64 machines."""
import json
import subprocess
import sys

import pytest

from tests.etcd_server import EtcdServer
from tests.integration.simulated_machines import ROOT, SimulatedRun, etcd_requests

MACHINES, PER_MACHINE, CRASHING_MACHINE = 8, 2, 5


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()
    yield server
    server.stop()


def _steps(sim: SimulatedRun, machine: int) -> int:
    """Steps the ranks of `machine` have reported, summed over its rank logs."""
    logs = (sim.run / "logs" / f"node-{machine}").glob("rank-*.log")
    return sum(log.read_text(errors="replace").count('"kind": "step"') for log in logs)


def test_a_rank_crash_on_one_of_eight_machines_restarts_all_eight_in_one_decided_generation(tmp_path, etcd):
    sim = SimulatedRun(tmp_path, etcd.url, machines=MACHINES, ranks_per_machine=PER_MACHINE, step_s=0.1,
                       crash_rank=CRASHING_MACHINE * PER_MACHINE + 1)
    sim.start()
    try:
        sim.wait(lambda: sim.all_stepping(1), 120, "every machine stepping")
        # while it trains: leases and the watch only, whatever the step rate — no key read or written
        saved = len(sim.events(0, "checkpoint_committed"))
        before, stepped = etcd_requests(etcd.url), [_steps(sim, m) for m in range(MACHINES)]
        sim.wait(lambda: all(_steps(sim, m) >= stepped[m] + 30 * PER_MACHINE for m in range(MACHINES)), 120,
                 "thirty more steps on every machine")
        during = {k: v - before.get(k, 0) for k, v in etcd_requests(etcd.url).items()}
        saved = len(sim.events(0, "checkpoint_committed")) - saved + 1
        assert {k: during.get(k, 0) for k in ("Put", "DeleteRange", "Range", "LeaseGrant")} == dict.fromkeys(
            ("Put", "DeleteRange", "Range", "LeaseGrant"), 0), during
        # the decider confirms it still decides before it retires old checkpoints: one per save, not per step
        assert during.get("Txn", 0) <= saved, (during, saved)
        assert during.get("LeaseKeepAlive", 0) > 0          # the leases were renewed meanwhile: the count is live

        sim.crash(1)
        sim.wait(lambda: sim.all_stepping(2), 120, "every machine stepping in generation 2")
        status = subprocess.run([sys.executable, "-m", "cli", "status", "--json", str(sim.run)], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
    finally:
        codes = sim.stop()
    assert codes == [0] * MACHINES
    incidents = {m: [e for e in sim.events(m, "incident") if e["generation"] == 1] for m in range(MACHINES)}
    assert all(len(found) == 1 for found in incidents.values()), incidents
    decided = {(e["kind"], e["rank"], json.dumps(e["action"], sort_keys=True)) for found in incidents.values()
               for e in found}
    assert len(decided) == 1 and next(iter(decided))[:2] == ("crash", CRASHING_MACHINE * PER_MACHINE + 1), decided
    assert [m for m in range(MACHINES) if sim.events(m, "elected")] == [0]      # one decider, all along
    assert not any(sim.events(m, "decision_mismatch") for m in range(MACHINES))
    starts = [[e for e in sim.events(m, "generation_start") if e["generation"] == 2] for m in range(MACHINES)]
    assert all(len(s) == 1 for s in starts) and len({s[0]["resume_step"] for s in starts}) == 1
    assert [s[0]["ranks"] for s in starts] == [[m * PER_MACHINE + r for r in range(PER_MACHINE)]
                                               for m in range(MACHINES)]
    shown = json.loads(status.stdout)
    assert shown["decider"] == 0 and [(n["node"], n["status"], n["generation"]) for n in shown["nodes"]] == [
        (m, "running", 2) for m in range(MACHINES)]


def test_the_decider_killed_among_eight_machines_another_decides_and_seven_train_on(tmp_path, etcd):
    sim = SimulatedRun(tmp_path, etcd.url, machines=MACHINES, ranks_per_machine=PER_MACHINE, step_s=0.1)
    sim.start()
    try:
        sim.wait(lambda: sim.all_stepping(1), 120, "every machine stepping")
        sim.expect_ended = True
        sim.kill(0)
        survivors = range(1, MACHINES)
        sim.wait(lambda: sim.all_stepping(2, survivors), 120, "the seven survivors stepping in generation 2")
    finally:
        codes = sim.stop()
    assert codes[1:] == [0] * (MACHINES - 1)
    elected = {m: sim.events(m, "elected") for m in survivors}
    assert [m for m, found in elected.items() if found] == [1], elected      # the lowest live node, alone
    lost = [e for e in sim.events(1, "incident") if e["kind"] == "node_lost"]
    assert len(lost) == 1 and lost[0]["evidence"]["nodes"] == [0]
    shrunk = sim.events(1, "nodes_shrunk")
    assert len(shrunk) == 1 and shrunk[0]["members"] == list(survivors) and shrunk[0]["lost"] == [0]
    starts = {m: [e["ranks"] for e in sim.events(m, "generation_start") if e["generation"] == 2] for m in survivors}
    assert sorted(r for ranks in starts.values() for r in ranks[0]) == list(range((MACHINES - 1) * PER_MACHINE))
