"""Shared helpers of the runtime, compile and distributed tests.

``make_plan`` builds a ParallelPlan by hand (layer names from runtime.graph), and
``run_torchrun`` runs a compiled program on worker processes as torchrun runs it, with a
bounded time and a free rendezvous port.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Every test traces afresh (a test that patches the capture would otherwise read another
# test's graph); tests/test_trace_cache.py turns the cache on where it is the subject.
os.environ["HETPAR_TRACE_CACHE"] = "off"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hetpar.planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, SolverInfo, StagePlan  # noqa: E402
from hetpar.vocabulary import Schedule, Sharding  # noqa: E402
from hetpar.runtime.graph import trace_layers  # noqa: E402
from hetpar.runtime.model_file import file_fingerprint, load_model_file  # noqa: E402
from hetpar.runtime.cli import free_port  # noqa: E402

TORCHRUN_TIMEOUT_S = 180

# Megatron's pattern for a GPT block, written out as a plan would hold it.
GPT_BLOCK_TP = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
                "mlp.fc": "colwise", "mlp.proj": "rowwise"}


def layer_names(model_path: Path, model_args: dict[str, Any]) -> list[str]:
    return list(trace_layers(load_model_file(model_path, model_args).build_model()).layer_names)


def build_plan(
    model_path: Path,
    model_args: dict[str, Any],
    *,
    splits: list[list[int]],
    data_parallel: int = 1,
    tensor_parallel: int | list[int] = 1,
    micro_batch_size: int = 2,
    num_microbatches: int = 1,
    schedule: str = "1f1b",
    tp_blocks: bool = False,
    tp_sharding: list[dict[str, str]] | None = None,
    dtype: str = "fp32",
    zero_stage: int = 0,
) -> ParallelPlan:
    """A plan whose stage s holds layers ``splits[s]``; ranks numbered stage by stage,
    replica by replica. ``tensor_parallel`` is one degree or one per stage;
    ``tp_blocks`` shards the GPT blocks of each stage Megatron-style, ``tp_sharding``
    gives each stage's sharding explicitly; ``zero_stage`` applies to every stage."""
    names = layer_names(model_path, model_args)
    tps = tensor_parallel if isinstance(tensor_parallel, list) else [tensor_parallel] * len(splits)
    stages, next_rank = [], 0
    for s, (layers, tp) in enumerate(zip(splits, tps, strict=True)):
        ranks = []
        for _ in range(data_parallel):
            ranks.append(list(range(next_rank, next_rank + tp)))
            next_rank += tp
        sharding = dict(tp_sharding[s]) if tp_sharding else {}
        if tp_blocks and tp > 1:
            sharding = {
                f"{names[l]}.{path}": kind
                for l in layers
                if names[l].startswith("blocks.")
                for path, kind in GPT_BLOCK_TP.items()
            }
        stages.append(
            StagePlan(index=s, layers=layers, device_type="cpu", tensor_parallel=tp, ranks=ranks,
                      tp_sharding={path: Sharding(kind) for path, kind in sharding.items()}, zero_stage=zero_stage)
        )
    world = next_rank
    return ParallelPlan(
        model=ModelRef(file=str(model_path), args=dict(model_args), fingerprint=file_fingerprint(model_path),
                       layer_names=names),
        cluster=ClusterRef(spec=f"1x{world}xcpu", world_size=world, device_types=["cpu"] * world),
        global_batch_size=data_parallel * micro_batch_size * num_microbatches,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        schedule=Schedule(schedule),
        data_parallel=data_parallel,
        dtype=dtype,
        stages=stages,
        predicted=Predicted(step_time_s=0.1, throughput_samples_per_s=10.0, peak_memory_bytes=[0] * len(splits)),
        solver=SolverInfo(status="pinned", search_time_s=0.0),
    )


def checkpoint_model_tensors(checkpoint_dir: Path) -> dict:
    """The model's tensors in one checkpoint directory (``step-N``), read by name in one
    process: what a user's own code would load from it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    dcp.load({f"model.{k}": v for k, v in saved.items()}, checkpoint_id=str(checkpoint_dir), no_dist=True)
    return saved


def subprocess_env() -> dict[str, str]:
    """The environment of a program run: runtime importable, one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    return env


class _Zygote:
    """The client of tests/zygote.py ([Note: workers forked from a zygote]): one per test process, started at
    the first launch and ended with the session."""

    _one: "_Zygote | None | bool" = None  # False: could not start, workers start as their own processes

    def __init__(self) -> None:
        import json
        import selectors

        self._json = json
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=subprocess_env(), cwd=ROOT)
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.fd, selectors.EVENT_READ)
        self.pending, self.exited = b"", {}
        self._read_until(lambda msg: msg.get("ready"), timeout_s=TORCHRUN_TIMEOUT_S)

    @classmethod
    def get(cls) -> "_Zygote | None":
        if cls._one is None:
            cls._one = False
            if os.environ.get("HETPAR_TEST_ZYGOTE", "1") != "0" and hasattr(os, "fork"):
                try:
                    cls._one = _Zygote()
                except (OSError, RuntimeError, TimeoutError):
                    cls._one = False
        return cls._one or None

    @classmethod
    def fork(cls, argv: list[str], cwd: Path, env: dict[str, str], stdout: str, stderr: str) -> "_ForkedWorker | None":
        """``python ARGV`` forked from the zygote, or None where there is none (it could not start, or it has died:
        interpreters of their own from then on)."""
        zygote = cls.get()
        if zygote is None:
            return None
        try:
            return zygote.start(argv, cwd, env, stdout, stderr)
        except (OSError, RuntimeError, TimeoutError):
            cls._one = False
            return None

    @classmethod
    def close(cls) -> None:
        if isinstance(cls._one, _Zygote):
            cls._one.proc.stdin.close()
            cls._one.proc.wait(timeout=30)
        cls._one = None

    def _read(self, timeout_s: float) -> list[dict]:
        """Messages the zygote has written, waiting up to ``timeout_s`` for the first."""
        if b"\n" not in self.pending:
            if not self.selector.select(timeout_s):
                return []
            data = os.read(self.fd, 1 << 16)
            if not data:
                raise RuntimeError("the test zygote ended")
            self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        messages = [self._json.loads(line) for line in lines]
        for msg in messages:
            if "exited" in msg:
                self.exited[msg["exited"]] = msg["rc"]
        return messages

    def _read_until(self, done, timeout_s: float) -> dict:
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for msg in self._read(max(0.0, deadline - time.monotonic())):
                if done(msg):
                    return msg
        raise TimeoutError("the test zygote did not answer")

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], stdout: str, stderr: str) -> "_ForkedWorker":
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": stdout, "stderr": stderr}
        self.proc.stdin.write((self._json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return _ForkedWorker(self, self._read_until(lambda msg: "pid" in msg, timeout_s=60)["pid"])

    def returncode(self, pid: int) -> int | None:
        while self._read(0):
            pass
        return self.exited.get(pid)


class _ForkedWorker:
    """What ``_run_workers`` uses of a ``subprocess.Popen``, for a worker the zygote forked."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        import time

        while self.poll() is None:
            time.sleep(0.02)
        return self.returncode


def run_python(argv: list[str], *, cwd: Path | str | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python ARGV`` (a program or ``-m MODULE``, then its arguments) in this process's environment, output
    captured as text, bounded by ``timeout_s``: forked from the zygote where there is one, else an interpreter of
    its own."""
    import tempfile
    import time

    cwd, env = str(cwd or os.getcwd()), dict(os.environ)
    cmd = [sys.executable, *argv]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        worker = _Zygote.fork(list(argv), Path(cwd), env, out, err)
        if worker is not None:
            deadline = time.monotonic() + timeout_s
            while worker.poll() is None:
                if time.monotonic() > deadline:
                    worker.kill()
                    worker.wait()
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
                time.sleep(0.01)
            texts = [Path(path).read_text() if os.path.exists(path) else "" for path in (out, err)]
            return subprocess.CompletedProcess(cmd, worker.returncode, *texts)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout_s)


def pytest_sessionfinish(session, exitstatus) -> None:
    _Zygote.close()


# [Note: workers without torchrun's agent]
# Without restarts, ``run_torchrun`` starts the workers itself, with the environment
# torchrun's static rendezvous gives them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
# GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
# TORCHELASTIC_USE_AGENT_STORE), and the test process holds the TCPStore torchrun's agent
# would hold, where the workers meet as under torchrun. A launch then imports torch once
# per worker and not once more for the agent, which on 2 cores is about 1.4 s of each of
# the suite's hundred-odd launches. As torchrun's agent does, the first worker to fail
# stops the others (SIGTERM, then SIGKILL after 30 s), and the run's exit status is then
# 1. torchrun itself runs every test with restarts (tests/test_elastic.py,
# tests/test_checkpoint.py), the launch files' tests and the README demo (``launch.sh``);
# HETPAR_TEST_TORCHRUN=1 runs every launch under torchrun. The workers are forked from a
# process that has imported torch already ([Note: workers forked from a zygote] in
# tests/zygote.py); HETPAR_TEST_ZYGOTE=0 starts each as its own interpreter.
def _run_workers(program: Path, nproc: int, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    import signal
    import tempfile
    import time

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's
    port = store.port
    cmd = [sys.executable, str(program), *args]
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            workers = []
            for rank in range(nproc):
                env = {**subprocess_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
                       "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                       "TORCHELASTIC_USE_AGENT_STORE": "True"}
                argv = [str(program), *args]
                if not workers:  # the first worker decides: all forked, or none
                    worker = _Zygote.fork(argv, program.parent, env, out_path, err_path)
                elif isinstance(workers[0], _ForkedWorker):
                    worker = workers[0].zygote.start(argv, program.parent, env, out_path, err_path)
                else:
                    worker = None
                workers.append(worker or subprocess.Popen(cmd, cwd=program.parent, env=env, stdout=out, stderr=err,
                                                          text=True))
            deadline, kill_at = time.monotonic() + timeout_s, None
            try:
                while any(w.poll() is None for w in workers):
                    now = time.monotonic()
                    if now > deadline:
                        raise subprocess.TimeoutExpired(cmd, timeout_s)
                    if kill_at is None and any(w.returncode not in (None, 0) for w in workers):
                        kill_at = now + 30
                        for w in workers:
                            if w.poll() is None:
                                w.send_signal(signal.SIGTERM)
                    if kill_at is not None and now > kill_at:
                        for w in workers:
                            if w.poll() is None:
                                w.kill()
                    time.sleep(0.05)
            finally:
                for w in workers:
                    if w.poll() is None:
                        w.kill()
                        w.wait()
        code = 0 if all(w.returncode == 0 for w in workers) else 1
        del store
        with open(out_path) as out, open(err_path) as err:
            return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


def run_torchrun(program: Path, nproc: int, args: list[str], *, timeout_s: float = TORCHRUN_TIMEOUT_S,
                 max_restarts: int = 0) -> subprocess.CompletedProcess:
    """Run ``program`` on ``nproc`` workers of this host, as torchrun runs it; its working
    directory is the program's. See [Note: workers without torchrun's agent].

    With restarts, under torchrun, whose rendezvous is then c10d's (each restart a new
    round, so the workers of a restart never read the addresses of the workers they
    replace).
    """
    if not max_restarts and not os.environ.get("HETPAR_TEST_TORCHRUN"):
        return _run_workers(program, nproc, args, timeout_s)
    torchrun = Path(sys.executable).with_name("torchrun")
    if max_restarts:
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--max-restarts={max_restarts}",
                      "--monitor-interval=0.2"]
    else:
        rendezvous = ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    cmd = [str(torchrun), f"--nproc_per_node={nproc}", *rendezvous, str(program), *args]
    return subprocess.run(cmd, cwd=program.parent, env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture
def gpt_path() -> Path:
    return ROOT / "examples" / "gpt.py"


@pytest.fixture
def model_copy(tmp_path, gpt_path) -> Path:
    """A private copy of examples/gpt.py that a test may change."""
    path = tmp_path / "src" / "gpt.py"
    path.parent.mkdir()
    shutil.copyfile(gpt_path, path)
    return path


@pytest.fixture
def mlp_path() -> Path:
    return ROOT / "examples" / "mlp.py"
