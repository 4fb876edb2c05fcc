"""The capacity model's arithmetic: the memory a child needs (weights, KV state per slot, runtime) from the
GGUF header, against what the host or its cgroup limit leaves, checked before anything launches."""
