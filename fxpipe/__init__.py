"""fxpipe: pipeline-parallel training for ordinary PyTorch models."""
