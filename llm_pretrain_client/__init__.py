"""What a training script of the user's own imports to be supervised by the llm-pretrain daemon
(docs/bring-your-own-script.md): its steps, checkpoints and commands spoken in the daemon's protocol
(contracts.protocol), so the daemon restarts, reruns, rolls back, pauses and stops it as it does the engine's ranks.

    client = Client(global_batch=8, seq_len=128)          # reads what the daemon handed this rank
    client.restore(train_net.trainable_params() + optimizer.parameters)   # the newest checkpoint, if any
    ...                                                   # a custom loop:
    while client.training:
        plan = client.begin_step()                        # the step's drills (plan.poison, plan.corrupt)
        loss = train_step(...)
        client.end_step(loss, grad_norm=norm)             # events, commands, saves; False: stop now
    client.finish()

or, under `Model.train` (MindFormers' trainer), the callback `Supervisor(client)`. Imports MindSpore, numpy and
this project's `contracts`, `checkpointing` and `durable` only — never the daemon or the engine — and installs
alone into the script's environment (`pip install <repo>/client`). Outside the daemon it stays out of the way:
no events, no commands, no checkpoints.
"""
from llm_pretrain_client.client import Client, StepPlan
from llm_pretrain_client.data_plan import SupervisedSource

__all__ = ["Client", "StepPlan", "SupervisedSource", "Supervisor", "LrMultiplier"]


def __getattr__(name: str):
    """The MindSpore-bound parts load on first use: `Client` alone imports no MindSpore until it saves."""
    if name == "Supervisor":
        from llm_pretrain_client.callback import Supervisor
        return Supervisor
    if name == "LrMultiplier":
        from llm_pretrain_client.lr_multiplier import LrMultiplier
        return LrMultiplier
    raise AttributeError(name)
