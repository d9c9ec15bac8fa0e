"""Test-only stand-in for SGLang's CUDA kernel package, so that ``sglang.srt.speculative.ngram_worker``
(and the HISTORY worker built on it) can be imported on a machine without a GPU. Only the name
``ngram_worker`` imports exists, and calling it fails: the tests drive the worker's host-side code."""
