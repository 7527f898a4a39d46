"""The supervisor speaks systemd's notify protocol on a real NOTIFY_SOCKET datagram socket."""
import os
import socket
import threading
import time

from tests.integration.test_supervisor import _finish, _start


def _collect(sock, messages, done):
    """Reads as systemd does, as messages come (a UNIX datagram queue holds only a few)."""
    sock.settimeout(0.05)
    while not done.is_set():
        try:
            messages.append(sock.recv(4096).decode())
        except socket.timeout:
            pass


def test_ready_status_watchdog_and_stopping_arrive(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    messages, done = [], threading.Event()
    reader = threading.Thread(target=_collect, args=(sock, messages, done))
    reader.start()
    env = dict(os.environ, NOTIFY_SOCKET=str(path), WATCHDOG_USEC="400000")   # a ping every 0.2 s
    code, _, err = _finish(_start(tmp_path / "run", fake=["--steps", "150", "--step-s", "0.02"], env=env))
    time.sleep(0.2)
    done.set()
    reader.join()
    sock.close()
    assert code == 0, err
    fields = [f for m in messages for f in m.split("\n")]
    assert messages[0].startswith("READY=1\nSTATUS=starting") and "MAINPID=" in messages[0]
    assert any(f.startswith("STATUS=step ") and " loss " in f for f in fields), fields
    pings = fields.count("WATCHDOG=1")
    print(f"{len(messages)} messages, {pings} watchdog pings")
    assert pings >= 5
    assert messages[-1].startswith("STOPPING=1\nSTATUS=exiting with 0"), messages[-4:]
    # the ranks never see the daemon's socket: only the main process may notify
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert "NOTIFY_SOCKET" not in log


def test_an_abstract_socket_address_is_understood(tmp_path):
    from daemon.notify import Notifier

    name = f"llm-pretrain-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
    notifier.ready("up")
    assert sock.recv(4096).decode().startswith("READY=1\nSTATUS=up")
    sock.close()
