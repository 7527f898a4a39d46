"""Hosts for multi-node tests: network namespaces on one machine, each with its own address on a
bridge (veth pairs), so every daemon, rank, scheduler and etcd listens on and talks to real
addresses that only the test's hosts share. A host's link can be cut and restored.

Needs root and iproute2; without them the tests skip, saying so, except under CI (`CI` set),
where that is a failure: `.ci/run` installs iproute2.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, count: int):
        if os.geteuid() != 0 or shutil.which("ip") is None:
            message = "network namespaces need root and iproute2 (Debian: apt-get install iproute2)"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        tag = f"{os.getpid() % 10000:04d}"
        self.count, self.subnet = count, f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self.bridge = f"lpb{tag}"
        self.names = [f"lp{tag}n{i}" for i in range(count)]
        self.links = [f"lp{tag}h{i}" for i in range(count)]      # the host side of each veth pair

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host `i`."""
        return ["ip", "netns", "exec", self.names[i]]

    def __enter__(self) -> "Hosts":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            # the machine itself is on the bridge too (the test's own etcd client and observers)
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            for i, (name, link) in enumerate(zip(self.names, self.links)):
                _ip("netns", "add", name)
                _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", link, "master", self.bridge, "up")
                _ip("-n", name, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            if os.environ.get("CI"):
                raise
            pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
        return self

    def cut(self, i: int) -> None:
        """Host `i` loses its network (its link goes down); `restore` brings it back."""
        _ip("link", "set", self.links[i], "down")

    def lose(self, i: int) -> None:
        """Host `i` is lost as a machine is: every process on it stopped at once, then killed."""
        pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True,
                                               text=True).stdout.split()]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass

    def restore(self, i: int) -> None:
        _ip("link", "set", self.links[i], "up")

    def __exit__(self, *exc) -> None:
        for name in self.names:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except OSError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
