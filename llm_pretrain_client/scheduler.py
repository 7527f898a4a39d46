"""MindSpore's cluster scheduler process (MS_ROLE=MS_SCHED) for a supervised script's ranks: the daemon starts it
as `python -m llm_pretrain_client.scheduler` with the script's own interpreter and msrun's environment when the
script runs on more than one rank; it joins the cluster and returns when every worker has finished."""
from __future__ import annotations



def main() -> None:
    import mindspore as ms
    from mindspore import communication

    ms.set_device("CPU")          # the scheduler runs no kernels (as engine.rank.scheduler)
    communication.init()


if __name__ == "__main__":
    main()
