"""What is served and the proof of it: the pinned lock to a verified binary, a model file to its sha256."""
