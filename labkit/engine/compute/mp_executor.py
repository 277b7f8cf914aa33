"""Ranks as processes: one process per GPU, collectives over torch.distributed.

A worker process does nothing but `serve`: build its GPU's rank from the `RankPlan` the
driver (the process running the control plane) sends once, then, step after step,
receive one message (a rank operation and each GPU's arguments — for a forward pass,
its replica's `StepBatch` and copy-on-write pairs), run it on its rank, and send the
result back (only the last stage's logits are non-trivial). The model's collectives
inside the step go straight between the ranks (`DistGroup`); the driver is not in
their path.

Two ways to start:

- **spawned** (`Engine(..., executor="mp")`): the driver spawns one worker per GPU
  (`torch.multiprocessing`). The workers form a torch.distributed world of their own
  (rendezvous on a free 127.0.0.1 port); the driver joins none and talks to each worker
  over a pipe — as vLLM v1's engine core drives its multiprocess workers. So a driver
  holds any number of such engines at once: the prefill and decode groups of a P/D
  system each have their own world (`disagg.py`).
- **under torchrun** (`torchrun --nnodes N --nproc-per-node G -m labkit replay ...
  --executor mp`): every process runs `labkit replay`; RANK 0 drives and hosts GPU 0
  (it is rank 0 of the launched world), the others call `serve()` (init from RANK /
  WORLD_SIZE / MASTER_ADDR / MASTER_PORT). Messages travel on a gloo group of their
  own (`broadcast_object_list` / `gather_object`), so that they also work when the
  model's collectives run over NCCL. One engine per launch.

A layout of one GPU (spawned) starts no worker and no group: its GPU lives in the driver.

Failure: a worker that dies makes the driver raise `WorkerDied`, one line naming the
GPU and how it died, within `LABKIT_MP_TIMEOUT_S` (default 300 s; a closed pipe or
connection is noticed at once), and the driver stops every other worker of that engine
— a watchdog thread kills them as soon as one exits, which also breaks the others out
of a pending collective. Spawned workers die with the driver (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from labkit.engine.compute.dist_group import DistGroup, SoloGroup
from labkit.engine.compute.executors import GROUP_KINDS, RankPlan, RemoteRanks
from labkit.engine.compute.mesh import Mesh
from labkit.errors import ConfigError

TIMEOUT_ENV = "LABKIT_MP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
JOIN_S = 10.0


class WorkerDied(RuntimeError):
    """A rank's process died or a collective failed; the run cannot continue."""


class _Failure:
    """What a worker sends back instead of a result when its operation raised."""

    def __init__(self, gpu: int, message: str) -> None:
        self.gpu, self.message = gpu, message


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun_rank() -> int:
    return int(os.environ["RANK"])


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


# -------------------------------------------------------------------- driver
class ProcessExecutor:
    name = "mp"

    def __init__(self, plan: RankPlan, mesh: Mesh) -> None:
        self.mesh, self.world_size = mesh, mesh.world_size
        self.procs: list = []  # spawned workers, procs[g] serves GPU g
        self._closing = False  # workers may exit now (the watchdog stands down)
        self._stopped = False
        self._dead: tuple | None = None  # (gpu, pid, exitcode) of the first worker to die
        plan.check()  # a bad checkpoint is refused before any worker starts
        local: dict[int, object] = {}
        if self.world_size == 1 and not under_torchrun():
            # one GPU lives in the driver: no worker, no group
            self.channel = None
            local[0] = plan.build(mesh.places[0], mesh, plan.source(), build_groups(mesh, 0))
        elif under_torchrun():
            self.channel = _GroupChannel(self._join_torchrun(), plan)
            local[0] = plan.build(mesh.places[0], mesh, plan.source(), build_groups(mesh, 0))
        else:
            self.channel = self._spawn(plan)
        self.local = local
        self.ranks = RemoteRanks(local, self.world_size)
        if self.channel is not None:
            atexit.register(self.close)  # workers stop with the driver even if never closed
            # every worker says when its rank is built: a failure shows here, not later
            self._call(lambda: self.channel.receive(dict.fromkeys(range(self.world_size))))

    def _join_torchrun(self) -> int:
        """Join the launched world as its rank 0 (which hosts GPU 0); its size."""
        rank, size = torchrun_rank(), int(os.environ["WORLD_SIZE"])
        if rank != 0:
            raise ConfigError(f"executor='mp' under torchrun: RANK {rank} serves the driver "
                              "(labkit.engine.compute.mp_executor.serve); only RANK 0 drives")
        if size != self.world_size:
            raise ConfigError(f"torchrun started {size} processes; layout "
                              f"{self.mesh.layout.text!r} needs {self.world_size} "
                              "(one per GPU)")
        if dist.is_initialized():
            raise ConfigError("executor='mp' under torchrun: this process already has a "
                              "torch.distributed group (one mp engine per launch)")
        self._threads = torch.get_num_threads()  # restored on close
        _share_cores(self.world_size)
        _use_local_gpu()
        self._call(lambda: dist.init_process_group(
            _backend(), init_method="env://", rank=0, world_size=size,
            timeout=timedelta(seconds=timeout_s())))
        return size

    def _spawn(self, plan: RankPlan) -> _PipeChannel:
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")  # (forkserver starts faster,
        # but a driver killed by SIGKILL leaves the server and its children running)
        conns = []
        for r in range(self.world_size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=serve, args=(r, self.world_size, init, theirs),
                            daemon=True, name=f"labkit-rank{r}")
            p.start()
            theirs.close()  # the worker's end: a dead worker then closes the pipe
            self.procs.append(p)
            conns.append(mine)
        threading.Thread(target=self._watch, daemon=True, name="labkit-mp-watchdog").start()
        channel = _PipeChannel(conns)
        self._call(lambda: channel.send(plan))
        return channel

    # ------------------------------------------------------------------ work
    def run(self, op, args_per_gpu: list[tuple], gpus: list[int]) -> list:
        """`op(rank, *args)` on each GPU of `gpus` (in its process); results in order."""
        work = dict(zip(gpus, args_per_gpu))
        if self.channel is None:  # one GPU, in this process
            return [op(self.local[0], *work[0])]
        self._call(lambda: self.channel.send(("run", op, work)))
        mine, error = {}, None
        for g in (g for g in self.local if g in work):
            try:
                mine[g] = op(self.local[g], *work[g])
            except Exception as err:  # noqa: BLE001 - re-raised after the replies
                error = err
        results = self._call(lambda: self.channel.receive(work))
        if error is not None:
            raise error
        for r in results.values():
            if isinstance(r, _Failure):
                raise RuntimeError(f"executor='mp': GPU {r.gpu} failed: {r.message}")
        results.update(mine)
        return [results[g] for g in gpus]

    def copy_kv(self, pairs: list[tuple[int, int]], src_blocks, dst_blocks) -> None:
        """Blocks of GPU gs's paged KV into GPU gd's: gs sends, gd receives."""
        gpus, args = [], []
        for gs, gd in pairs:
            gpus += [gs, gd]
            args += [(True, gd, src_blocks), (False, gs, dst_blocks)]
        self.run(move_blocks, args, gpus)

    def _call(self, fn):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - a broken group: say which rank died
            raise self._fail(err) from None

    def _fail(self, err: Exception) -> WorkerDied:
        dead = self._dead or self._first_dead()
        self._stop_workers()
        if dead is not None:
            gpu, pid, code = dead
            return WorkerDied(f"executor='mp': the worker process of GPU {gpu} (pid {pid}) "
                              f"died ({_describe_exit(code)}); the run is stopped")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return WorkerDied(f"executor='mp': a collective failed ({first}); the run is stopped")

    def _first_dead(self, wait_s: float = 2.0):
        """(gpu, pid, exit code) of a worker that has exited, waiting a little: a peer's
        socket can report the death before the dead process can be reaped."""
        deadline = time.monotonic() + wait_s
        while self.procs:
            dead = next(((g, p.pid, p.exitcode) for g, p in enumerate(self.procs)
                         if p.exitcode is not None), None)
            # The watchdog records the first death before killing the rest, so a worker
            # it killed is never taken for the one that died first.
            dead = self._dead or dead
            if dead is not None or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)
        return None

    # ----------------------------------------------------------- lifecycle
    def _watch(self) -> None:
        """Kill every worker as soon as one exits unasked: the driver's pending
        receive then fails at once instead of waiting for the timeout."""
        while not self._closing:
            for g, p in enumerate(self.procs):
                if p.exitcode is not None and not self._closing:
                    self._dead = (g, p.pid, p.exitcode)
                    for q in self.procs:
                        if q.exitcode is None:
                            q.kill()
                    return
            threading.Event().wait(0.1)

    def _stop_workers(self) -> None:
        if self._stopped:
            return
        self._stopped = self._closing = True
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join(JOIN_S)
        if isinstance(self.channel, _PipeChannel):
            self.channel.close()
        elif self.channel is not None:  # torchrun: this process is rank 0 of the world
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(self._threads)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._stopped or self.channel is None:
            self._stopped = self._closing = True
            return
        self._closing = True
        try:
            self.channel.send(("stop",))
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        for p in self.procs:
            p.join(JOIN_S)
        self._stop_workers()


class _PipeChannel:
    """Spawned workers: one pipe each; messages pickled whole (tensors by value)."""

    def __init__(self, conns: list) -> None:
        self.conns = conns  # conns[g]: GPU g's worker

    def send(self, message) -> None:
        data = pickle.dumps(message)
        for c in self.conns:
            c.send_bytes(data)

    def receive(self, work: dict) -> dict:
        """The results of the GPUs that had work (each answers once)."""
        out = {}
        for g in work:
            if not self.conns[g].poll(timeout_s()):
                raise TimeoutError(f"GPU {g} sent no answer within {timeout_s():.0f} s")
            out[g] = pickle.loads(self.conns[g].recv_bytes())
        return out

    def close(self) -> None:
        for c in self.conns:
            c.close()


class _GroupChannel:
    """Under torchrun: the driver is rank 0 of the world; messages go on a gloo group."""

    def __init__(self, world_size: int, plan: RankPlan) -> None:
        self.world_size = world_size
        self.group = dist.new_group(backend="gloo")
        self.send(plan)

    def send(self, message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self, work: dict) -> dict:
        results: list = [None] * self.world_size
        dist.gather_object(None, results, dst=0, group=self.group)
        return {g: results[g] for g in work if g != 0}


def build_groups(mesh: Mesh, me: int) -> dict:
    """Rank `me`'s groups. Every process creates every multi-rank group, in the same
    order (torch.distributed requires it), and keeps handles on its own."""
    tuples = sorted({getattr(place, f"{kind}_group") for place in mesh.places
                     for kind in GROUP_KINDS})
    pgs = {t: dist.new_group(list(t)) for t in tuples if len(t) > 1}
    place = mesh.places[me]
    out = {}
    for kind in GROUP_KINDS:
        t = getattr(place, f"{kind}_group")
        out[kind] = DistGroup(pgs[t], t, me) if len(t) > 1 else SoloGroup(me)
    return out


def move_blocks(rank, sending: bool, peer: int, blocks) -> None:
    """One side of a KV block copy between two processes (every layer, every cache
    tensor, in the same order on both sides)."""
    for layer in sorted(rank.kv.layers):
        for name in sorted(rank.kv.layers[layer]):
            t = rank.kv.layers[layer][name]
            index = torch.as_tensor(blocks, dtype=torch.long, device=t.device)
            if sending:
                dist.send(t[index].contiguous(), peer)
            else:
                part = t.new_empty((len(index),) + tuple(t.shape[1:]))
                dist.recv(part, peer)
                t[index] = part


# -------------------------------------------------------------------- worker
def serve(rank: int | None = None, world_size: int | None = None,
          init_method: str = "env://", conn=None) -> None:
    """A worker's life: join the world, build the rank the driver describes, run each
    message's operation until the driver says stop (or goes away). Spawned workers
    hear the driver on `conn` (a pipe); under torchrun, on the world's gloo group."""
    if conn is not None:
        _die_with_parent()
        os.environ["LOCAL_RANK"] = str(rank)  # one machine: GPU index = rank
    rank = torchrun_rank() if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    try:
        _use_local_gpu()
        _share_cores(world_size)
        dist.init_process_group(_backend(), init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s()))
        if conn is not None:
            def receive():
                return pickle.loads(conn.recv_bytes())

            def reply(result, asked: bool) -> None:
                if asked:
                    conn.send_bytes(pickle.dumps(result))
        else:
            ctrl, box = dist.new_group(backend="gloo"), [None]

            def receive():
                dist.broadcast_object_list(box, src=0, group=ctrl)
                return box[0]

            def reply(result, asked: bool) -> None:
                dist.gather_object(result, None, dst=0, group=ctrl)
        plan: RankPlan = receive()
        mesh = Mesh(plan.layout, plan.spec)
        local = plan.build(mesh.places[rank], mesh, plan.source(), build_groups(mesh, rank))
        reply(None, True)  # built
        while True:
            message = receive()
            if message[0] == "stop":
                break
            _, op, work = message
            result = None
            if rank in work:
                try:
                    result = _to_cpu(op(local, *work[rank]))
                except Exception as err:  # noqa: BLE001 - reported to the driver
                    result = _Failure(rank, f"{type(err).__name__}: {err}")
            reply(result, rank in work)
        dist.destroy_process_group()
        if conn is not None:  # nothing left to flush: skip the slow interpreter teardown
            os._exit(0)
    except (dist.DistError, RuntimeError, EOFError, OSError) as err:  # the driver or a
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"labkit rank {rank}: stopping ({line})", file=sys.stderr)  # peer went away
        os._exit(1)


# ----------------------------------------------------------------- helpers
def _backend() -> str:
    """gloo between CPU tensors, NCCL between CUDA tensors (one group, both)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _use_local_gpu() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def _share_cores(world_size: int) -> None:
    """Each process computes on its share of this machine's cores: torch's default (all
    of them, in every process) makes the processes' thread pools fight, ten times
    slower on a small machine."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent dies."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple (KDAState)
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
