"""llamagate's proxy: the only door to llama-server. Never imports ``supervisor``."""
