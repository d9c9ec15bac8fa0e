"""The settings this project's tests and scripts read (``HISTOSPEC_REQUIRE_SGLANG``,
``HISTOSPEC_SHARED``, ...): declared as the package declares its own (:class:`histospec_sgl.settings.
Setting`), but here, outside the wheel: the package never reads them. ``histospec_sgl.settings.
DEVELOPMENT`` lists their names only, so that an engine a test starts accepts them
(tests/unit/test_settings.py checks both lists agree, and that docs/settings.md shows :func:`table`).

Regenerate the docs' table with:
``PYTHONPATH=tests/helpers python -c "import dev_settings; print(dev_settings.table())"``
"""

from __future__ import annotations

from histospec_sgl.settings import Setting, _choice, _float, _int, _path, _text
from histospec_sgl.settings import table as _table

_DEV = "tests"

DEV_SETTINGS: tuple[Setting, ...] = (
    Setting("HISTOSPEC_REQUIRE_SGLANG", _DEV, _choice("0", "1"), "0",
            "1: tests that need the SGLang environment fail instead of skipping (scripts/test.sh sets it)"),
    Setting("HISTOSPEC_TEST_MEMORY_GB", _DEV, _float(1.0, 1e6), 16.0,
            "the memory the test workers share for servers they start (tests/helpers/_lanes.py)"),
    Setting("HISTOSPEC_TEST_MODEL", _DEV, _path, None, "the model a Ray cluster test's engines load"),
    Setting("HISTOSPEC_TEST_ACTOR", _DEV, _text, None, "set in a test actor's runtime env"),
    Setting("HISTOSPEC_TINY_MODEL", _DEV, _path, None, "tests/engine/test_gpu.py: the tiny model to run on a GPU"),
    Setting("HISTOSPEC_SHARED", _DEV, _path, None,
            "the folder beside the checkout that holds what the repository cannot ship (data/rollouts: the GRPO "
            "and expert-iteration logs; data/tokenizers/qwen3; trainers/slime; device); when set, the only "
            "one looked at (default ../shared)"),
    Setting("HISTOSPEC_REQUIRE_SHARED", _DEV, _choice("0", "1"), "0",
            "1: tests that read the shared folder fail when it is missing instead of skipping (.ci/run sets it)"),
    Setting("HISTOSPEC_SLIME_SRC", _DEV, _path, None, "slime's source for its tests (default ../shared/trainers/slime)"),
    Setting("HISTOSPEC_FUZZ_EXAMPLES", _DEV, _int(1), 150, "examples of the index's stateful property test"),
    Setting("HISTOSPEC_SGLANG_VERSION", _DEV, _text, "0.5.17", "the SGLang scripts/setup_sglang_env.sh installs"),
)

BY_NAME: dict[str, Setting] = {s.env: s for s in DEV_SETTINGS}


def table() -> str:
    """The development settings as docs/settings.md shows them."""
    return _table(settings=DEV_SETTINGS)
