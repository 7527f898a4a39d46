"""What the engine and the daemon share: the config schema, the protocol between a rank and its
supervisor (events, commands, exit codes), and the error types the command line reports.

Imports neither `engine` nor `daemon` (nor MindSpore): both sides import this package, never each
other, so a change of either side's internals cannot reach the other except through here.
"""
