import json
import math

import pytest

from contracts.protocol import FINAL_EXIT_CODES, ExitCode, ExitEvent, StepEvent, decode_event, send_datagram


def test_exit_codes_match_the_design_registry():
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0, "SOAK_FAILED": 1, "USAGE": 2, "GAVE_UP_CRASH_LOOP": 3, "GAVE_UP_NUMERICS": 4, "LOCKED": 5,
        "DATA_ERROR": 65, "NO_DAEMON": 69, "CANT_CREATE": 73, "TEMP_FAIL": 75, "INTERNAL_ERROR": 70,
        "CONFIG_ERROR": 78}
    assert ExitCode.INTERNAL_ERROR not in FINAL_EXIT_CODES
    # the daemon's final codes (the unit's RestartPreventExitStatus=); 1 and 69 are only the CLI's
    assert set(FINAL_EXIT_CODES) == set(ExitCode) - {ExitCode.INTERNAL_ERROR, ExitCode.SOAK_FAILED, ExitCode.NO_DAEMON,
                                                     ExitCode.CANT_CREATE, ExitCode.TEMP_FAIL}   # 75: etcd returns


def _step(**kw):
    base = dict(rank=1, generation=2, step=3, loss=2.5, grad_norm=0.7, loss_scale=1.0, lr=1e-3,
                lr_multiplier=1.0, skipped=False, sample_start=16, sample_end=24, tokens=512, step_s=0.1,
                data_wait_s=0.001, tokens_per_s=5120.0)
    base.update(kw)
    return StepEvent(**base)


@pytest.mark.parametrize("loss", [2.5, float("nan"), float("inf"), float("-inf")])
def test_step_event_round_trips_as_strict_json(loss):
    event = _step(loss=loss, grad_norm=float("nan"), skipped=True)
    text = event.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = decode_event(text)
    assert isinstance(back, StepEvent)
    assert (math.isnan(back.loss) if math.isnan(loss) else back.loss == loss)
    assert back.skipped and math.isnan(back.grad_norm) and back.sample_end == 24


def test_per_rank_values_round_trip_with_their_non_finite_ones():
    event = _step(loss=2.5, grad_norm=float("inf"), skipped=True, rank_losses=[2.4, 2.6],
                  rank_grad_norms=[1.5, float("inf")])
    text = event.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = decode_event(text)
    assert back.rank_losses == [2.4, 2.6] and back.rank_grad_norms == [1.5, float("inf")]
    assert decode_event(_step(loss=1.0).to_json()).rank_losses is None        # one rank, or tp/pp: none


def test_exit_event_round_trips():
    e = ExitEvent(rank=0, generation=0, step=10, reason="finished", params_sha256="ab")
    assert decode_event(e.to_json()) == e


@pytest.mark.parametrize("line", ['{"kind": "gossip"}', "[1, 2]", '"step"', "not json"])
def test_unknown_lines_are_refused(line):
    with pytest.raises(ValueError):
        decode_event(line)


def test_a_full_socket_queue_is_waited_for_and_a_missing_reader_is_not(tmp_path):
    """Linux queues only net.unix.max_dgram_qlen datagrams per socket: a sender with time to wait
    gets through once the reader drains; with none left (or no reader at all) the event is dropped."""
    import socket
    import threading
    import time

    path = str(tmp_path / "events.sock")
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    reader.bind(path)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)
    event = ExitEvent(rank=0, generation=0, step=10, reason="stopped")
    queued = 0
    while send_datagram(sender, path, event):
        queued += 1
        assert queued < 100_000, "the queue never filled"
    started = time.monotonic()
    assert not send_datagram(sender, path, event, wait_s=0.1)           # full, and nobody drains
    assert time.monotonic() - started >= 0.1
    threading.Timer(0.2, lambda: [reader.recv(65536) for _ in range(queued)]).start()
    assert send_datagram(sender, path, event, wait_s=60.0)              # through once drained
    reader.close()
    started = time.monotonic()
    assert not send_datagram(sender, path, event, wait_s=600.0)         # no reader: not waited for
    assert time.monotonic() - started < 60


def test_one_strict_json_for_events_the_log_and_the_state():
    """Non-finite floats at any depth become strings (valid JSON); an event reads them back only into the fields
    declared as floats, so a name that reads 'nan' (a drill's fault, a parameter) stays a string."""
    import json
    import math

    from contracts import strict_json
    from contracts.protocol import FingerprintEvent

    nested = {"a": [1.0, float("nan")], "b": {"c": float("-inf")}, "d": "nan"}
    text = json.dumps(strict_json.encode(nested), allow_nan=False)
    back = strict_json.decode(json.loads(text))
    assert math.isnan(back["a"][1]) and back["b"]["c"] == float("-inf")
    fields = {f.name: f for f in __import__("dataclasses").fields(FingerprintEvent)}
    event = FingerprintEvent.from_dict({**{k: 0 for k in fields}, "names": ["nan", "inf"], "groups": [1],
                                        "seconds": "inf"})
    assert event.names == ["nan", "inf"] and event.seconds == float("inf")


def test_a_faulty_rank_drill_needs_replicas_to_be_told_from():
    """With one data-parallel rank a faulty device's gradients have nothing to be compared with: the drill
    moved the gradient norm 40x and no detector could say so. It is refused, naming why, where dp is known."""
    import pytest

    from contracts.protocol import InjectRequest
    from daemon.judging.requests import VERBS

    with pytest.raises(ValueError, match=r"faulty-rank needs at least two data-parallel replicas \(parallel.dp = 1\)"):
        InjectRequest.from_dict({"fault": "faulty-rank", "rank": 0}, world=1, dp=1)
    assert InjectRequest.from_dict({"fault": "faulty-rank", "rank": 1}, world=2, dp=2).fault == "faulty-rank"
    assert InjectRequest.from_dict({"fault": "nan", "rank": 0}, world=1, dp=1).fault == "nan"

    from contracts.config import load_config

    alone = load_config(None, ["health.allow_fault_injection=true"])
    with pytest.raises(ValueError, match="faulty-rank needs"):
        VERBS["inject"].command_args({"fault": "faulty-rank", "rank": 0}, cfg=alone)
