"""MindSpore's cluster scheduler process (MS_ROLE=MS_SCHED): joins the cluster and waits it out.

Run as `python -m engine.rank.scheduler` with the dynamic-cluster environment; it
returns when every worker has finished. A late standby's scheduler (daemon/standby.py: several
machines) imports MindSpore, then waits for the generation's environment on its pipe.
"""
from __future__ import annotations

import os

import mindspore as ms
from mindspore import communication

from contracts.protocol import ENV_STANDBY_FD, await_activation, take_environment


def main() -> None:
    if os.environ.get(ENV_STANDBY_FD):
        spawned = set(os.environ)
        env = await_activation(int(os.environ[ENV_STANDBY_FD]))
        if env is None:             # retired
            os._exit(0)
        take_environment(env, spawned)
    ms.set_device("CPU")
    communication.init()


if __name__ == "__main__":
    main()
