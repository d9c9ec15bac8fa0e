"""Benchmark-only model classes for ``histospec-sgl bench engine --trace`` (never in the wheel; see
:mod:`histospec_trace_models.llama_trace`). SGLang imports every module of this package when
``SGLANG_EXTERNAL_MODEL_PACKAGE=histospec_trace_models`` and this folder is on ``PYTHONPATH``."""
