"""The RAM tier shared among a multi-node run's machines: what each holds, said in etcd; the step the decider
resumes from (daemon.machines.memory_agreement: the newest all members hold); and a step taken from a peer by a
machine that lacks it (daemon.machines.ram_peers serves and copies the files). Builds on
daemon.machines.membership; daemon.machines.nodes composes it with the rest.
"""
from __future__ import annotations

import time
from typing import Collection

from contracts.protocol import ExitCode
from daemon.acting.peers import PeersUnavailableError
from daemon.machines import memory_agreement, ram_peers
from daemon.machines.etcd_client import EtcdError
from daemon.machines.membership import POLL_S, Membership
from daemon.processes.run_files import RunFiles
from daemon.records.ledger import Ledger


class RamSharing:
    """This machine's RAM tier among its peers' (with checkpoint.memory_interval_steps; else it does nothing)."""

    def __init__(self, membership: Membership):
        self.m, self.cfg, self.clock, self.coord = membership, membership.cfg, membership.clock, membership.coord
        self.server: ram_peers.RamServer | None = None   # serves this machine's RAM tier to peers that lack a step
        self.files: RunFiles | None = None           # the run's files (set at start)
        self._taken: set[int] = set()                # RAM steps taken from a peer (memory_agreement counts them)
        self._asked: set[tuple[int, int]] = set()    # (step, generation) the decider asked this node to take

    def start(self, files: RunFiles) -> None:
        """Serves this machine's RAM tier (after the membership's start: the run's id); a follower that waits
        takes what the decider asks it to (`serve_take`)."""
        if not files.memory_tier:
            return
        self.files = files
        try:
            self.server = ram_peers.RamServer(files.memory_root, self.m.run_id, self.coord.addr).start()
        except OSError as e:
            raise PeersUnavailableError(f"cannot serve the RAM tier to peers on {self.coord.addr}: "
                                        f"{e.strerror or e}", ExitCode.CANT_CREATE) from e
        self.m.while_waiting = self.serve_take

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def say_held(self, ledger: Ledger, files: RunFiles) -> None:
        """This machine's RAM-tier steps, said once its ranks are gone (between generations; a lost etcd write
        only makes the decider wait for it, then count this machine's RAM as empty)."""
        if files.memory_tier:
            self._publish_held(ledger, files)

    def _publish_held(self, ledger: Ledger, files: RunFiles, **more) -> None:
        """A daemon that joined since generation `joined_at` began has run no rank of it: its record is of that
        one. What it took from a peer is said as such (memory_agreement: a machine back counts those only)."""
        steps = files.memory_steps()
        try:
            self.coord.publish_held(memory_agreement.record(
                max(ledger.state.generation, self.m.joined_at or 0), steps, url=self.server.url if self.server
                else "", taken=sorted(self._taken & set(steps)), **more))
        except EtcdError:
            pass

    def agreed(self, ledger: Ledger, files: RunFiles, stopping,
               members: Collection[int] | None = None) -> tuple[int, ...] | None:
        """The decider: the RAM-tier steps every one of `members` (None: the last generation's that are live)
        holds (daemon.machines.memory_agreement), once each has said so since its ranks of the last generation
        (etcd's stored one) were gone, and once those that lacked the newest step some hold have taken it from
        them (asked through etcd; this daemon takes it itself). Waited for up to run.kill_grace_s (their
        teardown) and a lease TTL more — and checkpoint.peer_fetch_timeout_s while a step is being taken — then
        those not heard count as holding none (the disk's step, said). None: the run keeps no RAM tier."""
        if not files.memory_tier:
            return None
        last = self.coord.generation() or {}
        number, last_members = int(last.get("number") or 0), tuple(last.get("members") or ())
        if members is None:
            members = (set(self.m.live()) & set(last_members)) | {self.coord.node}
        began, asked = self.clock(), set()
        while True:
            got = memory_agreement.agree(members, self.coord.held(), last_generation=number, last_members=last_members,
                                         own=self.coord.node, own_steps=files.memory_steps(),
                                         disk_step=files.committed_step())
            if got.heard and got.take is None:
                return got.steps
            if got.take is not None and self.coord.node in got.lacking and (self.coord.node, got.take) not in asked:
                asked.add((self.coord.node, got.take))           # this daemon lacks it too: taken here, once
                self._take(ledger, files, got.take, list(got.sources))
                continue
            for node in got.lacking:                     # each asked once; it says what it holds after
                if (node, got.take) not in asked and node != self.coord.node:
                    asked.add((node, got.take))
                    self._ask_take(node, {"generation": number, "step": got.take, "urls": list(got.sources)})
            deadline = began + self.cfg.run.kill_grace_s + self.coord.ttl_s + (
                self.cfg.checkpoint.peer_fetch_timeout_s if got.fetching or asked else 0.0)
            if stopping():                              # the run stops: no generation follows
                return got.steps if got.heard else ()
            if self.clock() >= deadline:
                missing = got.unheard or got.lacking
                ledger.emit("memory_steps_unheard", level="warning", nodes=list(missing), detail=(
                    f"nodes {list(missing)} did not say which RAM-tier checkpoints they hold" if got.unheard else
                    f"nodes {list(missing)} did not take step {got.take} from a peer in time") +
                    ": the run resumes from the newest step every machine holds, or the disk's")
                return got.steps if got.heard else ()
            self.m.check_coordinator(self.clock())
            ledger.tick()
            time.sleep(POLL_S)

    def _ask_take(self, node: int, request: dict) -> None:
        try:
            self.coord.ask_take(node, request)
        except EtcdError:
            pass                                          # the wait runs out: the disk's step

    def serve_take(self, ledger: Ledger) -> None:
        """A node that does not decide, while it waits: the decider asked it to take a step from a peer (its RAM
        tier lacks the step the run resumes from); taken once per ask."""
        files, request = self.files, self.coord.asked_to_take()
        if files is None or not isinstance(request, dict) or "step" not in request:
            return
        last = self.coord.generation() or {}
        key = (int(request["step"]), int(request.get("generation") or 0))
        if key[1] != int(last.get("number") or 0) or key in self._asked:
            return
        self._asked.add(key)
        self._take(ledger, files, key[0], [str(u) for u in request.get("urls") or ()])

    def _take(self, ledger: Ledger, files: RunFiles, step: int, urls: list[str]) -> None:
        """Step `step` copied from the first peer of `urls` that serves it whole (daemon.machines.ram_peers), said
        in the etcd record (fetching, then taken or failed) and in one event either way."""
        root = files.memory_root()
        started, failures = self.clock(), []
        self._publish_held(ledger, files, fetching=step)
        for url in urls[:2] if root is not None else ():   # a transfer that breaks: once more, from another peer
            try:
                copied = ram_peers.fetch(url, self.m.run_id, step, root,
                                         deadline_s=started + self.cfg.checkpoint.peer_fetch_timeout_s - self.clock(),
                                         tick=ledger.tick)
            except ram_peers.FetchError as e:
                failures.append(str(e))
                continue
            self._taken.add(step)
            self._publish_held(ledger, files)
            ledger.emit("ram_taken_from_peer", step=step, peer=url, bytes=copied,
                        seconds=round(self.clock() - started, 3),
                        detail=f"this machine's RAM tier lacked step {step}, the run's newest: copied from {url}")
            return
        self._publish_held(ledger, files, failed=step)
        ledger.emit("ram_take_failed", level="warning", step=step, peers=urls[:2], detail=(
            f"step {step} could not be taken from a peer ({'; '.join(failures) or 'no RAM tier here'}): the run "
            "resumes from the newest step every machine holds, or the disk's"))
