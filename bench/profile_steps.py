"""Where an engine's decode time goes: py-spy's collapsed stacks of an SGLang scheduler process,
summed by part of the step (the model's linear layers, attention, LM head, the rest of the forward,
sampling and verification, HISTORY's drafting, the scheduler's own work).

Record each server's scheduler while a ``bench engine`` row runs (py-spy is on PyPI)::

    py-spy record --pid <scheduler pid> --rate 100 --format raw --output plain.txt --nonblocking

then::

    python bench/profile_steps.py plain.txt history.txt [--passes 1006,380] [--json out.json]

``--passes``: the forward passes each profile covers (tokens / tokens per step of its rows), to
print each part's time per pass relative to the first profile's.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

#: (part, any of these frame names in the stack), first match wins.
PARTS = [
    ("start-up", ("Scheduler.__init__", "init_model_worker")),
    ("forward: lm head", ("LogitsProcessor",)),
    ("forward: attention", ("AttentionBackend.forward", "_verify_attention")),
    ("forward: linear layers", ("UnquantizedLinearMethod.apply",)),
    ("forward: other", ("CausalLM.forward",)),
    ("drafting (histospec)", ("BatchDrafter", "_prepare_draft_tokens", "draft_batch")),
    ("sampling / verify", ("Sampler", "sample", "verify")),
]


def parts(path: Path) -> Counter[str]:
    out: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]  # function names, not file paths
        part = next((name for name, keys in PARTS if any(k in f for f in frames for k in keys)), "scheduler, other")
        out[part] += int(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's samples per second")
    ap.add_argument("--passes", help="comma list: forward passes per profile")
    ap.add_argument("--json")
    args = ap.parse_args()
    passes = [float(x) for x in args.passes.split(",")] if args.passes else None
    result = {p.stem: {k: v / args.rate for k, v in parts(p).items()} for p in args.profiles}
    names = [name for name, _ in PARTS] + ["scheduler, other"]
    base = next(iter(result.values()))
    print(f"{'part':24s}" + "".join(f"{stem:>14s}" for stem in result) + ("   per pass vs first" if passes else ""))
    for name in names:
        row = f"{name:24s}" + "".join(f"{r.get(name, 0.0):12.1f} s" for r in result.values())
        if passes and base.get(name):
            row += "  " + " ".join(f"{(r.get(name, 0.0) / n) / (base[name] / passes[0]):5.2f}x"
                                   for r, n in zip(result.values(), passes))
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
