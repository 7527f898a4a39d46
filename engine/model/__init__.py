"""The network and its kernels: the LLaMA-family causal LM (its parameter names and layouts), the
fused CPU kernels it uses where g++ is found, and the application of a layout's shard strategies to
its cells."""
