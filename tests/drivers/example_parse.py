"""Parses a trainer command line that an example prints (``DRY_RUN=1``) with the trainer's own
argument code, in .venv-sglang (for tests/docs/test_examples.py); prints one ``RESULT {json}`` line.

    python example_parse.py slime|verl|openrlhf ARGV_JSON

- slime: its argument providers (slime's own arguments and its ``--sglang-*`` group, from slime's
  source on ``PYTHONPATH``); the rest of its parser is Megatron's, which does not import here, so
  the arguments left over must be Megatron's own (none in the examples);
- verl: its Hydra config (``verl/trainer/config/ppo_trainer.yaml``) composed with the overrides;
- OpenRLHF: the parser ``openrlhf.cli.train_ppo_ray`` builds under ``__main__``, taken from its source.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


def slime(argv: list[str]) -> dict:
    import importlib.machinery
    import types

    # slime's argument module imports its logging setup, which imports wandb at the top; wandb takes
    # no part in parsing and is not installed here.
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    sys.modules.setdefault("wandb", wandb)
    from slime.backends.sglang_utils.arguments import add_sglang_arguments
    from slime.utils.arguments import get_slime_extra_args_provider

    parser = add_sglang_arguments(get_slime_extra_args_provider()(argparse.ArgumentParser(allow_abbrev=False)))
    args, rest = parser.parse_known_args(argv)
    return {"unknown": rest, "algorithm": args.sglang_speculative_algorithm,
            "draft_tokens": args.sglang_speculative_num_draft_tokens, "generate": args.custom_generate_function_path,
            "record": args.rollout_all_samples_process_path, "config": args.custom_config_path,
            "hf_checkpoint": args.hf_checkpoint, "n_samples": args.n_samples_per_prompt,
            "rollout_batch_size": args.rollout_batch_size, "num_rollout": args.num_rollout,
            "prompt_data": args.prompt_data}


def verl(argv: list[str]) -> dict:
    import verl as verl_pkg
    from hydra import compose, initialize_config_dir

    conf = Path(verl_pkg.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=argv)
    r = cfg.actor_rollout_ref.rollout
    # The manager class as verl's task runner loads it, and the verl manager of the trainer it runs.
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.utils.import_utils import load_class_from_fqn

    manager = load_class_from_fqn(r.agent.agent_loop_manager_class, "AgentLoopManager")
    base = AgentLoopManagerTQ if cfg.trainer.use_v1 else AgentLoopManager
    return {"manager": manager.__name__, "manager_extends_the_trainers": issubclass(manager, base),
            "use_v1": bool(cfg.trainer.use_v1), "name": r.name, "n": r.n, "algorithm": r.engine_kwargs.sglang.speculative_algorithm,
            "router": r.router_config_path, "agent_loop": r.agent.default_agent_loop,
            "agent_config": r.agent.agent_loop_config_path, "model": cfg.actor_rollout_ref.model.path,
            "train_files": cfg.data.train_files, "epochs": cfg.trainer.total_epochs}


def openrlhf(argv: list[str]) -> dict:
    import importlib.util

    # Found, not imported: the module imports OpenRLHF's training stack (flash-attn) at the top.
    origin = importlib.util.find_spec("openrlhf.cli.train_ppo_ray").origin
    tree = ast.parse(Path(origin).read_text())
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    body = []
    for stmt in main.body:
        if isinstance(stmt, ast.Assign) and "parse_args" in ast.unparse(stmt.value):
            break
        body.append(stmt)
    scope: dict = {}
    # The module's standard-library imports (argparse, os, datetime), not its training stack's.
    stdlib = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
              and all((a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
                      in sys.stdlib_module_names for a in n.names)]
    exec(compile(ast.Module(body=stdlib, type_ignores=[]), origin, "exec"), scope)
    exec(compile(ast.Module(body=body, type_ignores=[]), origin, "exec"), scope)
    args = vars(scope["parser"].parse_args(argv))
    return {"agent": args["train.agent_func_path"], "n": args["rollout.n_samples_per_prompt"],
            "model": args["actor.model_name_or_path"], "data": args["data.prompt_dataset"],
            "correction": args["algo.advantage.is_correction_level"], "temperature": args["rollout.temperature"],
            "num_engines": args["vllm.num_engines"]}


if __name__ == "__main__":
    print("RESULT " + json.dumps({"slime": slime, "verl": verl, "openrlhf": openrlhf}[sys.argv[1]](json.loads(sys.argv[2]))))
