"""A Ray ``worker_process_setup_hook`` that makes ``--speculative-algorithm HISTORY`` resolve inside
Ray actors.

slime and verl build SGLang's ``ServerArgs`` inside their engine actors. SGLang loads its plugins
(and with them HISTORY) only when its own launcher or ``Engine`` starts, which is after
``ServerArgs`` has checked the algorithm name, so there the name is unknown ("Unknown speculative
algorithm name: HISTORY"). Ray runs this hook in every worker process of the job before any task or
actor method, so SGLang's plugins are loaded in time::

    ray job submit --runtime-env-json '{"worker_process_setup_hook":
        "histospec_sgl.integrations.ray_setup.setup", "env_vars": {...}}' -- python train.py ...

It also hands the plugin the lookup of ``HISTOSPEC_DRAFT_SERVER_ACTOR``
(:func:`~histospec_sgl.integrations.ray_draft_server.resolve_env`), which runs when HISTORY's server
arguments are checked.

The hook never raises (Ray would turn an exception into a failed worker): without SGLang, or when
its plugin loader fails, it logs why and returns. It does only local work; creating or calling Ray
actors from a setup hook crashes the worker.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger("histospec_sgl.integrations")


def setup() -> bool:
    """Loads SGLang's plugins in this process (HISTORY among them). Returns whether HISTORY is
    registered afterwards; never raises."""
    try:
        if importlib.util.find_spec("sglang") is None:
            return False
    except (ImportError, ValueError):
        return False
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    except Exception:
        logger.warning("histospec: SGLang's plugin loader failed; registering HISTORY directly", exc_info=True)
    try:
        from histospec_sgl.plugin import register

        register()
        from histospec_sgl.integrations.ray_draft_server import resolve_env
        from histospec_sgl.plugin.registration import ENV_RESOLVERS

        if resolve_env not in ENV_RESOLVERS:
            # HISTOSPEC_DRAFT_SERVER_ACTOR is looked up when HISTORY's server args are checked, not
            # here (calling an actor from a setup hook crashes the worker).
            ENV_RESOLVERS.append(resolve_env)
        return True
    except BaseException:  # register() exits the process on a failed registration it was asked for
        logger.exception("histospec: --speculative-algorithm HISTORY could not be registered in this worker")
        return False
