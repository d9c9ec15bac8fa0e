"""Trainer and Ray integrations: slime, verl, OpenRLHF, and the draft server as a Ray actor.

This package is the only part of histospec-sgl that imports a trainer or Ray, and nothing imports
it eagerly: each module imports its trainer inside the functions that need it, so that
``import histospec_sgl`` stays free of them.

- :mod:`~histospec_sgl.integrations.ray_setup`: a Ray ``worker_process_setup_hook`` that loads
  SGLang's plugins in every worker, so ``--speculative-algorithm HISTORY`` resolves inside engine
  actors that build SGLang's ``ServerArgs`` themselves (slime, verl).
- :mod:`~histospec_sgl.integrations.ray_draft_server`: the draft server as a detached, named Ray
  actor on the head node (``histospec-sgl ray draft-server``).
- :mod:`~histospec_sgl.integrations.verl`: the ``verl.plugins`` entry point (registers HISTORY in
  every process that imports verl).
"""
