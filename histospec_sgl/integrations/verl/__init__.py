"""verl's plugin entry point (``[project.entry-points."verl.plugins"] histospec``).

verl imports every ``verl.plugins`` entry point when ``verl`` is imported, in every process (unless
``VERL_USE_EXTERNAL_PLUGINS=none``), and its SGLang server actor imports verl before it builds
SGLang's ``ServerArgs``. Importing this package registers ``--speculative-algorithm HISTORY`` with
SGLang there, so the override ::

    +actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_algorithm=HISTORY

works with no other change. Without SGLang (a trainer-only process) it does nothing. It never raises:
verl logs entry-point errors only at debug level, so a failure is logged here as a warning.

An unsupported verl release is logged as an error here (raising would break verl itself); the
SPEC-RL agent loop and the router refuse to import under one.

It also puts HISTORY's acceptance into verl's metrics (``rollout/spec_accept_rate``,
``rollout/spec_accept_length``): :mod:`histospec_sgl.integrations.verl.metrics`, applied when verl's
SGLang server module is first imported.

The SPEC-RL agent loop and the prompt-affinity router live in submodules that import verl.
"""

from __future__ import annotations

from histospec_sgl.integrations.ray_setup import setup as _setup
from histospec_sgl.integrations.verl.metrics import install as _install_metrics
from histospec_sgl.integrations.versions import warn as _warn

SUPPORTED_VERSION = _warn("verl")
REGISTERED = _setup()
METRICS = _install_metrics()
