"""MindSpore's cluster scheduler process (MS_ROLE=MS_SCHED): joins the cluster and waits it out.

Run as `python -m engine.rank.scheduler` with the dynamic-cluster environment; it
returns when every worker has finished.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import communication


def main() -> None:
    ms.set_device("CPU")
    communication.init()


if __name__ == "__main__":
    main()
