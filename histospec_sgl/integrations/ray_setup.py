"""A Ray ``worker_process_setup_hook`` that makes ``--speculative-algorithm HISTORY`` resolve inside
Ray actors.

slime and verl build SGLang's ``ServerArgs`` inside their engine actors. SGLang loads its plugins
(and with them HISTORY) only when its own launcher or ``Engine`` starts, which is after
``ServerArgs`` has checked the algorithm name, so there the name is unknown ("Unknown speculative
algorithm name: HISTORY"). Ray runs this hook in every worker process of the job before any task or
actor method, so SGLang's plugins are loaded in time::

    ray job submit --runtime-env-json '{"worker_process_setup_hook":
        "histospec_sgl.integrations.ray_setup.setup", "env_vars": {...}}' -- python train.py ...

It also installs the lookup of ``HISTOSPEC_DRAFT_SERVER_ACTOR``
(:func:`~histospec_sgl.integrations.ray_draft_server.resolve_env`: the draft server's address, token
and CA), which runs when HISTORY's server arguments are checked and when a trainer's SPEC-RL options
are read, in processes without SGLang too.

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
        from histospec_sgl import settings
        from histospec_sgl.integrations.ray_draft_server import resolve_env

        if resolve_env not in settings.RESOLVERS:
            # HISTOSPEC_DRAFT_SERVER_ACTOR (address, token, CA) is looked up when an engine's server
            # args are checked or a trainer's SPEC-RL options are read, not here (calling an actor
            # from a setup hook crashes the worker); trainer processes without SGLang need it too.
            settings.RESOLVERS.append(resolve_env)
    except Exception:
        logger.exception("histospec: the draft-server actor lookup could not be installed in this worker")
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
        return True
    except BaseException:  # register() exits the process on a failed registration it was asked for
        logger.exception("histospec: --speculative-algorithm HISTORY could not be registered in this worker")
        return False
