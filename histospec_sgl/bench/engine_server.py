"""A real SGLang HTTP server (``python -m sglang.launch_server``) as a child process, for the engine
tests and ``histospec-sgl bench engine``: plain decoding, NGRAM or HISTORY, on a GPU or on a CPU.

On a CPU, SGLang's engine needs the verification pieces it lacks there (tree attention for the verify
forward of its ``torch_native`` backend, plain-torch restatements of a few sgl-kernel ops, sampling
verification); they live in a histospec-sgl checkout's ``bench/cpu_engine`` (with its ``stubs``),
never in the wheel, and :func:`cpu_engine_env` puts them on the server's ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from histospec_sgl import procs
from histospec_sgl.engine.clock import StepClock
from histospec_sgl.engine.policy import PrefillCost

METHODS = ("plain", "ngram", "history")
#: Where a checkout keeps the CPU engine's stand-ins (a development tool beside the benchmarks, never
#: in the wheel): an SGLang plugin with tree attention and sampling verification for ``torch_native``,
#: and ``stubs/sgl_kernel``, plain-torch restatements of the kernels SGLang's CPU path calls.
CPU_ENGINE = Path("bench") / "cpu_engine"
#: Launches of a server whose port another process took before it could bind it.
PORT_TRIES = 3
#: A label of a ``/metrics`` sample (``width="4"``).
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def checkout_root() -> Path | None:
    """The histospec-sgl checkout that holds the CPU-engine stand-ins (the working directory or the
    one this module was loaded from), or None."""
    for c in (Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[2]):
        if (c / CPU_ENGINE / "histospec_cpu_engine.py").exists():
            return c
    return None


def cpu_engine_env(python: str, root: Path | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an SGLang server needs to run speculative verification on a CPU."""
    root = root or checkout_root()
    if root is None:
        raise RuntimeError(
            f"SGLang's engine on a CPU needs the stand-ins in a histospec-sgl checkout ({CPU_ENGINE}): run "
            "from the repository root, or use --device cuda on a GPU machine")
    env = dict(os.environ if base is None else base)
    paths = [str(root / CPU_ENGINE / "stubs"), str(root / CPU_ENGINE)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # NGRAM JIT-compiles its corpus with ninja, which the environment's bin folder holds.
    env["PATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(python)), env.get("PATH", "")])
    # SGLang 0.5.17's NGRAM JIT sources use size_t without <cstddef>, which g++ 12 rejects.
    env.setdefault("CXX", str(root / CPU_ENGINE / "cxx"))
    return env


def server_args(model: str | os.PathLike[str], method: str, *, port: int, device: str = "cpu",
                draft_tokens: int = 8, dtype: str = "float32", max_running: int = 64,
                max_total_tokens: int = 65536, tp: int = 1, extra: list[str] | None = None,
                tokenizer: bool = False, nccl_port: int | None = None) -> list[str]:
    """``sglang.launch_server`` arguments for one method (token ids in and out, no tokenizer, unless
    ``tokenizer``: then the model directory's tokenizer, and text too). ``nccl_port``: the port of
    SGLang's torch.distributed store (SGLang draws one itself without it)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: expected one of {', '.join(METHODS)}")
    args = ["--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
            *([] if tokenizer else ["--skip-tokenizer-init"]), "--dtype", dtype, "--max-running-requests", str(max_running), "--log-level", "warning",
            "--tp-size", str(tp), *([] if nccl_port is None else ["--nccl-port", str(nccl_port)])]
    if device == "cpu":
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens",
                 str(max_total_tokens), "--disable-cuda-graph"]
        if "--sleep-on-idle" not in (extra or []):
            # An idle scheduler otherwise polls at 100% of a core, which starves servers beside it.
            args.append("--sleep-on-idle")
    else:
        args += ["--attention-backend", "flashinfer", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
    if method != "plain":
        args += ["--speculative-algorithm", method.upper(), "--speculative-num-draft-tokens", str(draft_tokens)]
    return args + list(extra or [])


class EngineError(RuntimeError):
    pass


def flush_cache(url: str, timeout: float = 60.0) -> None:
    """SGLang's ``/flush_cache`` on the server at ``url``. The server refuses while a request is still
    being finalized (its scheduler counts itself busy until the loop step that sent the last response
    ends), so this waits up to ``timeout`` for it to be idle."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/flush_cache?timeout={timeout:.0f}", timeout=timeout + 30):
                return
        except urllib.error.HTTPError as e:
            if e.code != 400 or time.monotonic() > deadline:
                raise EngineError(f"flush_cache: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
            time.sleep(0.2)


class EngineServer:
    """One ``sglang.launch_server`` process on loopback; :meth:`start` waits until it generates.

    Args:
        model: model directory.
        method: ``plain``, ``ngram`` or ``history``.
        python: the interpreter that has SGLang (default: this one).
        device: ``cpu`` (adds the CPU stand-ins, ``torch_native``) or ``cuda``.
        env: extra environment variables (``HISTOSPEC_*`` settings).
        log_path: where the server's output goes (default: a temporary file).
        tokenizer: load the model directory's tokenizer (default: token ids only).
    """

    def __init__(self, model: str | os.PathLike[str], method: str = "plain", *, python: str | None = None,
                 device: str = "cpu", draft_tokens: int = 8, dtype: str = "float32", max_running: int = 64,
                 max_total_tokens: int = 65536, tp: int = 1, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, log_path: str | os.PathLike[str] | None = None,
                 startup_timeout: float = 300.0, port: int | None = None, tokenizer: bool = False):
        self.python = python or sys.executable
        self.method = method
        self.port = port or procs.listen_port()
        # SGLang 0.5.17 draws its torch.distributed port from the kernel's ephemeral range, where an
        # outgoing connection can take it before the store binds it: drawn here, below that range.
        self._draws_nccl_port = "--nccl-port" not in (extra_args or [])
        self.args = server_args(model, method, port=self.port, device=device, draft_tokens=draft_tokens,
                                dtype=dtype, max_running=max_running, max_total_tokens=max_total_tokens, tp=tp,
                                extra=extra_args, tokenizer=tokenizer,
                                nccl_port=procs.listen_port() if self._draws_nccl_port else None)
        base = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
        base.update(env or {})
        if tp > 1 and device == "cpu":
            # One core per rank; no NCCL on a CPU (the CUDA build of torch would otherwise try it).
            base.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                    for i in range(tp)))
            base.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
        self.env = cpu_engine_env(self.python, base=base) if device == "cpu" else base
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=f"sglang-{method}-",
                                                                              suffix=".log")[1])
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._launched = 0.0
        self._log_start = 0
        self._corpus_id: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineServer:
        """Starts the server and waits until it answers."""
        return self.launch().wait_ready()

    def launch(self) -> EngineServer:
        """Starts the server's process without waiting for it (see :func:`running`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            # The server dies with the thread that started it (a harness killed with SIGKILL too), and
            # SGLang's own processes (scheduler, detokenizer) with the launcher (procs.spawn).
            self.proc = procs.spawn([self.python, "-m", "sglang.launch_server", *self.args], env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT)
        self._launched = time.monotonic()
        return self

    def wait_ready(self) -> EngineServer:
        """Waits until the launched server answers ``/health_generate`` (``startup_timeout`` from its launch).
        A server whose port was taken between :func:`~histospec_sgl.procs.listen_port` and its bind (by another process, or
        another server starting beside it) does not exit; it is stopped and launched again on new
        ports (its torch.distributed port too, unless ``extra_args`` set it), up to :data:`PORT_TRIES` times."""
        assert self.proc is not None, "launch() first"
        for attempt in range(1, PORT_TRIES + 1):
            if self._wait():
                return self
            self.stop()
            if attempt == PORT_TRIES:
                raise EngineError(f"the {self.method} server found its port taken {PORT_TRIES} times:\n"
                                  f"{self.log_tail()}")
            self.port = procs.listen_port()
            self.args[self.args.index("--port") + 1] = str(self.port)
            if self._draws_nccl_port:
                self.args[self.args.index("--nccl-port") + 1] = str(procs.listen_port())
            self.launch()
        return self

    def _port_taken(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return b"address already in use" in f.read()
        except OSError:
            return False

    def _wait(self) -> bool:
        """True once the server answers, False if its port was taken; raises if it exits or does not
        come up in time (:func:`histospec_sgl.procs.wait_ready`)."""
        assert self.proc is not None
        taken = False

        def answers() -> bool:
            nonlocal taken
            taken = self._port_taken()
            if taken:
                return True
            with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:  # OSError: not yet
                return bool(r.status == 200)

        left = self._launched + self.startup_timeout - time.monotonic()
        try:
            procs.wait_ready(self.proc, answers, max(left, 0.0), what=f"the {self.method} server", log=self.log_tail)
        except procs.ChildError as e:
            self.stop()
            if self._port_taken():
                return False
            raise EngineError(str(e)) from None
        return not taken

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _post(self, path: str, body: Any, timeout: float) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise EngineError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from e
        return json.loads(text) if text.strip() else None

    def generate(self, input_ids: list[list[int]], sampling_params: dict[str, Any] | list[dict[str, Any]], *,
                 rids: list[str] | None = None, timeout: float = 900.0, **extra: Any) -> list[dict[str, Any]]:
        """One ``/generate`` call for a batch of prompts (token ids); SGLang schedules them together."""
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params, **extra}
        if rids is not None:
            body["rid"] = rids
        out = self._post("/generate", body, timeout)
        return out if isinstance(out, list) else [out]

    def set_corpus(self, documents: list[str], timeout: float = 600.0) -> int:
        """NGRAM's external corpus (SGLang 0.5.23, a server with its tokenizer): the one added before
        is removed, then ``documents`` (text) are added as one corpus. Returns its token count."""
        corpus = getattr(self, "_corpus_id", None)
        if corpus:
            self._post("/remove_external_corpus", {"corpus_id": corpus}, timeout)
            self._corpus_id = None
        out = self._post("/add_external_corpus", {"documents": documents}, timeout)
        if not out or not out.get("success"):
            raise EngineError(f"/add_external_corpus failed: {out}")
        self._corpus_id = out["corpus_id"]
        return int(out.get("loaded_token_count", 0))

    def abort(self, rid: str) -> None:
        self._post("/abort_request", {"rid": rid}, 30)

    def flush_cache(self, timeout: float = 60.0) -> None:
        """SGLang's ``/flush_cache`` (what trainers call after a weight update); :func:`flush_cache`."""
        flush_cache(self.url, timeout)

    def server_info(self) -> dict[str, Any]:
        """SGLang's ``/server_info``: the server's arguments as it resolved them, and its state."""
        with urllib.request.urlopen(self.url + "/server_info", timeout=30) as r:
            return dict(json.loads(r.read()))

    def overlap(self) -> bool:
        """Whether the server runs SGLang's overlap scheduler (its ``/server_info``)."""
        return not self.server_info().get("disable_overlap_schedule", False)

    def prefill_chunk(self) -> int | None:
        """The most prompt tokens one prefill forward pass computes (SGLang's ``chunked_prefill_size``
        as the server resolved it); None: no limit."""
        size = self.server_info().get("chunked_prefill_size")
        return int(size) if size and int(size) > 0 else None

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 1.0) -> None:
        """Ends the server and every process it started: SIGTERM, then SIGKILL after ``grace``
        seconds. Nothing here waits on a graceful exit (SGLang's own shutdown kills its schedulers,
        and after SIGTERM its launcher spends seconds looking for crash dumps to take)."""
        procs.stop(self.proc, grace)
        self.proc = None

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(*servers: EngineServer, one_at_a_time: bool = False) -> Iterator[tuple[EngineServer, ...]]:
    """Several servers side by side: all are launched before any is waited for (their start-ups,
    mostly imports, overlap), and all are stopped on the way out. ``one_at_a_time``: each is
    started once the one before it answers (SGLang sizes its CPU KV pool from the memory free while
    it loads, which servers loading beside it take)."""
    try:
        if one_at_a_time:
            for srv in servers:
                srv.start()
        else:
            for srv in servers:
                srv.launch()
            for srv in servers:
                srv.wait_ready()
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def verify_steps(out: dict[str, Any]) -> int:
    """Forward passes that produced a response's tokens: ``spec_verify_ct`` where SGLang reports it
    (speculative decoding), else one per completion token."""
    meta = out.get("meta_info", {})
    ct = meta.get("spec_verify_ct")
    return int(ct) if ct else int(meta.get("completion_tokens", len(out.get("output_ids", []))))


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Each sample of metric ``name`` in a ``/metrics`` text: its labels and its value."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit(" ", 1)
            out.append((dict(_LABEL.findall(labels)), float(value)))
    return out


def width_steps(srv: EngineServer) -> dict[str, int] | None:
    """A HISTORY server's decode steps per verify width so far (``histospec:width_steps_total``, with
    ``--enable-metrics``), or None for a server that does not export them."""
    if srv.method != "history":
        return None
    out: dict[str, int] = {}
    for labels, value in _samples(srv.metrics(), "histospec:width_steps_total"):
        out[labels["width"]] = out.get(labels["width"], 0) + int(value)
    return out


def verified_tokens(srv: EngineServer) -> dict[str, dict[str, list[float]]] | None:
    """The default policy's verified steps so far, per verify width and batch-size bucket: the draft
    tokens they were expected to bring and brought (``histospec:verified_expected_tokens_total``,
    ``histospec:verified_accepted_tokens_total``), or None for a server that does not export them."""
    if srv.method != "history":
        return None
    out: dict[str, dict[str, list[float]]] = {}
    text = srv.metrics()
    for i, name in enumerate(("histospec:verified_expected_tokens_total", "histospec:verified_accepted_tokens_total")):
        for labels, value in _samples(text, name):
            out.setdefault(labels["width"], {}).setdefault(labels["batch"], [0.0, 0.0])[i] += value
    return out


def _counter(srv: EngineServer, name: str) -> float | None:
    """A HISTORY server's counter ``name`` so far, summed over its labels (with ``--enable-metrics``),
    or None for a server that does not export it."""
    if srv.method != "history":
        return None
    samples = _samples(srv.metrics(), name)
    return sum(value for _, value in samples) if samples else None


def context_mismatches(srv: EngineServer) -> int | None:
    """A HISTORY server's ``histospec:context_mismatches_total`` so far (with ``--enable-metrics``), or
    None for a server that does not export it."""
    total = _counter(srv, "histospec:context_mismatches_total")
    return None if total is None else int(total)


def host_seconds(srv: EngineServer) -> float | None:
    """A HISTORY server's ``histospec:host_seconds_total`` so far: the host time its worker spent
    drafting decode steps (the index, the step policy, the narrowing; with ``--enable-metrics``), or
    None for a server that does not export it."""
    return _counter(srv, "histospec:host_seconds_total")


def prefill_cost(srv: EngineServer) -> PrefillCost | None:
    """A server's prefill forward pass cost, seconds a pass and seconds a prompt token: a HISTORY
    server's as its step policy timed it (``histospec:prefill_seconds_fixed`` and
    ``histospec:prefill_seconds_per_token``, with ``--enable-metrics``), a plain server's in trace
    mode as the trace model timed it on the same clock (:func:`trace_clock`); None where it has none."""
    if srv.method != "history":
        clock = trace_clock(srv)
        return None if clock is None else clock.prefill()
    text = srv.metrics()
    found = {name: value for name in ("histospec:prefill_seconds_fixed", "histospec:prefill_seconds_per_token")
             for _, value in _samples(text, name)}
    if "histospec:prefill_seconds_per_token" not in found:
        return None
    return PrefillCost(found.get("histospec:prefill_seconds_fixed", 0.0), found["histospec:prefill_seconds_per_token"])


def trace_passes(srv: EngineServer) -> int | None:
    """How many passes a plain server in trace mode has timed so far (lines of its
    ``TRACE_MODE_CLOCK``, :func:`trace_clock`); None for another server."""
    log = srv.env.get("TRACE_MODE_CLOCK")
    if not log:
        return None
    return len(Path(log).read_text().splitlines()) if Path(log).exists() else 0


def trace_clock(srv: EngineServer, since: int | None = None) -> StepClock | None:
    """A plain server's passes in trace mode, as the trace model timed them (``TRACE_MODE_CLOCK``: a
    ``batch seconds`` line a decode step, a ``prefill tokens seconds`` line a prefill pass), on the
    step policy's clock (width 1 alone); None for another server. ``since``: the passes from that
    count on (:func:`trace_passes` before a run), every one of them kept, so that the clock says what
    that run's steps cost on average, not what its last few did (only a fresh server's first passes
    are left out as warm-up); None: every pass, kept as the step policy's clock keeps them."""
    log = srv.env.get("TRACE_MODE_CLOCK")
    if not log or not Path(log).exists():
        return None
    lines = Path(log).read_text().splitlines()[since or 0:]
    clock = StepClock() if since is None else StepClock(window=len(lines) + 1, warmup=1 if since == 0 else 0)
    for line in lines:
        *prefill, size, seconds = line.split()
        if prefill:
            clock.record_prefill(int(size), float(seconds))
        else:
            clock.record(int(size), 1, float(seconds))
    return clock


def plain_steps(table: dict[tuple[int, int], float]) -> dict[str, dict[str, float]]:
    """A trace clock's table (:func:`trace_clock`) as :func:`step_seconds` gives costs: width 1 ->
    batch-size bucket -> seconds."""
    return {"1": {str(b): v for (_, b), v in sorted(table.items())}} if table else {}


def step_seconds(srv: EngineServer, mean: bool = False) -> dict[str, dict[str, float]]:
    """A HISTORY server's decode step costs as its step policy measured them
    (``histospec:step_seconds``, with ``--enable-metrics``; ``mean``: ``histospec:step_seconds_mean``):
    width -> batch-size bucket -> seconds (a fixed-width server's: the widths it ran). A plain server
    in trace mode has its steps timed by the trace model (``TRACE_MODE_CLOCK``: a ``batch seconds``
    line a step), put here on the same clock (width 1 alone, :func:`trace_clock`); another server has
    none."""
    out: dict[str, dict[str, float]] = {}
    if srv.method != "history":
        clock = trace_clock(srv)
        return {} if clock is None else plain_steps(clock.means if mean else clock.table)
    for labels, value in _samples(srv.metrics(), "histospec:step_seconds_mean" if mean else "histospec:step_seconds"):
        out.setdefault(labels["width"], {})[labels["batch"]] = value
    return {w: dict(sorted(by.items(), key=lambda x: int(x[0]))) for w, by in sorted(out.items(), key=lambda x: int(x[0]))}
