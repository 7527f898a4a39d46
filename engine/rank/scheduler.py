"""MindSpore's cluster scheduler process (MS_ROLE=MS_SCHED): joins the cluster and waits it out;
or, for CPU ranks summing over TCP across machines (ENV_GROUP_HUB), the group's gradient hub
(engine/training/hub_reduce.py), which imports no MindSpore.

Run as `python -m engine.rank.scheduler` with the dynamic-cluster environment; it
returns when every worker has finished. A late standby's scheduler (daemon/processes/standby.py: several
machines) imports MindSpore, then waits for the generation's environment on its pipe.
"""
from __future__ import annotations

import os

from contracts.protocol import (
    ENV_GROUP_HUB,
    ENV_LOCAL_GROUP,
    ENV_LOCAL_WORLD,
    ENV_STANDBY_FD,
    await_activation,
    take_environment,
)


def main() -> None:
    if os.environ.get(ENV_GROUP_HUB):
        from engine.training import hub_reduce

        host, port = hub_reduce.parse_address(os.environ[ENV_GROUP_HUB])
        hub_reduce.serve((host, port), world=int(os.environ[ENV_LOCAL_WORLD]), token=os.environ[ENV_LOCAL_GROUP])
        return
    if os.environ.get(ENV_STANDBY_FD):
        from engine.rank import idle_cpu

        with idle_cpu.only():            # a standby's import on the CPU the training leaves idle
            import mindspore  # noqa: F401
    import mindspore as ms
    from mindspore import communication

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
