"""What runs inside the SGLang engine, written without SGLang: the batch drafter the HISTORY worker
calls every decode step (:mod:`.drafter`), its settings (:mod:`.config`), the cost model that picks
each step's verify width (:mod:`.costmodel`) from step-cost profiles (:mod:`.profile`), and a draft
tree in SGLang's layout (:mod:`.draft`). :mod:`histospec_sgl.plugin` adapts SGLang to it; offline
code (the replay, ``simulate``, the benchmarks) imports it, never the other way round."""
