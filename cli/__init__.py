"""The `llm-pretrain` command line: the front door of the whole product (run, train, prepare-data,
export, plan, status, the control commands…).

It is the one package that imports both `daemon` and `engine`. Subcommands that need MindSpore or
the engine's internals import them inside the subcommand, so `run`, `status` and the control
commands start fast and never load MindSpore.
"""
