"""Where the model runs: how `[parallel]` maps onto MindSpore (mode, strategies, stages), the memory
model, `plan` (rules, fit, proposals) and its Ascend dry run. Pure: no MindSpore."""
