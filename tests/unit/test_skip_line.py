"""`make test` ends with one line saying what was skipped and why, summed over its two sessions."""
from collections import Counter

from tests import skips


def test_the_line_counts_each_reason_most_frequent_first(tmp_path):
    log = tmp_path / "skipped.jsonl"
    skips.record(str(log), Counter({"needs root: network namespaces": 4}))
    skips.record(str(log), Counter({"needs root: network namespaces": 2, "systemd-analyze not installed": 3}))
    skips.record(str(log), Counter())
    counts = Counter()
    for text in log.read_text().splitlines():
        counts.update(__import__("json").loads(text))
    assert skips.line(counts) == ("llm-pretrain tests: 9 skipped: 6 × needs root: network namespaces; "
                                  "3 × systemd-analyze not installed")


def test_nothing_skipped_says_so(tmp_path, capsys):
    assert skips.main([str(tmp_path / "absent.jsonl")]) == 0
    assert capsys.readouterr().out == "llm-pretrain tests: nothing skipped\n"
