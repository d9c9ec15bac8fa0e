"""slime's own engine code with HISTORY on a CPU: ``SGLangEngine.init`` (its ``_compute_server_args``
over the arguments slime's parser gives, then ``launch_server_process``), and between rollouts its
``update_weights_from_disk`` + ``flush_cache`` (a weight update) and ``release_memory_occupation`` /
``resume_memory_occupation`` (colocated training's sleep and wake). Run by tests/trainers/test_slime.py with
.venv-sglang's interpreter and slime's source on ``PYTHONPATH``.

    python slime_engine_driver.py MODEL_DIR OUT_JSON

What is stood in, and why:

- the ``--sglang-*`` values a GPU job would not pass: ``device cpu``, ``attention-backend
  torch_native``, ``disable-cuda-graph``, a small ``max-total-tokens`` and ``float32`` (there is no
  CUDA here); everything else is slime's parser's default;
- the fields of slime's full parser outside its SGLang group (``hf_checkpoint``, ``seed``, GPU
  counts, ...), which need Megatron to parse: set here to the values of a one-engine job;
- no router (``SGLangEngine`` registers with one only when it has an address), and the Ray
  actor: the class runs in this process, as its methods run inside slime's rollout actor;
- the Ray worker setup hook, run here as Ray runs it in each worker before slime's code;
- one line of slime's ``launch_server_process``: it strips IPv6 brackets from ``server_args.host``
  by assigning it after construction, which SGLang 0.5.17's read-only ``ServerArgs`` refuses
  (slime pins SGLang 0.5.15); :func:`launch_server_process` here takes the same steps without
  that assignment (the host here has no brackets): SGLang's ``launch_server`` in a spawned process,
  then slime's own ``_wait_server_healthy``;
- the memory saver: ``--offload-rollout`` (``enable_memory_saver``) needs torch-memory-saver,
  which pauses CUDA allocations; without CUDA, release and resume run SGLang's own path with
  nothing to pause;
- slime's accelerator: its CUDA backend reporting itself available (``_compute_server_args`` asks
  it only to map the engine's first GPU id through ``CUDA_VISIBLE_DEVICES``, unset here).

Writes the server arguments slime computed and, per phase, each request's tokens per verify step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _greedy import greedy_rollout

from histospec_sgl.procs import free_port


def make_args(model: str) -> argparse.Namespace:
    from slime.backends.sglang_utils.arguments import add_sglang_arguments

    parser = add_sglang_arguments(argparse.ArgumentParser())
    args = parser.parse_args([
        "--sglang-speculative-algorithm", "HISTORY", "--sglang-speculative-num-draft-tokens", "8",
        "--sglang-device", "cpu", "--sglang-attention-backend", "torch_native", "--sglang-disable-cuda-graph",
        "--sglang-max-total-tokens", "16384", "--sglang-dtype", "float32", "--sglang-skip-tokenizer-init",
        "--sglang-sleep-on-idle", "--sglang-log-level", "warning"])
    for k, v in dict(hf_checkpoint=model, seed=1234, num_gpus_per_node=1, rollout_num_gpus_per_engine=1,
                     sglang_pp_size=1, sglang_dp_size=1, sglang_ep_size=1, offload_rollout=False, colocate=False,
                     debug_rollout_only=True, actor_num_gpus_per_node=1, actor_num_nodes=1,
                     use_rollout_routing_replay=False, fp16=False, rollout_external=False,
                     sglang_router_ip=None, sglang_router_port=None).items():
        setattr(args, k, v)
    return args


def launch_server_process(server_args):
    import multiprocessing

    from sglang.srt.entrypoints.http_server import launch_server
    from slime.backends.sglang_utils.sglang_engine import _wait_server_healthy

    multiprocessing.set_start_method("spawn", force=True)
    p = multiprocessing.Process(target=launch_server, args=(server_args,))
    p.start()
    _wait_server_healthy(base_url=server_args.url(), api_key=server_args.api_key, is_process_alive=p.is_alive)
    return p


def main() -> None:
    model, out_path = sys.argv[1:3]
    from histospec_sgl.integrations.ray_setup import setup

    assert setup(), "the setup hook did not register HISTORY"
    from slime.utils.accelerator import set_accelerator
    from slime.utils.accelerator.cuda import CUDAAccelerator

    class CpuStandIn(CUDAAccelerator):
        def is_available(self) -> bool:
            return True

    set_accelerator(CpuStandIn())
    from slime.backends.sglang_utils import sglang_engine
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine, _compute_server_args

    sglang_engine.launch_server_process = launch_server_process

    args = make_args(model)
    kwargs, _ = _compute_server_args(args, 0, f"127.0.0.1:{free_port()}", free_port(), "127.0.0.1", free_port())
    out: dict = {"server_args": {k: kwargs.get(k) for k in (
        "speculative_algorithm", "speculative_num_draft_tokens", "max_running_requests", "enable_memory_saver",
        "skip_server_warmup", "enable_metrics", "enable_draft_weights_cpu_backup")}, "phases": {}}
    engine = SGLangEngine(args, rank=0)
    started = time.monotonic()
    engine.init(f"127.0.0.1:{free_port()}", free_port(), free_port(), host="127.0.0.1")
    out["start_seconds"] = time.monotonic() - started
    try:
        url = engine.get_url()
        out["phases"]["first"] = greedy_rollout(url, 32)
        out["phases"]["second"] = greedy_rollout(url, 32)
        # A weight update as slime's rollout manager runs it (the same checkpoint: greedy responses stay
        # the same, so the history still drafts them whole), then flush_cache.
        engine.update_weights_from_disk(model, weight_version="2")
        engine.flush_cache()
        # (slime's get_weight_version asks for /get_weight_version, which SGLang 0.5.17 does not
        # serve; the version each response reports is checked instead.)
        out["phases"]["after_update"] = greedy_rollout(url, 32)
        # Colocated training's sleep and wake.
        try:
            engine.release_memory_occupation()
            engine.resume_memory_occupation()
            out["phases"]["after_wake"] = greedy_rollout(url, 32)
        except Exception as e:  # noqa: BLE001 - reported to the test, which says what it needs
            out["wake_error"] = f"{type(e).__name__}: {e}"
    finally:
        engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
