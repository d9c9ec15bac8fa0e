"""Drives verl's real rollout path through histospec-sgl's verl integration, for tests/trainers/test_verl.py
(run by .venv-sglang's interpreter, with verl 0.9.1 and Ray installed there).

    python verl_driver.py compose MODEL OUT_JSON
        verl's Hydra config (its own ppo_trainer.yaml) with the HISTORY override composes and
        validates into a RolloutConfig.
    python verl_driver.py specrl MODEL SGLANG_URL DRAFT_DATA_DIR OUT_JSON
        Two epochs and a validation step of verl's AgentLoopWorker.generate_sequences with the SPEC-RL
        agent loop (wrapping verl's single-turn loop), its
        LLMServerClient, the prompt-affinity balancer made by verl's router factory, and two rollout
        server actors that are verl's SGLangHttpServer with only the in-process SGLang engine stood in
        by a real SGLang server over HTTP (verl's server needs a GPU engine in its own process).
    python verl_driver.py launch MODEL OUT_JSON
        verl's own SGLangHttpServer.launch_server starts HISTORY on the CPU engine in this process
        (run with the CPU engine's environment); two epochs, then verl's sleep and wake_up
        (colocated), then a third epoch. Stood in, because there is no CUDA here: through the
        config a user sets, engine_kwargs.sglang gives device cpu, attention_backend torch_native, a
        small max_total_tokens and enable_memory_saver false (verl hard-codes true, and
        torch-memory-saver pauses CUDA allocations), and rollout.enforce_eager true; the Ray actor
        (the class runs in this process).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "verl"


def compose(model: str, overrides: list[str]) -> Any:
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=sglang",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_algorithm=HISTORY",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_num_draft_tokens=8",
            "data.max_prompt_length=64", "data.max_response_length=24", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.calculate_log_probs=True",
            "actor_rollout_ref.rollout.max_model_len=128", *overrides])


def cmd_compose(model: str, out: str) -> None:
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose(model, [])
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    # What SGLangHttpServer does with it in its actor: engine_kwargs.sglang into ServerArgs.
    from sglang.srt.server_args import ServerArgs

    kwargs = dict(rollout.engine_kwargs["sglang"])
    try:
        sa = ServerArgs(model_path=model, device="cuda", load_format="dummy", skip_tokenizer_init=True, **kwargs)
        resolved = {"ok": True, "algorithm": str(sa.speculative_algorithm), "draft_tokens": sa.speculative_num_draft_tokens}
    except Exception as e:
        resolved = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    Path(out).write_text(json.dumps({"engine_kwargs": dict(rollout.engine_kwargs["sglang"]), "server_args": resolved,
                                     "entry_point_loaded": "histospec_sgl.integrations.verl" in sys.modules}))


class HttpTokenizerManager:
    """Where verl's SGLangHttpServer holds SGLang's in-process TokenizerManager: the same request
    (``GenerateReqInput``) to a real SGLang server's ``/generate``; the same answer dict."""

    def __init__(self, url: str):
        self.url = url

    async def generate_request(self, obj: Any, request: Any = None):
        fields = ("rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num")
        body = {f: getattr(obj, f) for f in fields if getattr(obj, f, None) is not None}

        def post() -> dict:
            req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())

        yield await asyncio.to_thread(post)


def server_class() -> type:
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    class CpuSGLangServer(SGLangHttpServer):
        """verl's rollout server; only its constructor (which launches SGLang in-process on a GPU)
        is replaced. ``generate`` and ``set_global_steps`` are verl's."""

        def __init__(self, rollout_config: Any, model_config: Any, url: str, replica_rank: int):
            from verl.utils.config import omega_conf_to_dataclass

            self.config = omega_conf_to_dataclass(rollout_config)
            self.model_config = omega_conf_to_dataclass(model_config)
            self.replica_rank = replica_rank
            self.node_rank = 0
            self.global_steps = None
            self._disaggregation_role = None
            self._pd_decode_peers = []
            self.tokenizer_manager = HttpTokenizerManager(url)
            self.served: list[list[int]] = []

        async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
            self.served.append([int(t) for t in prompt_ids])
            return await super().generate(prompt_ids, sampling_params, request_id, **kwargs)

        def served_prompts(self) -> list[list[int]]:
            return self.served

    return CpuSGLangServer


async def two_epochs(cfg: Any, cfg_longer: Any, url: str, prompts: list[str], draft: dict) -> dict:
    import numpy as np
    import ray
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    cls = ray.remote(server_class())
    servers = {f"replica-{i}": cls.remote(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, url, i) for i in range(2)}
    balancer = get_router_handle(servers, router_config_path=cfg.actor_rollout_ref.rollout.router_config_path)
    workers = {c: AgentLoopWorker(cfg_, LLMServerClient(cfg_, balancer))
               for c, cfg_ in (("base", cfg), ("longer", cfg_longer))}
    import time

    from _draft import records_by_version, wait_records
    from verl.trainer.ppo.ray_trainer import compute_spec_decode_metrics

    from histospec_sgl.specrl.store import shared
    from histospec_sgl.sync.process import DraftServerProcess

    n = cfg.actor_rollout_ref.rollout.n
    epochs: list = []
    spec_metrics: list = []
    # Two training steps, the second with a longer response budget (a truncated previous response is
    # kept whole and continued), then two validation steps (verl's val_kwargs: greedy; the second
    # repeats the first, which HISTORY drafts from).
    for step, validate, worker in ((1, False, workers["base"]), (2, False, workers["longer"]),
                                   (2, True, workers["base"]), (2, True, workers["base"])):
        if step == 2 and not validate:
            # Every record of the first step acknowledged (and mirrored), then the server killed outright.
            draft["durable"]["before_kill"] = wait_records(draft["address"], 1, 16)
            time.sleep(0.5)
            draft["servers"][0].kill()
        if step == 2 and validate and len(draft["servers"]) == 1:
            draft["servers"].append(DraftServerProcess(listen=draft["address"], data_dir=draft["data_dir"],
                                                       auth_token_file=draft["token"]))
            # The second step's records, queued while the server was down, go out now.
            draft["durable"]["settled"] = shared().settle(draft["address"], 60)
            draft["durable"]["after_restart"] = records_by_version(draft["address"])
        await asyncio.gather(*(s.set_global_steps.remote(step) for s in servers.values()))
        batch = DataProto.from_dict(non_tensors={
            "raw_prompt": np.array([[{"role": "user", "content": p}] for p in prompts] + [None], dtype=object)[:-1],
            "index": np.arange(len(prompts)),
        }, meta_info={"global_steps": step, "validate": validate})
        batch = batch.repeat(repeat_times=1 if validate else n, interleave=True)
        out = await worker.generate_sequences(batch)
        rows = []
        for i in range(len(out)):
            mask = out.batch["response_mask"][i].tolist()
            length = int(sum(mask))
            rows.append({
                "index": int(out.non_tensor_batch["index"][i]),
                "prompt_ids": [int(t) for t, m in zip(out.batch["prompts"][i].tolist(),
                                                       out.batch["attention_mask"][i][: out.batch["prompts"].shape[1]].tolist()) if m],
                "response_ids": out.batch["responses"][i][:length].tolist(),
                "response_mask": mask[:length],
                "rollout_log_probs": out.batch["rollout_log_probs"][i][:length].tolist(),
                "reused": int(out.non_tensor_batch["histospec_reused"][i]),
                "generated": int(out.non_tensor_batch["histospec_generated"][i]),
                "previous_len": int(out.non_tensor_batch["histospec_previous_len"][i]),
                "slot": int(out.non_tensor_batch["histospec_slot"][i]),
                "global_steps": int(out.non_tensor_batch["global_steps"][i]) if "global_steps" in out.non_tensor_batch
                else None,
            })
        # verl's own per-request speculative metrics, from the fields its server filled.
        spec = [out.non_tensor_batch.get(k) for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens",
                                                        "spec_num_verify_steps")]
        for row, d, a, v in zip(rows, *(x if x is not None else [None] * len(rows) for x in spec)):
            row["spec"] = None if d is None else [int(d), int(a), int(v)]
        metrics = compute_spec_decode_metrics(*spec) if all(x is not None for x in spec) else {}
        epochs.append(rows)
        spec_metrics.append(metrics)
    served = {sid: await s.served_prompts.remote() for sid, s in servers.items()}
    stats = await balancer.affinity_stats.remote()
    announce = await announced_step(cfg, balancer, prompts)
    return {"epochs": epochs, "served": served, "balancer": stats, "spec_metrics": spec_metrics,
            "durable": draft["durable"], "announce": announce}


async def announced_step(cfg: Any, balancer: Any, prompts: list[str]) -> dict:
    """One more training step through each of histospec's announcing managers: verl's legacy
    ``AgentLoopManager`` (``AnnouncingAgentLoopManager``, dispatching to verl's ``AgentLoopWorker``
    as a Ray actor), then the v1 trainer's TransferQueue one (``AnnouncingAgentLoopManagerTQ``,
    dispatching to verl's ``AgentLoopWorkerTQ``, its outputs read back from TransferQueue). For each:
    the groups it announced, the groups of the prompts its workers sent, and what a follower of the
    draft server that decoded those groups heard."""
    import time

    import numpy as np
    from verl import DataProto

    from histospec_sgl import HistoryIndex
    from histospec_sgl.integrations.verl.announce import batch_groups, token_builder
    from histospec_sgl.sync.client import Credentials
    from histospec_sgl.sync.follow import GroupFollower

    batch = DataProto.from_dict(non_tensors={
        "raw_prompt": np.array([[{"role": "user", "content": p}] for p in prompts] + [None], dtype=object)[:-1],
        "index": np.arange(len(prompts)),
    }, meta_info={"global_steps": 3, "validate": False})
    batch = batch.repeat(repeat_times=cfg.actor_rollout_ref.rollout.n, interleave=True)
    keys = batch_groups(token_builder(cfg), batch)
    # An engine's follower that has decoded these groups before (it asked for them).
    follower = GroupFollower(os.environ["HISTOSPEC_DRAFT_SERVER"], HistoryIndex(),
                             **Credentials.from_env().kwargs()).start()

    async def heard(count: int) -> int:
        deadline = time.monotonic() + 30
        while follower.announced < count and time.monotonic() < deadline:
            follower.poll()
            await asyncio.sleep(0.05)
        return follower.announced

    try:
        follower.want(keys)
        deadline = time.monotonic() + 30
        while not all(follower.ready(k) for k in keys) and time.monotonic() < deadline:
            follower.poll()
            await asyncio.sleep(0.05)
        legacy = await legacy_step(cfg, balancer, batch)
        legacy.update(announced_keys=keys, follower_announced=await heard(len(keys)))
        tq = await asyncio.to_thread(tq_step, cfg, balancer, prompts)
        tq.update(announced_keys=keys, follower_announced=await heard(2 * len(keys)) - legacy["follower_announced"])
        return {**legacy, "tq": tq}
    finally:
        follower.close()


async def legacy_step(cfg: Any, balancer: Any, batch: Any) -> dict:
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient

    from histospec_sgl import group_key
    from histospec_sgl.integrations.verl.announce import AnnouncingAgentLoopManager

    manager = AnnouncingAgentLoopManager(cfg, LLMServerClient(cfg, balancer))
    manager.agent_loop_workers = [ray.remote(AgentLoopWorker).remote(cfg, LLMServerClient(cfg, balancer))]
    out = await manager.generate_sequences(batch)
    sent = set()
    for i in range(len(out)):
        mask = out.batch["attention_mask"][i][: out.batch["prompts"].shape[1]].tolist()
        sent.add(group_key([int(t) for t, m in zip(out.batch["prompts"][i].tolist(), mask) if m]))
    return {"sent_keys": sorted(sent), "manager_announced": manager.announced, "rows": len(out)}


def tq_step(cfg: Any, balancer: Any, prompts: list[str]) -> dict:
    """A step as verl's v1 trainer submits it: the prompts registered in TransferQueue, then handed
    to the manager once each (its worker expands them to rollout.n), which returns at once; the
    step's outputs are read back from TransferQueue when every prompt's status is final."""
    import time

    import numpy as np
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils import tensordict_utils as tu
    from verl.workers.rollout.llm_server import LLMServerClient

    from histospec_sgl import group_key
    from histospec_sgl.integrations.verl import announce

    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        uids = [f"tq-{i}" for i in range(len(prompts))]
        raw = np.empty(len(prompts), dtype=object)
        raw[:] = [[{"role": "user", "content": p}] for p in prompts]
        batch = tu.get_tensordict({"raw_prompt": raw, "index": np.arange(len(prompts)),
                                   "uid": np.array(uids, dtype=object)})
        tu.assign_non_tensor_data(batch, "global_steps", 4)
        manager = announce.AnnouncingAgentLoopManagerTQ(cfg, LLMServerClient(cfg, balancer))
        manager.agent_loop_workers = [AgentLoopWorkerTQ.remote(cfg, LLMServerClient(cfg, balancer))]
        tq.kv_batch_put(keys=uids, partition_id="train",
                        tags=[{"is_prompt": True, "status": "pending", "global_steps": 4} for _ in uids])
        manager.generate_sequences(batch)
        deadline = time.monotonic() + 300
        while True:
            items = tq.kv_list("train").get("train", {})
            if all(items.get(u, {}).get("status") in ("finished", "failure") for u in uids):
                break
            assert time.monotonic() < deadline, f"TransferQueue step unfinished: {items}"
            time.sleep(0.2)
        outputs = sorted(k for k in items if k.split("_", 1)[0] in uids and k not in uids)
        data = tq.kv_batch_get(keys=outputs, partition_id="train", select_fields=["prompts"])
        sent = {group_key([int(t) for t in data["prompts"][i].tolist()]) for i in range(len(outputs))}
        return {"sent_keys": sorted(sent), "manager_announced": manager.announced, "rows": len(outputs),
                "statuses": sorted({items[u]["status"] for u in uids})}
    finally:
        tq.close()


def cmd_specrl(model: str, url: str, data_dir: str, out: str) -> None:
    import ray
    from _draft import TOKEN_ENV, token_file, wrong_token_error

    from histospec_sgl.sync.process import DraftServerProcess

    # SPEC-RL's store is this driver's own draft server: killed after the first step, restarted after
    # the second. It requires a token, as a job's does; the agent loops get it as engines do, from
    # the settings.
    token = token_file(os.path.dirname(os.path.abspath(data_dir)))
    first = DraftServerProcess(data_dir=data_dir, auth_token_file=token)
    draft = {"servers": [first], "address": first.address, "data_dir": data_dir, "durable": {}, "token": token}
    draft_server = first.address
    # Four logical CPUs: TransferQueue's controller and storage unit each hold one.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HISTOSPEC_DRAFT_SERVER": draft_server, TOKEN_ENV: token}})
    os.environ["HISTOSPEC_DRAFT_SERVER"] = draft_server
    os.environ[TOKEN_ENV] = token
    try:
        overrides = [
            "actor_rollout_ref.rollout.agent.default_agent_loop=histospec_specrl",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={EXAMPLES / 'agent_loops.yaml'}",
            f"actor_rollout_ref.rollout.router_config_path={EXAMPLES / 'router.yaml'}",
        ]
        cfg = compose(model, overrides)
        cfg_longer = compose(model, [*overrides, "data.max_response_length=32"])
        prompts = ["Write a haiku about rivers.", "What is 17 * 23?", "Name three prime numbers.",
                   "Translate 'good morning' to French."]
        result = asyncio.run(two_epochs(cfg, cfg_longer, url, prompts, draft))
        result["wrong_token"] = wrong_token_error(draft_server, os.path.dirname(os.path.abspath(data_dir)))
    finally:
        ray.shutdown()
        for server in draft["servers"]:
            server.kill()
    Path(out).write_text(json.dumps(result))


async def launched(cfg: Any) -> dict:
    from _greedy import PROMPTS, greedy_rollout
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    server = SGLangHttpServer(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, RolloutMode.COLOCATED,
                              workers=[], replica_rank=0, node_rank=0, nnodes=1, cuda_visible_devices="",
                              base_gpu_id=0)
    await server.launch_server()
    host, port = server.get_server_address()
    url = f"http://{host}:{port}"
    sa = server.tokenizer_manager.server_args
    out: dict = {"server_args": {"speculative_algorithm": str(sa.speculative_algorithm),
                                 "speculative_num_draft_tokens": sa.speculative_num_draft_tokens,
                                 "max_running_requests": sa.max_running_requests,
                                 "enable_weights_cpu_backup": getattr(sa, "enable_weights_cpu_backup", None)},
                 "phases": {}}

    async def epoch() -> list[dict]:
        # Blocking HTTP calls, off the event loop that serves them.
        return await asyncio.to_thread(greedy_rollout, url, 24)

    out["phases"]["first"] = await epoch()
    out["phases"]["second"] = await epoch()
    await server.sleep()
    await server.wake_up()
    out["phases"]["after_wake"] = await epoch()
    # verl's own generate (what its agent loops call) on the woken server.
    tok = await server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 24}, request_id="verl-0")
    out["verl_generate"] = list(tok.token_ids)
    out["abort"] = await abort_all(server, PROMPTS, {tuple(r["prompt"]): r["output_ids"] for r in out["phases"]["first"]})
    out["phases"]["after_abort"] = await epoch()
    return out


async def abort_all(server: Any, prompts: list[list[int]], greedy: dict) -> dict:
    """verl's abort_all_requests while requests are in flight: four plain sampled ones and one through
    SPEC-RL's server manager, which reused a previous response and is continuing it; then verl's
    resume_generation."""
    from histospec_sgl import prompt_key
    from histospec_sgl.integrations.verl.agent_loop import _ReusingServerManager
    from histospec_sgl.specrl.guard import Options
    from histospec_sgl.specrl.store import shared

    continuing = asyncio.Event()
    calls: list[int] = []

    class OneServer:
        """verl's server manager picks a server for each request; there is one here."""

        async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict, **kw: Any):
            calls.append(len(prompt_ids))
            if len(calls) == 2:  # the continuation, after the scoring pass
                continuing.set()
            return await server.generate(prompt_ids, dict(sampling_params), request_id, **kw)

    reused = prompts[1]
    previous = greedy[tuple(reused)]
    group = prompt_key(reused)
    # The slot's previous response; a lenience that keeps all of it, so the continuation runs long.
    shared().record(None, reused, previous, [-1.0] * len(previous), "length", group=group, slot=0, version=0)
    manager = _ReusingServerManager(OneServer(), Options(lenience=1e9), n=1, response_length=100)
    specrl = asyncio.create_task(manager.generate(
        request_id="specrl-0", prompt_ids=reused,
        sampling_params={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}))
    plain = [asyncio.create_task(server.generate(p, {"temperature": 1.0, "max_tokens": 100}, request_id=f"plain-{i}"))
             for i, p in enumerate(prompts)]
    await asyncio.wait_for(continuing.wait(), 120)
    await asyncio.sleep(0.2)
    await server.abort_all_requests()
    done = await asyncio.wait_for(asyncio.gather(specrl, *plain), 120)
    await server.resume_generation()
    sp = done[0]
    return {"plain": [{"prompt": p, "stop_reason": o.stop_reason, "token_ids": list(o.token_ids)}
                      for p, o in zip(prompts, done[1:])],
            "specrl": {"previous": previous, "stop_reason": sp.stop_reason, "token_ids": list(sp.token_ids),
                       "log_probs": len(sp.log_probs or []), "reused": sp.extra_fields.get("histospec_reused"),
                       "calls": calls},
            "kept": list(shared().get(None, group, 0).response_ids)}


def cmd_launch(model: str, out: str) -> None:
    cfg = compose(model, [
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.device=cpu",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=torch_native",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.max_total_tokens=16384",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_memory_saver=false",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.sleep_on_idle=true",
        "actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.skip_tokenizer_init=true", "actor_rollout_ref.rollout.free_cache_engine=true"])
    from sglang.srt.utils import kill_process_tree

    try:
        result = asyncio.run(launched(cfg))
        Path(out).write_text(json.dumps(result))
    finally:
        # SGLang's scheduler and detokenizer are this process's children (verl launched them here):
        # stopped whatever happened, or this process would wait for them at exit. Its subprocess
        # watchdog would take their deaths for a crash and SIGQUIT this process before it exits.
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    if sys.argv[1] == "compose":
        cmd_compose(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "launch":
        cmd_launch(sys.argv[2], sys.argv[3])
    else:
        cmd_specrl(*sys.argv[2:6])
