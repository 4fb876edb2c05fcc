"""The llama-server command line: every flag the supervisor passes or refuses, and the chat template names."""
