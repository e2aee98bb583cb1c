"""The control plane: which backends exist, whether they are healthy, what they serve and hold."""
