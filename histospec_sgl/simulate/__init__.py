"""``histospec-sgl simulate``, offline: whole RL rollout steps replayed from the logs under each step
policy on a measured step-cost profile (:mod:`.step`), and the command's runs and tables (:mod:`.run`)."""
