"""Start a draft server as a child process (``histospec-sgl draft-server``) and wait until it listens.

Used by the tests (which kill it with real signals) and by ``histospec-sgl bench sync``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from histospec_sgl import procs

READY = "histospec draft-server listening on "


class DraftServerProcess:
    """A ``histospec-sgl draft-server`` child process.

    Args:
        listen: address to bind (port 0: a free one, read back from the ready line).
        data_dir, auth_token_file, max_tokens, max_records, extra: passed as the CLI flags.
        log: file to collect the server's stderr (None: inherit).
        die_with_parent: the server gets SIGTERM when the process that started it dies (Linux), so a
            killed owner (a Ray actor) does not leave it holding the port.
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        data_dir: str | os.PathLike[str] | None = None,
        auth_token_file: str | os.PathLike[str] | None = None,
        max_tokens: int = 0,
        max_records: int = 0,
        extra: list[str] | None = None,
        log: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        die_with_parent: bool = False,
    ):
        cmd = [sys.executable, "-m", "histospec_sgl.cli", "draft-server", "--listen", listen]
        if data_dir is not None:
            cmd += ["--data-dir", str(data_dir)]
        if auth_token_file is not None:
            cmd += ["--auth-token-file", str(auth_token_file)]
        if max_tokens:
            cmd += ["--max-tokens", str(max_tokens)]
        if max_records:
            cmd += ["--max-records", str(max_records)]
        cmd += extra or []
        self.cmd = cmd
        self._log = open(log, "ab") if log is not None else None  # noqa: SIM115 (closed in wait())
        # In the caller's process group (a signal to the owner's group reaches it too); SIGTERM when
        # the owner dies, so that it drains and snapshots before it goes.
        self.proc = procs.spawn(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, group=False,
                                parent_death=signal.SIGTERM if die_with_parent else None)
        self.address = self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> str:
        address = procs.read_line(self.proc, READY, timeout)
        if address is None:
            self.kill()
            where = f" (see {self._log.name})" if self._log is not None else ""
            raise RuntimeError(f"draft server did not start within {timeout}s: {' '.join(self.cmd)}{where}")
        return address

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful: drain, final snapshot); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait(30)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            if self._log is not None:
                self._log.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def __enter__(self) -> DraftServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


__all__ = ["DraftServerProcess", "READY"]
