"""HCCL's own verdicts, read from an Ascend rank's log and plog into the crash incident (issue 48 §1). The lines
are CANN's documented formats (HCCL user guide: cluster fault location; error codes EI0002, EI0006)."""
import os
import time

import pytest

from contracts.config import load_config
from daemon.judging import hccl_verdicts, watch
from daemon.judging.health import HealthMonitor
from daemon.judging.incidents import Kind
from daemon.processes import rank_log

pytestmark = pytest.mark.unit

LOCATED = ("[ERROR] HCCL(835695,python):2025-10-23-17:28:06.049.385 [task_exception_handler.cc:610][835695]Cluster "
           "Exception Location[IP/ID]:[127.10.0.1/1], Arrival Time:[Thu Oct 23 17:25:58 2025], "
           "Discoverer:[127.10.0.1/2], ExceptionType:[Heartbeat Lost Occurred], Possible Reason:1. Process has "
           "exited, 2. Network Disconnected")
TRACE = ("[INFO] HCCL(686,python):2025-10-23-07:52:59.191.363 [heartbeat.cc:951] [8970][HCCL_TRACE]rank "
         "[127.10.0.1/1]: rank [127.10.0.1/9] status[STUCK] by rank [127.10.0.1/1]")
TIMEOUT = ("[ERROR] HCCL(3977573,python):2025-11-22-17:37:04.447.996 [hccl_socket_manager.cc:816] "
           "[3977663][Wait][LinkEstablish]wait socket establish timeout, role[0] rank[0] timeout[120 s]")


def test_the_root_rank_hccl_located_is_named_with_what_happened_to_it():
    found = hccl_verdicts.verdicts(["noise", LOCATED, LOCATED, TRACE, TIMEOUT])
    assert [v.to_dict() for v in found] == [
        {"rank": 1, "address": "127.10.0.1", "exception": "Heartbeat Lost Occurred", "discoverer": 2,
         "reason": "1. Process has exited, 2. Network Disconnected"},
        {"rank": 9, "address": "127.10.0.1", "exception": "Stuck Occurred", "discoverer": 1},
        {"rank": -1, "exception": "EI0006",
         "reason": "a link between ranks was not set up in time (HCCL_CONNECT_TIMEOUT)"}]
    assert hccl_verdicts.culprits(found) == [1, 9]
    assert hccl_verdicts.verdicts(["Traceback (most recent call last):", "RuntimeError: boom"]) == []


def test_the_plog_files_written_since_the_generation_began_are_read_beside_the_rank_s_log(tmp_path):
    log = tmp_path / "rank-0.log"
    log.write_text("an older generation's " + LOCATED + "\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("RuntimeError: the collective failed\n")
    plogs = rank_log.plog_dir(tmp_path, 0) / "debug" / "plog"
    plogs.mkdir(parents=True)
    (plogs / "plog-1234_20251023.log").write_text(TRACE + "\n")
    stale = plogs / "plog-99_20251001.log"
    stale.write_text(TIMEOUT + "\n")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    found = rank_log.hccl_verdicts(log, start, rank_log.plog_dir(tmp_path, 0), since_unix_s=time.time() - 60)
    assert [(v["rank"], v["exception"]) for v in found] == [(9, "Stuck Occurred")]


def test_a_crash_incident_carries_hccl_s_verdict_and_names_its_root():
    cfg = load_config(None, ["parallel.dp=2", "train.micro_batch=4"])
    w = watch.Watch(cfg, generation=1, ranks=(0, 1), now=0.0, log_paths={0: "r0", 1: "r1"},
                    monitor=HealthMonitor(cfg.health, precision="fp32"))
    verdict = hccl_verdicts.verdicts([LOCATED])[0].to_dict()
    w.on_exit(0, 1, 5.0, error_line="RuntimeError: HCCL error", hccl=[verdict])
    outcome = w.tick(5.0)
    assert outcome.incident.kind is Kind.CRASH
    assert outcome.incident.evidence["hccl"] == [verdict]
    assert "HCCL: rank 1 Heartbeat Lost Occurred" in outcome.incident.detail
    crash = [e for e in w.drain() if isinstance(e, watch.Note) and e.event == "crash"]
    assert crash[0].fields["hccl"] == [verdict]
