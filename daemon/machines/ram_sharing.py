"""The RAM tier shared among a multi-node run's machines: what each holds, said in etcd; the step the decider
resumes from (daemon.machines.memory_agreement: the newest all members hold); and a step taken from a peer by a
machine that lacks it (daemon.machines.ram_peers serves and copies the files). Builds on
daemon.machines.membership; daemon.machines.nodes composes it with the rest.
"""
from __future__ import annotations

import time
from typing import Collection

from checkpointing import CheckpointError, layout, parts, reader
from contracts.config import failure_domains
from contracts.protocol import ExitCode
from daemon.acting.peers import Opened, PeersUnavailableError
from daemon.machines import memory_agreement, ram_parts, ram_peers
from daemon.machines.buddy_copies import BuddyCopies
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
        self.buddy = membership.cfg.checkpoint.memory_placement == "buddy"
        self.copies: BuddyCopies | None = None        # this generation's copies of buddies' parts (buddy placement)

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
        self.stop_copies(None)
        if self.server is not None:
            self.server.close()

    def start_copies(self, files: RunFiles, opened: Opened) -> None:
        """Buddy placement: this generation's copies of the parts of the members this machine is the buddy of
        (daemon.machines.buddy_copies), while its ranks train."""
        files.buddy_kept = frozenset()               # the last generation's copies are retired as any step now
        if self.buddy:                               # what this machine's ranks write over when retired
            files.own_shards = frozenset(layout.shard_name(r, opened.cfg.parallel.world_size) for r in opened.ranks)
        members = opened.members
        root = files.memory_root()
        if not (self.buddy and files.memory_tier and root is not None and len(members) > 1):
            return

        def kept(steps: frozenset[int]) -> None:
            files.buddy_kept = steps

        self.copies = BuddyCopies(root=root, run_id=self.m.run_id, node=self.coord.node, members=members,
                                  domains=failure_domains(self.cfg.run.failure_domains), on_kept=kept,
                                  urls=lambda: {n: str(v.get("url") or "") for n, v in self.coord.held().items()
                                                if isinstance(v, dict)}).start()

    def stop_copies(self, ledger: Ledger | None) -> None:
        """The generation's ranks are gone: its copies stop, said in one event."""
        copies, self.copies = self.copies, None
        if copies is None:
            return
        copies.stop()
        if ledger is not None and copies.peers:
            ledger.emit("buddy_copies", level="warning" if copies.failures and not copies.count else "info",
                        peers=copies.peers, copies=copies.count, newest=copies.newest(),
                        failed=copies.failures, detail=(
                            f"this machine kept {copies.count} copies of node(s) {copies.peers}'s RAM-tier parts "
                            f"this generation, the newest of step {copies.newest()}"
                            + (f"; {copies.failures} passed over ({copies.last_error})" if copies.failures else "")))

    def say_held(self, ledger: Ledger, files: RunFiles) -> None:
        """This machine's RAM-tier steps, said once its ranks are gone (between generations; a lost etcd write
        only makes the decider wait for it, then count this machine's RAM as empty)."""
        self.stop_copies(ledger)
        if files.memory_tier:
            self._publish_held(ledger, files)

    def holdings(self, files: RunFiles) -> tuple[list[int], dict[int, tuple[frozenset[int], int]]]:
        """The RAM tier's steps this machine holds whole, and (buddy placement) those it holds parts of:
        {step: (slots, of how many)}, from their manifests (checkpointing.parts)."""
        steps = files.memory_steps()
        root = files.memory_root()
        if not self.buddy or root is None:
            return steps, {}
        whole, in_parts = [], {}
        for step in steps:
            try:
                manifest = reader.read_manifest(layout.step_dir(root, step))
            except (CheckpointError, OSError):
                continue
            if parts.is_whole(manifest):
                whole.append(step)
            else:
                in_parts[step] = parts.slots(manifest)
        return whole, in_parts

    def _publish_held(self, ledger: Ledger, files: RunFiles, **more) -> None:
        """A daemon that joined since generation `joined_at` began has run no rank of it: its record is of that
        one. What it took from a peer is said as such (memory_agreement: a machine back counts those only)."""
        steps, in_parts = self.holdings(files)
        try:
            self.coord.publish_held(memory_agreement.record(
                max(ledger.state.generation, self.m.joined_at or 0), steps, url=self.server.url if self.server
                else "", taken=sorted(self._taken & set(steps)), parts=in_parts, **more))
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
            whole, in_parts = self.holdings(files)
            got = memory_agreement.agree(members, self.coord.held(), last_generation=number, last_members=last_members,
                                         own=self.coord.node, own_steps=whole, own_parts=in_parts,
                                         disk_step=files.committed_step())
            if got.heard and got.take is None:
                return got.steps
            for node in got.lacking:                     # each asked once; it says what it holds after
                if (node, got.take) not in asked and node != self.coord.node:
                    asked.add((node, got.take))
                    self._ask_take(node, {"generation": number, "step": got.take, "urls": list(got.sources)})
            if got.take is not None and self.coord.node in got.lacking and (self.coord.node, got.take) not in asked:
                asked.add((self.coord.node, got.take))           # this daemon lacks it too: taken here, once, while
                self._take(ledger, files, got.take, list(got.sources))     # the others take theirs
                continue
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
        """Step `step` made whole here from the peers at `urls` (daemon.machines.ram_parts.take: a whole copy from
        one, or the parts this machine lacks from those that hold them), said in the etcd record (fetching, then
        taken or failed) and in one event either way."""
        root = files.memory_root()
        started = self.clock()
        urls = [u for u in urls if not self.server or u != self.server.url]
        # what this machine holds of the step is the run's only where it ran the last generation (memory_agreement)
        trust_own = self.coord.node in ((self.coord.generation() or {}).get("members") or ())
        self._publish_held(ledger, files, fetching=step)
        error = "no RAM tier here"
        for attempt in (1, 2) if root is not None else ():     # a transfer that breaks: once more
            try:
                copied, given = ram_parts.take(urls, self.m.run_id, step, root, tick=ledger.tick, trust_own=trust_own,
                                               deadline_s=started + self.cfg.checkpoint.peer_fetch_timeout_s
                                               - self.clock())
            except ram_peers.FetchError as e:
                error = str(e)
                continue
            self._taken.add(step)
            self._publish_held(ledger, files)
            ledger.emit("ram_taken_from_peer", step=step, peer=given[0] if given else "", peers=given, bytes=copied,
                        seconds=round(self.clock() - started, 3), detail=(
                            f"this machine's RAM tier lacked step {step}, the run's newest"
                            + (" whole" if self.buddy else "") + f": copied from {', '.join(given) or 'itself'}"))
            return
        self._publish_held(ledger, files, failed=step)
        ledger.emit("ram_take_failed", level="warning", step=step, peers=urls, detail=(
            f"step {step} could not be taken from a peer ({error}): the run "
            "resumes from the newest step every machine holds, or the disk's"))
