"""The tensor-parallel group: rendezvous over a TCPStore, and the collectives the model uses.

A `ProcessGroupGloo` is built directly from the store instead of through
`torch.distributed.init_process_group`, so an engine never touches the process-global default
group: a user's own torch.distributed setup is left alone and one process can start several
engines in turn. Rank 0 (the driver) hosts the store."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from kvflow import envs
from kvflow.config import parse_init_method  # noqa: F401 - re-exported for the executor and nodes

# Collectives wait as long as they must: idle workers sit in the step broadcast for as long as
# the server is idle. A dead peer is noticed at once anyway (its sockets close), and the
# executor's watchdog kills the survivors so that nothing waits on a rank that is gone.
COLLECTIVE_TIMEOUT = timedelta(days=3650)


def rendezvous_timeout() -> timedelta:
    """How long a rank may take to reach the store (other nodes may start after the first one)."""
    return timedelta(seconds=envs.KVFLOW_DIST_TIMEOUT)

# The step broadcast sends one fixed-size frame; longer messages follow in a second one.
_FRAME_BYTES = 1 << 16
_LEN = 8


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (127.0.0.1 for a loopback host): what
    gloo must listen on so that the other ranks can reach it. A UDP connect sends nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class Rendezvous:
    """The TCPStore the ranks meet at. The driver serves it on `host:port` only (port 0: a
    free one), not on every interface as TCPStore would by itself; the others connect."""

    def __init__(self, host: str, port: int, world_size: int, is_master: bool) -> None:
        self.host = host
        self._sock: socket.socket | None = None
        if is_master:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self._sock.bind((host, port))
            except OSError as e:
                self._sock.close()
                raise OSError(f"cannot listen on {host}:{port} for the tensor-parallel "
                              f"rendezvous: {e.strerror}") from None
            port = self._sock.getsockname()[1]
        self.port = port
        self.store = dist.TCPStore(host, port, world_size, is_master, timeout=rendezvous_timeout(),
                                   wait_for_workers=False,
                                   master_listen_fd=self._sock.fileno() if self._sock else None)
        if self._sock is not None:
            self._sock.detach()  # the store owns the listening socket now and closes it

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self.store = None


def rank_device(device: str, rank: int) -> torch.device:
    """The device a rank runs on: the CPU, or GPU `rank % device_count` of its machine (made
    the current one, as NCCL wants)."""
    if device != "cuda":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class CollectiveError(RuntimeError):
    """A collective failed: another rank closed its connection (it died or left the group)."""


@dataclass
class CommStats:
    """Time spent in collectives (waiting for the slowest rank included), by kind."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0
    seconds_by_op: dict[str, float] = field(default_factory=dict)


def gloo_group(rdv: Rendezvous, prefix: str, rank: int, world_size: int) -> dist.ProcessGroupGloo:
    """A gloo group of `world_size` ranks meeting under `prefix` in the rendezvous store."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = COLLECTIVE_TIMEOUT
    # Listen where the other ranks can reach us (loopback stays loopback), unless the user
    # picked an interface with GLOO_SOCKET_IFNAME.
    opts._devices = [dist.ProcessGroupGloo.create_default_device()
                     if os.environ.get("GLOO_SOCKET_IFNAME") else
                     dist.ProcessGroupGloo.create_device(hostname=local_address_towards(rdv.host))]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, rdv.store), rank, world_size, opts)


class TPGroup:
    """This process's rank in the tensor-parallel group, with the few collectives TP needs:
    all-reduce (row-parallel layers), gather to the driver (vocab-parallel logits) and the
    driver's per-step object broadcast."""

    def __init__(self, rdv: Rendezvous, rank: int, world_size: int, shm=None,
                 device: torch.device | str = "cpu", prefix: str = "tp") -> None:
        self.rank, self.world_size = rank, world_size
        self.shm = shm  # a ShmAllReduce when every rank is on this machine
        # gloo carries the step broadcast (host bytes) always, and the collectives on a CPU;
        # on a GPU the model's all-reduces and the logits gather go over NCCL.
        self.device = torch.device(device)
        self.nccl = None
        if self.device.type == "cuda":
            self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore(prefix + "-nccl", rdv.store), rank,
                                              world_size)
        self.pg = gloo_group(rdv, prefix, rank, world_size)
        self.stats = CommStats()
        self._frame = torch.empty(_FRAME_BYTES, dtype=torch.uint8)

    def _timed(self, op: str, run, nbytes: int) -> None:
        """Run one collective (`run` waits for it), counting its time; a peer that went away
        becomes a CollectiveError."""
        t0 = time.perf_counter()
        try:
            run()
        except RuntimeError as e:
            raise CollectiveError(str(e).split(". ")[0]) from None
        dt = time.perf_counter() - t0
        s = self.stats
        s.seconds += dt
        s.calls += 1
        s.bytes += nbytes
        s.seconds_by_op[op] = s.seconds_by_op.get(op, 0.0) + dt

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (through shared memory when it can)."""
        nbytes = t.numel() * t.element_size()
        if t.is_cuda:
            self._timed("all_reduce_nccl", lambda: self.nccl.allreduce([t]).wait(), nbytes)
        elif self.shm is not None and self.shm.fits(t):
            self._timed("all_reduce_shm", lambda: self.shm(t), nbytes)
        else:
            self._timed("all_reduce_gloo", lambda: self.pg.allreduce([t]).wait(), nbytes)
        return t

    def gather_to_driver(self, t: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `t` along the last dim on the driver; None elsewhere."""
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if t.is_cuda:  # NCCL: every rank gets the parts; only the driver keeps them
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self._timed("gather_nccl", lambda: self.nccl.allgather([parts], [t]).wait(), nbytes)
            return torch.cat(parts, dim=-1) if self.rank == 0 else None
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self._timed("gather", lambda: self.pg.gather([parts], [t], opts).wait(), nbytes)
            return torch.cat(parts, dim=-1)
        self._timed("gather", lambda: self.pg.gather([], [t], opts).wait(), nbytes)
        return None

    def broadcast_bytes(self, data: bytes | None = None) -> bytes:
        """The driver's `data` on every rank (one frame when it fits in 64 KiB). Bytes only:
        what they mean is decoded with a schema (kvflow.distributed.messages), never unpickled."""
        frame, buf = self._frame, self._frame.numpy()  # buf shares frame's memory
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.rank == 0:
            n = len(data)
            head = min(n, _FRAME_BYTES - _LEN)
            buf[:_LEN] = np.frombuffer(n.to_bytes(_LEN, "little"), dtype=np.uint8)
            buf[_LEN:_LEN + head] = np.frombuffer(data, dtype=np.uint8, count=head)
            self._timed("broadcast", lambda: self.pg.broadcast([frame], opts).wait(), _FRAME_BYTES)
            if n > head:
                rest = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=head).copy())
                self._timed("broadcast", lambda: self.pg.broadcast([rest], opts).wait(), n - head)
            return data
        self._timed("broadcast", lambda: self.pg.broadcast([frame], opts).wait(), _FRAME_BYTES)
        n = int.from_bytes(buf[:_LEN].tobytes(), "little")
        head = min(n, _FRAME_BYTES - _LEN)
        data = buf[_LEN:_LEN + head].tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            self._timed("broadcast", lambda: self.pg.broadcast([rest], opts).wait(), n - head)
            data += rest.numpy().tobytes()
        return data

    def close(self) -> None:
        # Dropping the process group closes its sockets; peers still waiting see them close.
        self.pg = None
        self.nccl = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
