"""Post-mortem bundles (issue 48, section 2): the real supervisor against the fake worker writes one per incident,
`llm-pretrain incident` lists it, summarises it and packs it; old ones are retired."""
import json
import platform
import tarfile

from cli.main import main
from contracts.config import config_hash, load_config
from daemon.records import bundles
from tests.integration.test_supervisor import _finish, _named, _start


def _bundles(run):
    return sorted(p.name for p in (run / "incidents").iterdir())


def test_a_crash_leaves_a_bundle_that_the_command_lists_summarises_and_packs(tmp_path, capsys):
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, fake=["--steps", "20", "--crash-at", "12", "--rank-faults", "1",
                                                  "--fault-generations", "1"], ranks=2))
    assert code == 0, err
    assert _bundles(run) == ["0000-g1-crash"]
    bundle = run / "incidents" / "0000-g1-crash"
    assert sorted(p.name for p in bundle.iterdir()) == ["config.resolved.toml", "environment.json", "events.jsonl",
                                                       "incident.json", "rank-0.log.tail", "rank-1.log.tail"]
    rec = json.loads((bundle / "incident.json").read_text())
    restart = _named(events, "restart")[0]
    assert (rec["index"], rec["kind"], rec["generation"], rec["rank"]) == (0, "crash", 1, 1)
    assert rec["action"]["type"] == "restart" and rec["resume_reason"] == rec["action"]["reason"]
    assert rec["resume_step"] == restart["resume_step"] and rec["committed_step"] == restart["resume_step"]
    resolved = (bundle / "config.resolved.toml").read_text()
    assert resolved == (run / "config.resolved.toml").read_text()          # no policy change: the same config
    assert rec["trajectory_hash"] == config_hash(load_config(str(run / "config.resolved.toml"), []))
    logged = [json.loads(line) for line in (bundle / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in logged if e["event"] == "incident"] == ["incident"]
    assert {"daemon_start", "generation_start", "crash"} <= {e["event"] for e in logged}
    assert all(e["generation"] in (0, 1) for e in logged)
    tail = (bundle / "rank-1.log.tail").read_text()
    assert '"kind": "step"' in tail and '"generation": 2' not in tail          # this generation's part only
    env = json.loads((bundle / "environment.json").read_text())
    assert env["python"] == platform.python_version() and "mindspore" in env and env["hostname"]
    assert sum(p.stat().st_size for p in bundle.iterdir()) <= bundles.BUNDLE_BYTES

    assert main(["incident", str(run)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 1 and "crash" in listed[0] and listed[0].endswith(str(bundle))
    assert main(["incident", str(run), "0"]) == 0
    summary = capsys.readouterr().out
    assert "incident 0: crash in generation 1" in summary and f"resumed from step {rec['resume_step']}" in summary
    out = tmp_path / "incident-0.tar.gz"
    assert main(["incident", str(run), "0", "--bundle", str(out)]) == 0
    with tarfile.open(out) as tar:
        names = tar.getnames()
        assert "0000-g1-crash/incident.json" in names and "0000-g1-crash/rank-0.log.tail" in names
        assert json.load(tar.extractfile("0000-g1-crash/incident.json"))["kind"] == "crash"
    capsys.readouterr()
    assert main(["incident", str(run), "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llm-pretrain: no bundle for incident 7")


def test_a_hang_s_bundle_holds_the_stacks(tmp_path):
    run = tmp_path / "run"
    code, _, err = _finish(_start(run, overrides=["health.hang_floor_s=1.5", "health.hang_step_multiplier=5"],
                                  fake=["--steps", "12", "--hang-at", "8", "--fault-generations", "1"]))
    assert code == 0, err
    (bundle,) = (run / "incidents").iterdir()
    assert bundle.name == "0000-g1-hang"
    assert "most recent call first" in (bundle / "rank-0.log.tail").read_text()     # faulthandler's dump
    assert json.loads((bundle / "incident.json").read_text())["action"]["type"] == "restart"


def test_more_incidents_than_kept_leave_the_newest_bundles(tmp_path):
    run = tmp_path / "run"
    code, events, _ = _finish(_start(run, overrides=["health.max_restarts_without_progress=4",
                                                     "checkpoint.keep_incident_bundles=2"], fake=["--die-at-start"]))
    assert code == 3 and len(_named(events, "incident")) == 4
    assert _bundles(run) == ["0002-g3-crash", "0003-g4-crash"]
    last = json.loads((run / "incidents" / "0003-g4-crash" / "incident.json").read_text())
    assert last["action"]["type"] == "halt"
