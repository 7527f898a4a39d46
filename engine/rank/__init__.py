"""One rank's process: bringing up MindSpore and its cluster, the trainer's loop, the supervisor's
commands and drills, events, the stop signal, the warm standby, the cluster scheduler process, and
the trainer's state as a checkpoint."""
