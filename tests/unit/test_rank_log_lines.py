"""A rank's log lines stay whole when other processes write the same log (engine/contracts/event_sink.py).

print() hands a stream a line and then its newline; unbuffered (PYTHONUNBUFFERED, as on the CI machine)
each is its own write, and a generation's rank being torn down while the next one's rank writes the same
log put a line of the new rank between a step event and its newline: the log then held two JSON objects
on one line (tests/e2e/test_recovery_e2e.py failed to parse it)."""
from __future__ import annotations

import io
import json
import os
import threading

import pytest

from contracts.event_sink import TolerantStream

pytestmark = pytest.mark.unit


def _unbuffered_append(path) -> io.TextIOWrapper:
    """What a rank's stdout is under PYTHONUNBUFFERED: every write a system call, on an O_APPEND file."""
    raw = io.FileIO(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), "w")
    return io.TextIOWrapper(raw, write_through=True)


def test_a_line_and_its_newline_reach_the_log_together_between_another_processs_lines(tmp_path):
    log = tmp_path / "rank-0.log"
    old_rank, new_rank = TolerantStream(_unbuffered_append(log)), TolerantStream(_unbuffered_append(log))
    old_rank.write(json.dumps({"kind": "step", "step": 206}))      # print(): the line ...
    new_rank.write("llm-pretrain: rerun of steps 200-202\n")       # another process's whole line
    old_rank.write("\n")                                          # ... then its newline
    lines = log.read_text().splitlines()
    assert lines == ["llm-pretrain: rerun of steps 200-202", '{"kind": "step", "step": 206}']


def test_print_goes_through_as_whole_lines_and_a_flush_writes_an_unfinished_one(tmp_path):
    log = tmp_path / "rank-0.log"
    out = TolerantStream(_unbuffered_append(log))
    print("a", "b", file=out)
    out.write("no newline yet")
    assert log.read_text() == "a b\n"
    out.flush()
    assert log.read_text() == "a b\nno newline yet"


def test_one_threads_unfinished_line_does_not_take_in_anothers(tmp_path):
    log = tmp_path / "rank-0.log"
    out = TolerantStream(_unbuffered_append(log))
    started, go_on = threading.Event(), threading.Event()

    def writer():
        out.write("from the writer thread")
        started.set()
        go_on.wait(10)
        out.write("\n")

    thread = threading.Thread(target=writer)
    thread.start()
    started.wait(10)
    print("from the main thread", file=out)
    go_on.set()
    thread.join(10)
    assert log.read_text().splitlines() == ["from the main thread", "from the writer thread"]


def test_a_full_disk_under_the_log_never_raises():
    out = TolerantStream(io.TextIOWrapper(io.FileIO("/dev/full", "w"), write_through=True))
    print("lost, and the rank goes on", file=out)
    out.write("unfinished")
    out.flush()
