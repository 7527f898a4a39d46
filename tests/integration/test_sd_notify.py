"""The supervisor speaks systemd's notify protocol on a real NOTIFY_SOCKET datagram socket."""
import os
import socket
import threading

from tests.integration.test_supervisor import _finish, _start


def _collect(sock, messages, done):
    """Reads as systemd does, as messages come (a UNIX datagram queue holds only a few), and once
    `done` (the daemon has exited), whatever is still queued."""
    sock.settimeout(0.05)
    while not done.is_set():
        try:
            messages.append(sock.recv(4096).decode())
        except socket.timeout:
            pass
    sock.setblocking(False)
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return


def test_ready_status_watchdog_and_stopping_arrive(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    messages, done = [], threading.Event()
    reader = threading.Thread(target=_collect, args=(sock, messages, done))
    reader.start()
    env = dict(os.environ, NOTIFY_SOCKET=str(path), WATCHDOG_USEC="400000")   # a ping every 0.2 s
    code, _, err = _finish(_start(tmp_path / "run", fake=["--steps", "150", "--step-s", "0.02"], env=env))
    done.set()
    reader.join()
    sock.close()
    assert code == 0, err
    fields = [f for m in messages for f in m.split("\n")]
    assert messages[0].startswith("READY=1\nSTATUS=starting") and "MAINPID=" in messages[0]
    assert any(f.startswith("STATUS=step ") and " loss " in f for f in fields), fields
    pings = fields.count("WATCHDOG=1")
    print(f"{len(messages)} messages, {pings} watchdog pings")
    assert pings >= 5          # generous: the fake's steps alone sleep 3 s, 15 periods of 0.2 s (the cadence: below)
    assert messages[-1].startswith("STOPPING=1\nSTATUS=exiting with 0"), messages[-4:]
    # the ranks never see the daemon's socket: only the main process may notify
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert "NOTIFY_SOCKET" not in log


def test_an_abstract_socket_address_is_understood(tmp_path):
    from daemon.records.notify import Notifier

    name = f"llm-pretrain-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
    notifier.ready("up")
    assert sock.recv(4096).decode().startswith("READY=1\nSTATUS=up")
    sock.close()


def test_the_watchdog_is_pinged_once_per_half_period_at_the_times_given(tmp_path):
    from daemon.records.notify import Notifier

    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    notifier = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"})
    pinged = []
    for now in (100.0, 100.1, 100.199, 100.2, 100.35, 100.4, 101.0):
        notifier.tick(now)
        try:
            sock.recv(4096)
            pinged.append(now)
        except BlockingIOError:
            pass
    assert pinged == [100.0, 100.2, 100.4, 101.0]
    assert not Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000", "WATCHDOG_PID": "1"}).watchdog_s
    sock.close()
