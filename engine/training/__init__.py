"""One optimizer step: the compiled step (data parallel, and semi-auto parallel on Ascend), AdamW,
dynamic loss scaling, the learning-rate schedule, and the shared-memory gradient sum of local ranks."""
