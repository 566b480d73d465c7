"""The orchestrator's side of the checkpoint workers (bench.ckpt_worker)."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading

from bench.procs import Owned
from bench.targets import free_port


class WorkerError(RuntimeError):
    pass


class CkptWorkers:
    """One process (torch.save) or ``world`` ranks (DCP) holding the state dict in memory."""

    def __init__(self, owned: Owned, kind: str, nbytes: int, env: dict, world: int = 2) -> None:
        self.owned, self.kind, self.nbytes, self.env = owned, kind, nbytes, env
        self.world = world if kind == "dcp" else 1
        self.procs: list[subprocess.Popen] = []
        self.queues: list[queue.Queue] = []
        self.stderr_tail: list[list[str]] = []

    def start(self, timeout: float = 600) -> None:
        port = free_port()
        for rank in range(self.world):
            argv = [sys.executable, "-m", "bench.ckpt_worker", "--kind", self.kind,
                    "--bytes", str(self.nbytes), "--rank", str(rank), "--world", str(self.world),
                    "--port", str(port)]
            p = self.owned.spawn(argv, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, bufsize=1)
            q: queue.Queue = queue.Queue()
            tail: list[str] = []
            threading.Thread(target=self._pump, args=(p.stdout, q), daemon=True).start()
            threading.Thread(target=self._tail, args=(p.stderr, tail), daemon=True).start()
            self.procs.append(p)
            self.queues.append(q)
            self.stderr_tail.append(tail)
        for rank in range(self.world):
            self._answer(rank, timeout)

    @staticmethod
    def _pump(stream, q: queue.Queue) -> None:
        for line in stream:
            if line.startswith("BENCH "):
                q.put(json.loads(line[6:]))
        q.put({"error": "the worker exited"})

    @staticmethod
    def _tail(stream, tail: list[str]) -> None:
        for line in stream:
            tail.append(line.rstrip())
            del tail[:-20]

    def _answer(self, rank: int, timeout: float) -> dict:
        try:
            msg = self.queues[rank].get(timeout=timeout)
        except queue.Empty:
            raise WorkerError(f"{self.kind} rank {rank}: no answer within {timeout:g}s") from None
        if "error" in msg:
            tail = "\n".join(self.stderr_tail[rank][-5:])
            raise WorkerError(f"{self.kind} rank {rank}: {msg['error']}\n{tail}".strip())
        return msg

    def save(self, cmd: dict, timeout: float = 3600) -> float:
        """Save once on every rank; the slowest rank's seconds."""
        for p in self.procs:
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        return max(self._answer(r, timeout)["seconds"] for r in range(self.world))

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write('{"quit": true}\n')
                p.stdin.flush()
                p.wait(30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            self.owned.release(p)
        self.procs = []
