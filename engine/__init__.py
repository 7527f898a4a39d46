"""The training engine that runs inside each rank, in rooms:

    model/      the network and its kernels
    training/   the step, the optimizer, loss scaling, the lr schedule
    data/       tokenizers, prepare-data, the corpus, the sample order, the feed
    layout/     the parallel layout, the memory model, plan (pure)
    interop/    Hugging Face and mindformers, in and out
    rank/       a rank's process: runtime, the trainer's loop, commands, events, checkpoints

Imports `contracts` and `checkpointing`, never `daemon`. Only the modules that build and run the
MindSpore graph import MindSpore; this package's __init__ and the pure rooms (data's order,
layout) never do.
"""
