"""Data: tokenizers, `prepare-data` (text to a tokenized corpus), the corpus format and its block
checksums, the order of samples (pure), and the feed that prepares each step's batches ahead.
No module here but `feed` imports MindSpore."""
