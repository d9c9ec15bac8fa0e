"""Test support (never in the wheel): SGLang's real engine with NGRAM/HISTORY verification on a CPU.

SGLang runs a Llama on CPU with ``--device cpu --attention-backend torch_native`` (and
``SGLANG_USE_CPU_ENGINE=1``), but two pieces of speculative verification have no CPU implementation
there. This SGLang plugin (entry point ``histospec_cpu_engine`` in the ``sglang.srt.plugins`` group,
found by SGLang's own plugin loader in every process when this folder is on ``PYTHONPATH``) adds
them through SGLang's ``HookRegistry``, and ``stubs/sgl_kernel`` restates the kernels it calls
in plain torch:

1. **Tree attention for the verify forward.** ``TorchNativeAttnBackend`` has no ``TARGET_VERIFY``
   path (``extend_prefix_lens`` is None there, in 0.5.17 and 0.5.23). An AROUND hook on its
   ``forward_extend`` writes the d draft tokens' KV at ``out_cache_loc`` and attends, per request, over
   the verified context plus the d draft slots with the mask ``[ones(d, seq_len) | tree_mask]``, the
   d x d ancestor mask NGRAM sends on CPU. Every other forward mode runs SGLang's code.
2. **Sampling verification.** ``eagle_sample`` verifies every request greedily on CPU
   (``if sampling_info.is_all_greedy or _is_cpu``), which is not lossless for sampled requests. An
   AROUND hook clears ``_is_cpu`` for batches that are not all greedy, so they take SGLang's sampling
   branch (``tree_speculative_sampling_target_only`` and the top-k/top-p renormalizations, from the
   stubs).
3. **SGLang's overlap scheduler under speculation.** SGLang turns overlap scheduling off for every
   speculative algorithm on ``--device cpu`` (``speculative_hook._disable_overlap_schedule_for_cpu``,
   0.5.17 and 0.5.23), so a CPU server would run HISTORY only on the synchronous loop, which no GPU
   user runs. That switch is replaced by one that does nothing: HISTORY and NGRAM run under the
   overlap scheduler, as on a GPU (the launch of step k+1 before the result of step k is processed,
   the relay of accepted tokens through the future map), and ``--disable-overlap-schedule`` still
   selects the synchronous loop. Torch's CPU streams and events stand in for CUDA's (they are
   no-ops: a CPU runs one stream, so every copy is complete when it returns).
4. **HISTORY's backend check.** The product refuses any attention backend but FlashInfer, whose
   custom masks tree verification needs on a GPU. On ``--device cpu`` with ``torch_native`` (whose
   tree attention item 1 provides) this plugin lets the server start; every other combination still
   gets the product's check and its error.

``CPU_ENGINE_BROKEN_FILE`` names a file that, while it holds one of these words, deliberately breaks one
piece, to show that the tests would notice: ``mask`` (a causal mask in place of the tree mask),
``greedy-verify`` (SGLang's stock CPU behaviour: sampled requests verified greedily), ``padding`` (the
last leaves of each HISTORY draft, its pads when it is short, are re-hung under the root carrying node
1's token: duplicate siblings, which sampling verification counts several times) or ``relay`` (HISTORY
takes every relayed accepted token as not yet in ``output_ids``, the rule that gave wrong tokens under
the overlap scheduler on a GPU: where another batch ran in between, they are counted twice). It is read at every
step, so that one server runs both the real and a broken verify.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("histospec_cpu_engine")

BROKEN_FILE = os.environ.get("CPU_ENGINE_BROKEN_FILE", "")
_KINDS = ("", "mask", "greedy-verify", "padding", "relay")
_registered = False


def broken() -> str:
    """The piece broken for this step: the word in ``CPU_ENGINE_BROKEN_FILE`` ("" for none)."""
    if not BROKEN_FILE:
        return ""
    try:
        with open(BROKEN_FILE) as f:
            kind = f.read().strip()
    except FileNotFoundError:
        return ""
    if kind not in _KINDS:
        raise ValueError(f"CPU_ENGINE_BROKEN_FILE ({BROKEN_FILE}) holds {kind!r}: expected one of "
                         f"{', '.join(k for k in _KINDS if k)}")
    return kind


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
                          _verify_attention, HookType.AROUND)
    HookRegistry.register("sglang.srt.speculative.eagle_utils.eagle_sample", _sampling_verify, HookType.AROUND)
    HookRegistry.register("sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu",
                          _keep_overlap_schedule, HookType.REPLACE)
    if BROKEN_FILE:
        HookRegistry.register("histospec_sgl.plugin.worker.HistoryWorker._prepare_draft_tokens",
                              _duplicate_pads, HookType.AFTER)
        HookRegistry.register("histospec_sgl.plugin.worker.HistoryWorker._unprocessed", _every_relayed_token,
                              HookType.AROUND)
    _allow_torch_native_on_cpu()
    _registered = True
    if BROKEN_FILE:
        logger.warning("histospec_cpu_engine: CPU_ENGINE_BROKEN_FILE=%s (its verify can be broken on purpose)",
                       BROKEN_FILE)


# -- 1. tree attention ---------------------------------------------------------------------------


def _verify_attention(original: Any, backend: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                      save_kv_cache: bool = True, **kwargs: Any) -> Any:
    if not forward_batch.forward_mode.is_target_verify():
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    spec = forward_batch.spec_info
    d = int(spec.draft_token_num)
    bs = int(forward_batch.batch_size)
    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, _write_loc(forward_batch.out_cache_loc, backend), k, v)
    k_cache = pool.get_key_buffer(layer.layer_id)
    v_cache = pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    qv = q.reshape(-1, heads, layer.qk_head_dim)
    o = q.new_empty((qv.shape[0], heads * layer.v_head_dim))
    ov = o.view(-1, heads, layer.v_head_dim)
    trees = spec.custom_mask.reshape(-1)[: bs * d * d].view(bs, d, d).bool()
    if broken() == "mask":
        trees = torch.ones(d, d, dtype=torch.bool).tril().expand(bs, d, d)
    seq_lens = forward_batch.seq_lens.tolist()
    pools = forward_batch.req_pool_indices.tolist()
    for b in range(bs):
        n = int(seq_lens[b])
        slots = req_to_token[pools[b], : n + d].long()
        key = k_cache[slots].movedim(0, 1).to(qv.dtype)
        val = v_cache[slots].movedim(0, 1).to(qv.dtype)
        mask = torch.cat([torch.ones(d, n, dtype=torch.bool), trees[b]], dim=1)
        out = scaled_dot_product_attention(qv[b * d:(b + 1) * d].movedim(0, 1).unsqueeze(0), key.unsqueeze(0),
                                           val.unsqueeze(0), attn_mask=mask, scale=layer.scaling,
                                           enable_gqa=heads != kv_heads)
        ov[b * d:(b + 1) * d] = out.squeeze(0).movedim(1, 0)
    return o


def _write_loc(cache_loc: Any, backend: Any) -> Any:
    try:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    except ImportError:
        return cache_loc
    return KVWriteLoc(cache_loc, getattr(backend, "swa_out_cache_loc", None))


# -- 2. sampling verification --------------------------------------------------------------------


def _sampling_verify(original: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.speculative import eagle_utils

    batch = args[1] if len(args) > 1 else kwargs["batch"]
    if getattr(eagle_utils, "tree_speculative_sampling_target_only", True) is None:
        # SGLang 0.5.23 imports the kernel from its own kernel package, which has none on CPU (0.5.17
        # imports sgl_kernel's, which stubs/sgl_kernel restates): the same restatement.
        from sgl_kernel import tree_speculative_sampling_target_only

        eagle_utils.tree_speculative_sampling_target_only = tree_speculative_sampling_target_only
    if batch.sampling_info.is_all_greedy or not eagle_utils._is_cpu or broken() == "greedy-verify":
        return original(*args, **kwargs)  # greedy-verify: SGLang's stock CPU path
    eagle_utils._is_cpu = False
    try:
        return original(*args, **kwargs)
    finally:
        eagle_utils._is_cpu = True


# -- 3. the overlap scheduler -------------------------------------------------------------------


def _keep_overlap_schedule(server_args: Any) -> None:
    """Stands for ``_disable_overlap_schedule_for_cpu``: the overlap scheduler stays as the server
    arguments ask (on unless ``--disable-overlap-schedule``)."""


# -- 4. HISTORY on torch_native, on CPU only -----------------------------------------------------


def _allow_torch_native_on_cpu() -> None:
    from histospec_sgl import plugin as histospec_plugin
    from histospec_sgl.engine.config import HistoryConfig
    from histospec_sgl.plugin import compat

    histospec_plugin.register()
    from sglang.srt.speculative import spec_registry

    spec = spec_registry.get_spec(histospec_plugin.NAME)
    product_check = spec.validate_server_args

    def validate(server_args: Any) -> None:
        view = compat.resolved(server_args)
        backends = {getattr(view, f, None) for f in compat.ATTENTION_FIELDS} - {None}
        if getattr(view, "device", None) == "cpu" and backends == {"torch_native"}:
            HistoryConfig.from_env()
            return
        product_check(server_args)

    spec.validate_server_args = validate


# -- the padding bug, on demand ------------------------------------------------------------------


def _duplicate_pads(result: Any, worker: Any, batch: Any) -> Any:
    """A padding scheme that repeats a drafted token: the last ``DUPLICATES`` leaves of each tree (the
    token-0 pads of a short draft, else the deepest drafted nodes) are re-hung under the root, each
    carrying node 1's token, so that token appears several times among the root's children."""
    if broken() != "padding":
        return result
    tokens, mask = result
    bs = len(batch.reqs)
    d = tokens.size // bs  # the step's verify width (the cost model may choose fewer than d)
    if d == 1:
        return result
    t = tokens.reshape(bs, d).copy()
    m = mask.reshape(bs, d, d).copy()
    for b in range(bs):
        if t[b, 1] == 0:  # nothing drafted
            continue
        moved = 0
        for i in range(d - 1, 1, -1):
            if moved == DUPLICATES or m[b, i + 1:, i].any():  # stop at the first node with children
                break
            t[b, i] = t[b, 1]
            m[b, i] = 0
            m[b, i, 0] = m[b, i, i] = 1
            moved += 1
    return t.reshape(-1), m.reshape(-1)


DUPLICATES = 3


# -- the overlap relay counted as missing, on demand ----------------------------------------------


def _every_relayed_token(original: Any, worker: Any, batch: Any, use_prev: bool) -> Any:
    """Every accepted token SGLang relays taken as missing from ``output_ids`` (under overlap), whether
    or not SGLang has processed it since: the count before ``seq_lens`` was read."""
    if broken() != "relay" or not use_prev:
        return original(worker, batch, use_prev)
    d = worker.draft_token_num
    return [worker.prev_token_ids[i * d: i * d + worker.prev_accept_lens[i]] for i in range(len(batch.reqs))]
