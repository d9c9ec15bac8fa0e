"""Runs SGLang's ``sgl.Engine`` (the in-process API trainers use) on CPU with plain decoding, NGRAM and
HISTORY, and prints ``RESULT <json>``. Run by tests/engine/test_engine_cpu.py in the SGLang environment with
the CPU stand-ins on ``PYTHONPATH`` (``histospec_sgl.bench.engine_server.cpu_engine_env``).

Usage: python cpu_engine_api.py SPEC_JSON, where SPEC_JSON has ``model``, ``prompts`` (token-id
lists; the first two also go one at a time), ``methods``, ``max_new_tokens``, ``draft_tokens`` and
``snapshot`` (a path for HISTORY's snapshot); ``reload`` (default true) adds the second HISTORY engine.

For each method: two passes (batch 1, then all prompts as one batch). For HISTORY also: the index saved
by ``collective_rpc("histospec_save")``, the policy version set by ``histospec_version``,
``flush_cache`` and a third pass (history kept), then a second HISTORY engine that starts empty,
loads the snapshot with ``collective_rpc("histospec_load")`` between requests and decodes the prompts
again.
"""

from __future__ import annotations

import json
import sys
import time


def _pass(engine, prompts: list[list[int]], sp: dict) -> dict:
    t0 = time.monotonic()
    single = [engine.generate(input_ids=p, sampling_params=sp) for p in prompts[:2]]
    batch = engine.generate(input_ids=prompts, sampling_params=sp)
    outs = single + batch
    return {
        "bs1": [o["output_ids"] for o in single],
        "bs_all": [o["output_ids"] for o in batch],
        "tokens": sum(len(o["output_ids"]) for o in outs),
        "steps": sum(int(o["meta_info"].get("spec_verify_ct") or len(o["output_ids"])) for o in outs),
        "seconds": time.monotonic() - t0,
    }


def _engine(sgl, kw: dict):
    """``sgl.Engine(**kw)`` with its torch.distributed port drawn below the ephemeral range: SGLang
    0.5.17 draws it from that range, where another process's outgoing connection can take it before the
    store binds it, and the engine then kills this process (0.5.23 draws it as :func:`listen_port` does)."""
    from histospec_sgl.procs import listen_port

    return sgl.Engine(**kw, nccl_port=listen_port())


def main() -> None:
    import sglang as sgl

    spec = json.loads(sys.argv[1])
    prompts = spec["prompts"]
    sp = {"temperature": 0.0, "max_new_tokens": spec["max_new_tokens"], "ignore_eos": True}
    base = dict(model_path=spec["model"], device="cpu", attention_backend="torch_native", dtype="float32",
                skip_tokenizer_init=True, disable_cuda_graph=True, max_total_tokens=16384,
                max_running_requests=len(prompts), log_level="error")
    result = {"sglang": sgl.__version__}
    for method in spec["methods"]:
        kw = dict(base)
        if method != "plain":
            kw.update(speculative_algorithm=method.upper(), speculative_num_draft_tokens=spec["draft_tokens"])
        engine = _engine(sgl, kw)
        try:
            run = {"passes": [_pass(engine, prompts, sp), _pass(engine, prompts, sp)]}
            if method == "history":
                engine.collective_rpc("histospec_save", path=spec["snapshot"])
                engine.collective_rpc("histospec_version", version=3)
                engine.flush_cache()
                run["passes"].append(_pass(engine, prompts, sp))
        finally:
            engine.shutdown()
        if method == "history" and spec.get("reload", True):
            engine = _engine(sgl, kw)
            try:
                run["fresh"] = _pass(engine, prompts[2:3], sp)
                engine.collective_rpc("histospec_load", path=spec["snapshot"])
                run["loaded"] = _pass(engine, prompts, sp)
            finally:
                engine.shutdown()
        result[method] = run
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
