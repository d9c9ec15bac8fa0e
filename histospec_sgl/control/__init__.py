"""Rollout control from history: response lengths predicted from a prompt's earlier responses and
its siblings (:mod:`.length`), step-cost profiles (:mod:`.profile`), the choice of verify width
that pays for itself (:mod:`.costmodel`), and a whole RL rollout step simulated offline
(:mod:`.simulate`, ``histospec-sgl simulate``)."""
