"""Benchmarks behind ``histospec-sgl bench ...`` (the index, and later sync and SPEC-RL)."""
