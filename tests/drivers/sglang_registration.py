"""The plugin's registration as SGLang's processes meet it; run in .venv-sglang by
tests/engine/test_plugin.py, one case per argument. Prints RESULT lines the test reads."""

import sys


def idempotent() -> None:
    # Registering twice is harmless, and cheap: nothing heavy is imported.
    import histospec_sgl.plugin as p
    p.register()
    p.register()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    assert type(SpeculativeAlgorithm.from_string("HISTORY")).__name__ == "HistoryAlgo"
    heavy = [m for m in ("histospec_sgl._core", "histospec_sgl.plugin.worker",
                         "sglang.srt.speculative.ngram_worker", "histospec_sgl.engine.drafter") if m in sys.modules]
    print("RESULT", heavy)


def broken_install() -> None:
    # A registration that fails inside SGLang's loader (which only logs plugin errors) must stop a
    # process that asked for HISTORY.
    import histospec_sgl.plugin.registration as c

    def boom() -> None:
        raise ImportError("simulated broken install")

    c.register_history = boom
    sys.argv = ["sglang.launch_server", "--speculative-algorithm", "HISTORY"]
    from sglang.srt.plugins import load_plugins
    load_plugins()
    print("NOT REACHED")


def no_worker() -> None:
    # The worker needs SGLang's NGRAM worker (a CUDA sgl_kernel): without it the factory says so.
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    class SA:
        disable_overlap_schedule = False

    try:
        SpeculativeAlgorithm.from_string("HISTORY").create_worker(SA())
    except RuntimeError as e:
        print("RESULT", e)


def old_sglang() -> None:
    # verl's own [sglang] extra installs 0.5.12, below the supported floor: the launch stops and names
    # the version found and the range.
    from histospec_sgl.plugin import compat

    compat.sglang_version = lambda: (0, 5, 12)
    sys.argv = ["sglang.launch_server", "--speculative-algorithm", "HISTORY"]
    from sglang.srt.plugins import load_plugins
    load_plugins()
    print("NOT REACHED")


{"idempotent": idempotent, "broken-install": broken_install, "no-worker": no_worker,
 "old-sglang": old_sglang}[sys.argv[1]]()
