"""Triton kernels over flat parameter/gradient buffers (imported as ``fxpipe.kernels``)."""
