"""What the HISTORY worker reads from SGLang's requests and batches: what a request returned, the
batch's sequence lengths, and how a request samples (its class for the cost model, and whether it
needs SGLang's full sampler on every step). Plain attribute reads: no SGLang import.
"""

from __future__ import annotations

from typing import Any


def returned(req: Any) -> list[int]:
    """What request ``req`` returned: its output tokens up to where it finished (SGLang's
    ``finished_len``: a stop string, EOS or max_new_tokens; a verify step may have accepted tokens
    past it, which ``output_ids`` keeps and the response leaves out)."""
    out = list(req.output_ids)
    end = getattr(req, "finished_len", None)
    return out if end is None else out[: int(end)]


def batch_seq_lens(batch: Any) -> list[int]:
    """SGLang's ``seq_lens`` of the batch, on the host."""
    seq = getattr(batch, "seq_lens_cpu", None)
    if seq is None:
        seq = batch.seq_lens.cpu()
    return [int(x) for x in seq.tolist()]


#: SGLang's ``top_k`` when unset (the whole vocabulary); a request's ``top_k`` at or above it filters nothing.
_TOP_K_ALL = 1 << 30


def needs_full_sampler(req: Any) -> bool:
    """Whether request ``req`` must be decoded by SGLang's full sampler on every step: its sampling
    uses something that SGLang's tree verification (``eagle_sample``) does not apply as the sampler of
    a plain decode step does, so verifying a draft would sample it under another rule.

    - ``min_p``: the verify path ignores it (sampled requests);
    - frequency, presence and repetition penalties and ``min_new_tokens`` (SGLang's penalizers): the
      verify path applies the penalties of the step's start to every node ("a relaxed version of
      penalties"), and counts one output token per step;
    - a custom logit processor: the verify path does not run it;
    - ``top_k`` and ``top_p`` together (sampled): the sampler filters both on the model's
      probabilities at once, the verify path renormalizes after top-k and then cuts top-p;
    - ``sampling_seed``: the same seed must give the same tokens, which a verify step's coins (drawn
      per draft node) do not.

    Temperature, ``top_k`` or ``top_p`` alone, ``logit_bias``, stop conditions and greedy decoding
    are applied by both paths alike. docs/plugin.md has the table."""
    sp = getattr(req, "sampling_params", None)
    if sp is None:
        return False
    if getattr(req, "custom_logit_processor", None) or getattr(sp, "sampling_seed", None) is not None:
        return True
    if (getattr(sp, "frequency_penalty", 0.0) or getattr(sp, "presence_penalty", 0.0)
            or getattr(sp, "repetition_penalty", 1.0) != 1.0 or getattr(sp, "min_new_tokens", 0)):
        return True
    if request_class(req) == "greedy":  # argmax: min_p, top_k and top_p change nothing
        return False
    top_k = getattr(sp, "top_k", _TOP_K_ALL)
    return bool(getattr(sp, "min_p", 0.0) > 0.0 or (0 < top_k < _TOP_K_ALL and getattr(sp, "top_p", 1.0) < 1.0))


def request_class(req: Any) -> str:
    """``"greedy"`` or ``"sampled"``: the classes the cost model calibrates apart (a greedy request
    accepts a draft node exactly when it is the target's argmax, a sampled one with the node's
    probability)."""
    sp = getattr(req, "sampling_params", None)
    temperature = getattr(sp, "temperature", 1.0)
    top_k = getattr(sp, "top_k", -1)
    greedy = (temperature is not None and temperature <= 1e-5) or top_k == 1
    return "greedy" if greedy else "sampled"


def ended(req: Any, unprocessed: list[int]) -> bool:
    """Whether request ``req`` has already ended with the tokens SGLang accepted for it but has not
    processed yet (``unprocessed``: under the overlap scheduler, the last step's): they reach its
    ``max_new_tokens``, or one of them is a stop token (its ``stop_token_ids``, the model's EOS ids,
    the tokenizer's) and it does not ignore EOS. Such a request is still in the batch the overlap
    scheduler launched before it knew, and a draft for it would be verified for nothing. Stop
    strings are not read (they need the detokenized text): a request ended by one drafts on."""
    if not unprocessed:
        return False  # every result processed: SGLang would not have scheduled a finished request
    sp = getattr(req, "sampling_params", None)
    cap = getattr(sp, "max_new_tokens", None)
    if cap is not None and len(req.output_ids) + len(unprocessed) >= cap:
        return True
    if sp is None or getattr(sp, "ignore_eos", False):
        return False
    # Read where SGLang keeps them, no set built: this runs for every request of every step.
    tok = getattr(req, "tokenizer", None)
    eos = getattr(tok, "eos_token_id", None)
    stops = [ids for ids in (getattr(sp, "stop_token_ids", None), getattr(req, "eos_token_ids", None),
                             getattr(tok, "additional_stop_token_ids", None)) if ids]
    return any((eos is not None and t == eos) or any(t in ids for ids in stops) for t in unprocessed)
