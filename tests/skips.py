"""What a test run skipped, and why, in one line: printed at the end of every pytest session, and for
`make test` (two sessions: the fast tiers, then e2e) once more for both, as its last line.

Each session appends its counts to $LLM_PRETRAIN_SKIP_LOG when that is set (JSON lines); `python -m
tests.skips FILE` prints the line for every session in FILE."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def reason(report) -> str:
    """A skipped test's reason, as pytest.skip or skipif gave it."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip()


def line(counts: Counter) -> str:
    total = sum(counts.values())
    if not total:
        return "llm-pretrain tests: nothing skipped"
    parts = [f"{n} × {why}" for why, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return f"llm-pretrain tests: {total} skipped: " + "; ".join(parts)


def record(path: str, counts: Counter) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(dict(counts)) + "\n")


def main(argv: list[str]) -> int:
    counts: Counter = Counter()
    path = Path(argv[0])
    if path.exists():
        for text in path.read_text().splitlines():
            counts.update(json.loads(text))
    print(line(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
