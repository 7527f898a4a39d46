"""The training engine that runs inside each worker process.

Only the modules that build and run the MindSpore graph import MindSpore
(model, optim, loss_scale, step, runtime, worker); this package's __init__
and `engine.config` never do, so the supervisor can load configs without it.
"""
