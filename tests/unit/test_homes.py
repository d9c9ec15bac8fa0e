"""docs/architecture.md's "where each concept lives", checked where the source can show it: each
concept is defined in its one place, and its users call it there instead of deciding it again."""

from __future__ import annotations

import ast
from pathlib import Path

import histospec_sgl
import histospec_sgl.engine

PKG = Path(histospec_sgl.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PKG)): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def _defined(name: str) -> list[str]:
    return [path for path, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name]


def _calls(tree: ast.Module, name: str) -> int:
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
               and (getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name))


def test_a_decode_steps_plan_is_decided_in_one_place():
    assert _defined("plan_step") == ["engine/plan.py"]
    assert histospec_sgl.engine.plan_step.__module__ == "histospec_sgl.engine.plan"
    mods = _modules()
    for user in ("engine/drafter.py", "simulate/step.py"):
        assert _calls(mods[user], "plan_step") == 1, user
        # Neither asks the policy for a width or a shadow width itself.
        assert _calls(mods[user], "choose") == 0 and _calls(mods[user], "shadow_width") == 0, user
    assert _defined("StepCounts") == ["engine/plan.py"]


def test_a_finished_request_and_a_steps_draft_have_one_home():
    """What a finished request does is decided by ``BatchDrafter.complete``: the worker, the replay and
    the scale benchmark call it, and none of them finishes a request itself (the replay's draft-server
    mode hands ``add_finished`` over as the publisher). A step's draft is one ``StepDraft``."""
    assert _defined("complete") == ["engine/drafter.py"] and _defined("StepDraft") == ["engine/drafter.py"]
    mods = _modules()
    for user in ("plugin/worker.py", "replay/methods.py", "bench/scale_bench.py"):
        assert _calls(mods[user], "complete") == 1 and _calls(mods[user], "finish") == 0, user
    for user in ("plugin/worker.py", "bench/scale_bench.py"):  # the replay adds its history with it
        assert _calls(mods[user], "add_finished") == 0, user


def test_the_advance_rule_is_written_once():
    """A verify step emits its accepted tokens and one more, never past the end: ``engine/draft.py``
    ``advance``, which the replay loop, the benchmarks' loops and the simulator call, none writing it
    again (no ``acc + 1`` anywhere else in the package)."""
    mods = _modules()
    assert [path for path, tree in mods.items() for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name == "advance"] == ["engine/draft.py"]
    for user in ("replay/measure.py", "bench/index_bench.py", "bench/scale_bench.py", "simulate/step.py"):
        assert _calls(mods[user], "advance") >= 1, user
    again = [p.relative_to(PKG) for p in PKG.rglob("*.py") if p.name != "draft.py" and "acc + 1" in p.read_text()]
    assert again == []
    # How SGLang's worker inserts a response into its trie, for the replay's trie peers and bench
    # index's: once.
    assert _defined("inserted") == ["replay/peers.py"]
    assert _calls(mods["replay/peers.py"], "inserted") == 2 and _calls(mods["bench/index_peers.py"], "inserted") == 1


def test_the_peers_are_one_set_of_adapters_driven_by_the_replays_loop():
    """``bench index`` times and scores its peers through the replay's loop and the replay's adapters:
    its own module builds their stores and calls none of their drafting or updating calls itself."""
    mods = _modules()
    bench = mods["bench/index_peers.py"]
    assert _calls(bench, "replay") == 3  # acceptance (chains, trees) and timing
    # (Building SGLang's trie puts its history in with ``batch_put`` and waits: ``synchronize``.)
    for call in ("batch_get", "speculate", "speculate_ndarray", "extend", "draft", "draft_batch"):
        assert _calls(bench, call) == 0, call
    assert _defined("PerPrompt") == ["replay/peers.py"]
    for adapter in ("SGLangNgram", "PerPrompt"):
        assert _defined(adapter) == ["replay/peers.py"], adapter


def test_callers_use_the_step_policy_as_it_is():
    """No class checks of a step policy and no probing for its attributes outside the policies' own
    module: what the worker, the metrics, the feedback and the simulator need is on the protocol."""
    policies = {"EngineControl", "CostModel", "Fixed", "StepPolicy"}
    found = []
    for path, tree in _modules().items():
        if path in ("engine/costmodel.py", "engine/policy.py"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = getattr(node.func, "id", None)
            if fn == "isinstance" and len(node.args) == 2:
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if any(getattr(c, "id", None) in policies for c in classes):
                    found.append(f"{path}:{node.lineno} isinstance")
            if fn in ("getattr", "hasattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in ("calibration", "control", "clock", "policy"):
                found.append(f"{path}:{node.lineno} {fn}({node.args[1].value!r})")
    assert found == []


def test_spec_rl_records_through_its_one_flow():
    """specrl/flow.py's ``record`` is the one rule for what is recorded; the trainer adapters call it,
    never the store's own ``record``."""
    mods = _modules()
    assert "specrl/flow.py" in _defined("record")
    for path, tree in mods.items():
        if not path.startswith("integrations/"):
            continue
        direct = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and getattr(node.func, "attr", None) == "record" and isinstance(node.func.value, ast.Call)
                  and getattr(node.func.value.func, "id", None) == "shared"]
        assert direct == [], (path, direct)
    for adapter in ("integrations/slime.py", "integrations/verl/agent_loop.py", "integrations/openrlhf_agent.py"):
        flows = [node for node in ast.walk(mods[adapter]) if isinstance(node, ast.Call)
                 and getattr(node.func, "attr", None) == "record"
                 and getattr(node.func.value, "id", None) == "flow"]
        assert len(flows) == 1, adapter


def test_sizes_a_reader_can_hold():
    """No package file over 500 lines; no function over 80 lines in the runtime's layers (engine,
    plugin, sync, specrl, integrations)."""
    long_files = [p for p in PKG.rglob("*.py") if len(p.read_text().splitlines()) > 500]
    assert long_files == []
    long_functions = []
    for path, tree in _modules().items():
        if path.split("/")[0] not in ("engine", "plugin", "sync", "specrl", "integrations"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                if node.end_lineno - node.lineno + 1 > 80:
                    long_functions.append(f"{path}:{node.lineno} {node.name}")
    assert long_functions == []
