"""What runs inside the SGLang engine, written without SGLang: the batch drafter the HISTORY worker
calls every decode step (:mod:`.drafter`), its settings (:mod:`.config`), each decode step's plan
(:func:`plan_step`, :mod:`.plan`: the one place a step's width and shadow drafts are decided, for the
drafter and the simulator alike), the step policies it asks (:mod:`.policy`, :mod:`.costmodel`),
what they learn from (:mod:`.feedback`), and a draft tree in SGLang's layout (:mod:`.draft`).
:mod:`histospec_sgl.plugin` adapts SGLang to it; offline code (the replay, ``simulate``, the
benchmarks) imports it, never the other way round."""

from histospec_sgl.engine.plan import StepCounts, StepPlan, plan_step

__all__ = ["StepCounts", "StepPlan", "plan_step"]
