"""Differentiable collectives for context parallelism over one process group.

Each collective is an autograd Function whose backward is the dual communication, returns new
tensors (inputs are never modified) and takes `group` last. They work over NCCL with CUDA tensors
and over gloo with CPU tensors; over gloo, CUDA tensors are staged through host memory because gloo
cannot move device memory for all-to-all and point-to-point.

Shape legend: B batch, s local sequence, S = P*s global sequence, P group size, D features per
head group, C conv channels, K/V state dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _needs_host_staging(t: torch.Tensor, group: ProcessGroup) -> bool:
    return t.is_cuda and dist.get_backend(group) == "gloo"


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group: ProcessGroup) -> torch.Tensor:
    if _needs_host_staging(inp, group):
        host_out = out.new_empty(out.shape, device="cpu")
        dist.all_to_all_single(host_out, inp.cpu(), out_splits, in_splits, group=group)
        return host_out.to(out.device)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    return out


# ---------------------------------------------------------------------------------------------
# Ulysses: sequence shard <-> head shard
# ---------------------------------------------------------------------------------------------


def _seq_to_head(x_BsPD: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    B, s, P, D = x_BsPD.shape
    send = x_BsPD.permute(2, 0, 1, 3).contiguous()  # [P dest, B, s, D]
    recv = _all_to_all(torch.empty_like(send), send, None, None, group)  # [P src = seq chunk, B, s, D]
    return recv.permute(1, 0, 2, 3).reshape(B, P * s, D)


def _head_to_seq(y_BSD: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    B, S, D = y_BSD.shape
    P = dist.get_world_size(group)
    send = y_BSD.reshape(B, P, S // P, D).transpose(0, 1).contiguous()  # [P dest = seq chunk, B, s, D]
    recv = _all_to_all(torch.empty_like(send), send, None, None, group)  # [P src = head group, B, s, D]
    return recv.permute(1, 2, 0, 3)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BsPD, group):
        ctx.group = group
        return _seq_to_head(x_BsPD, group)

    @staticmethod
    def backward(ctx, grad_BSD):
        return _head_to_seq(grad_BSD.contiguous(), ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_BSD, group):
        ctx.group = group
        return _head_to_seq(y_BSD, group)

    @staticmethod
    def backward(ctx, grad_BsPD):
        return _seq_to_head(grad_BsPD.contiguous(), ctx.group), None


def all_to_all_seq_to_head(x_BsPD: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[B, s, P, D] (local tokens, features grouped by destination rank) -> [B, S, D] (all tokens, my group).

    Backward: all_to_all_head_to_seq of the gradient.
    """
    return _SeqToHead.apply(x_BsPD, group)


def all_to_all_head_to_seq(y_BSD: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[B, S, D] (all tokens, my head group) -> [B, s, P, D] (my tokens, every rank's head group in rank order).

    Backward: all_to_all_seq_to_head of the gradient.
    """
    return _HeadToSeq.apply(y_BSD, group)


# ---------------------------------------------------------------------------------------------
# Halo: the `halo` tokens before each piece come from whoever holds the pieces before it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HaloPart:
    """One message of a halo exchange: tokens of row piece `source` that piece `dest` reads as left context.
    `peer`: the member at the other end; `slot`: the local slot (sender: of `source`, receiver: of `dest`);
    `offset`: where the tokens start (sender: inside its piece; receiver: inside the `halo` buffer); `length`."""

    peer: int
    slot: int
    source: int
    dest: int
    offset: int
    length: int


def halo_routes(pieces, halo: int) -> tuple[list[HaloPart], list[HaloPart]]:
    """The halo messages of one member of a sequence group (`parallel.placement.Pieces`): each local piece's last
    tokens sent to the holders of the pieces whose `halo`-token left context they fall in, and each local piece's
    left context received from the holders of the pieces before it (the row's first pieces receive nothing for the
    positions before the row: zeros). A halo of at most one piece's tokens is one message from the previous piece;
    a longer one (a sliding window longer than a piece) reads ceil(halo / piece length) pieces back, the farthest
    in part. Both lists sorted by (peer, source, dest): a pair of members orders the messages between them alike on
    both sides."""
    n = pieces.piece_length
    if halo < 0 or n < 1:
        raise ValueError(f"a halo of {halo} tokens over pieces of {n} tokens")
    back = -(-halo // n)  # pieces a halo reaches back

    def part(j: int) -> tuple[int, int]:  # (tokens, offset in the halo buffer) from the j-th piece back
        length = min(n, halo - (j - 1) * n)
        return length, max(halo - j * n, 0)

    sends, recvs = [], []
    for slot, piece in enumerate(pieces.positions):
        for j in range(1, back + 1):
            length, at = part(j)
            if piece + j < pieces.total:
                sends.append(HaloPart(pieces.holder(piece + j)[0], slot, piece, piece + j, n - length, length))
            if piece - j >= 0:
                recvs.append(HaloPart(pieces.holder(piece - j)[0], slot, piece - j, piece, at, length))
    order = lambda r: (r.peer, r.source, r.dest)  # noqa: E731
    return sorted(sends, key=order), sorted(recvs, key=order)


def _route(parts: list[torch.Tensor], sends: list[HaloPart], recvs: list[HaloPart], like: torch.Tensor,
           group: ProcessGroup) -> list[torch.Tensor]:
    """One all-to-all-v: parts[i] ([length, ...]) to sends[i].peer (sorted by peer), one part of recvs[i].length
    tokens, shaped like `like` past dim 0, from each recvs[i].peer (sorted by peer; a member may appear in both,
    itself included)."""
    size = dist.get_world_size(group)
    in_splits = [sum(r.length for r in sends if r.peer == j) for j in range(size)]
    out_splits = [sum(r.length for r in recvs if r.peer == j) for j in range(size)]
    send = torch.cat(parts) if parts else like[:0]
    recv = like.new_empty((sum(out_splits), *like.shape[1:]))
    recv = _all_to_all(recv, send.contiguous(), out_splits, in_splits, group)
    return list(recv.split([r.length for r in recvs])) if recvs else []


class _Halo(torch.autograd.Function):
    """Forward: every local piece's left halo [slots, B, halo, C] (zeros before the row's start). Backward: each
    halo part's gradient goes back to the tokens it came from (the dual all-to-all), summed where one token went to
    several pieces' halos."""

    @staticmethod
    def forward(ctx, x_BsC, halo, group, pieces):
        ctx.group, ctx.halo, ctx.seq, ctx.pieces = group, halo, x_BsC.shape[1], pieces
        sends, recvs = halo_routes(pieces, halo)
        start = [pieces.local(slot).start for slot in range(len(pieces.positions))]
        tails = [x_BsC[:, start[r.slot] + r.offset:start[r.slot] + r.offset + r.length].transpose(0, 1)
                 for r in sends]  # [length, B, C]
        like = x_BsC.new_empty((0, x_BsC.shape[0], x_BsC.shape[2]))
        got = _route(tails, sends, recvs, like, group)
        left = x_BsC.new_zeros((len(pieces.positions), x_BsC.shape[0], halo, x_BsC.shape[2]))
        for r, h in zip(recvs, got):
            left[r.slot, :, r.offset:r.offset + r.length] = h.transpose(0, 1)
        return left

    @staticmethod
    def backward(ctx, grad_kBhC):
        pieces = ctx.pieces
        sends, recvs = halo_routes(pieces, ctx.halo)
        parts = [grad_kBhC[r.slot, :, r.offset:r.offset + r.length].transpose(0, 1) for r in recvs]
        like = grad_kBhC.new_empty((0, grad_kBhC.shape[1], grad_kBhC.shape[3]))
        back = _route(parts, recvs, sends, like, ctx.group)  # the dual: receivers send, senders receive
        grad_x = grad_kBhC.new_zeros(grad_kBhC.shape[1], ctx.seq, grad_kBhC.shape[3])
        for r, g in zip(sends, back):
            lo = pieces.local(r.slot).start + r.offset
            grad_x[:, lo:lo + r.length] += g.transpose(0, 1)
        return grad_x, None, None, None


def halo_exchange(x_BsC: torch.Tensor, halo: int, group: ProcessGroup, pieces) -> torch.Tensor:
    """The `halo` tokens before each of this member's pieces (`parallel.placement.Pieces` over `group`),
    [slots, B, halo, C], wherever they live: the previous pieces' last tokens (zeros before the row's first
    piece: causal left padding), reaching back over several pieces when the halo is longer than one (a sliding
    window's K/V). One all-to-all-v; contiguous with a halo of at most a piece, one message from each rank to the
    next.

    Backward: each halo part's gradient lands on the tokens it came from (summed over the halos that read them).
    """
    return _Halo.apply(x_BsC, halo, group, pieces)


# a causal conv's left context is the (kernel - 1) * dilation pre-conv tokens before each piece (the conv halo)
conv_halo_exchange = halo_exchange


# ---------------------------------------------------------------------------------------------
# State P2P: H_out travels to the next rank, dH_in back (the algorithm is in parallel/p2p.py)
# ---------------------------------------------------------------------------------------------


class StatePassing:
    """Point-to-point state traffic of one P2P layer on one rank.

    Every rank posts its receive from rank-1 after the layer's collectives and checks, sends to rank+1 as
    soon as `M @ H_in + S` exists, and defers waiting on its sends (their buffers are kept here until then).
    `group` should be a group that carries no collective (`dedicated_cp_groups`).

    `schedule`: "chain" (the P - 1 hops above) or "scan" (`parallel/scan.py`: ceil(log2 P) rounds of `exchange`).
    """

    SCHEDULES = ("chain", "scan")

    @staticmethod
    def check_schedule(schedule: str) -> str:
        if schedule not in StatePassing.SCHEDULES:
            raise ValueError(f"state_passing={schedule!r} is not supported; expected one of {StatePassing.SCHEDULES}")
        return schedule

    def __init__(self, group: ProcessGroup, schedule: str = "chain"):
        self.group = group
        self.schedule = self.check_schedule(schedule)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.is_first = self.rank == 0
        self.is_last = self.rank == self.size - 1
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.log: list[str] | None = None  # when a list, every message is appended ("send fwd ->1", ...)

    # -- primitives ------------------------------------------------------------------------------
    def send(self, t: torch.Tensor, peer: int, what: str) -> None:
        with torch.profiler.record_function(f"deltacp::send {what}"):
            buf = t.cpu() if _needs_host_staging(t, self.group) else t.contiguous()
            work = dist.isend(buf, group=self.group, group_dst=peer)
        self._pending_sends.append((work, buf))
        if self.log is not None:
            self.log.append(f"send {what} ->{peer}")

    def post_recv(self, like: torch.Tensor, peer: int, what: str) -> "PendingRecv":
        staged = _needs_host_staging(like, self.group)
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu" if staged else like.device)
        if self.log is not None:
            self.log.append(f"recv {what} <-{peer}")
        return PendingRecv(dist.irecv(buf, group=self.group, group_src=peer), buf, like.device, what)

    def wait_sends(self) -> None:
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    # -- scan rounds (parallel/scan.py) --------------------------------------------------------------
    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], what: str
                 ) -> list[torch.Tensor]:
        """One round of a state scan: each (tensor, peer) of `sends` sent, one tensor like each (buffer, peer) of
        `recvs` received, all posted together as one batch_isend_irecv (one NCCL group call, so none can wait on
        another), then waited for. At most one message each way per peer (a pair's messages match by order).
        Returns the received tensors on their buffers' devices, in `recvs` order. Nothing stays pending: the send
        buffers are free when this returns."""
        for name, pairs in (("send", sends), ("receive", recvs)):
            peers = [peer for _, peer in pairs]
            if len(set(peers)) != len(peers):
                raise RuntimeError(f"state scan round {what}: two messages to {name} with one peer ({peers})")
        ops, received = [], []
        for t, peer in sends:
            buf = t.detach().cpu() if _needs_host_staging(t, self.group) else t.detach().contiguous()
            ops.append(dist.P2POp(dist.isend, buf, group=self.group, group_peer=peer))
            if self.log is not None:
                self.log.append(f"send {what} ->{peer}")
        for like, peer in recvs:
            staged = _needs_host_staging(like, self.group)
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu") if staged else like
            received.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer))
            if self.log is not None:
                self.log.append(f"recv {what} <-{peer}")
        if ops:
            with torch.profiler.record_function(f"deltacp::exchange {what}"):
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        return [buf.to(like.device) for buf, (like, _) in zip(received, recvs)]


class PendingRecv:
    def __init__(self, work: dist.Work, buf: torch.Tensor, device: torch.device, what: str = "H_in"):
        self.work, self.buf, self.device, self.what = work, buf, device, what

    def wait(self) -> torch.Tensor:
        with torch.profiler.record_function(f"deltacp::wait {self.what}"):
            self.work.wait()
            return self.buf.to(self.device)


def in_backward_pass() -> bool:
    # A forward that runs while the autograd engine executes a backward is a checkpoint recompute.
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------------------------
# Summary all-gather
# ---------------------------------------------------------------------------------------------


def _summed(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum of every rank's x (not differentiable: the autograd Functions' part), where it was summed: in host
    memory for a CUDA tensor over gloo (`_needs_host_staging`), so that a caller moves back only what it keeps."""
    total = x.detach().cpu() if _needs_host_staging(x, group) else x.detach().clone()
    dist.all_reduce(total, group=group)
    return total


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        staged = _needs_host_staging(x, group)
        src = x.detach().cpu() if staged else x.detach().contiguous()
        parts = [torch.empty_like(src) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, src, group=group)
        return torch.stack(parts).to(x.device)

    @staticmethod
    def backward(ctx, grad_P):
        # Every rank's copy of slot r feeds rank r's gradient: sum over ranks, keep my slot.
        return _summed(grad_P, ctx.group)[dist.get_rank(ctx.group)].to(grad_P.device), None


def all_gather_autograd(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[...] -> [P, ...], every rank's x in rank order.

    Backward: sum of the gradients over ranks, each rank keeping its own slot (a reduce-scatter).
    """
    return _AllGather.apply(x, group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _summed(x, group).to(x.device)

    @staticmethod
    def backward(ctx, grad):
        # every rank reads the same sum: each summand's gradient is the sum of the ranks' gradients of it
        return _summed(grad, ctx.group).to(grad.device), None


def all_reduce_autograd(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum of every rank's x (each rank gets it: Mamba1's x_proj partial products over channel shards).

    Backward: the sum of the ranks' gradients of that sum (all-reduce again)."""
    return _AllReduce.apply(x, group)


# ---------------------------------------------------------------------------------------------
# Sequence all-gather (full attention KV) and the ring (full attention KV blocks)
# ---------------------------------------------------------------------------------------------


def _gather_seq(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's x concatenated along `dim` in rank order (not differentiable: the autograd Functions' forward)."""
    staged = _needs_host_staging(x, group)
    src = (x.detach().cpu() if staged else x.detach()).movedim(dim, 0).contiguous()
    size = dist.get_world_size(group)
    out = src.new_empty((size * src.shape[0], *src.shape[1:]))
    if dist.get_backend(group) == "gloo":
        parts = list(out.chunk(size))
        dist.all_gather(parts, src, group=group)
        out = torch.cat(parts)
    else:
        dist.all_gather_into_tensor(out, src, group=group)
    return out.movedim(0, dim).to(x.device)


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather_seq(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        group, dim = ctx.group, ctx.dim
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        staged = _needs_host_staging(grad, group)
        g = (grad.detach().cpu() if staged else grad.detach()).movedim(dim, 0).contiguous()
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: all-reduce, keep my slot
            dist.all_reduce(g, group=group)
            mine = g.chunk(size)[rank]
        else:
            mine = g.new_empty((g.shape[0] // size, *g.shape[1:]))
            dist.reduce_scatter_tensor(mine, g, group=group)
        return mine.movedim(0, dim).contiguous().to(grad.device), None, None


def all_gather_seq_autograd(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's x concatenated along `dim` in rank order (e.g. [B, s, H, D] -> [B, P*s, H, D]).

    Backward: reduce-scatter of the gradient along `dim` (over gloo: all-reduce, each rank keeping its slice).
    """
    return _AllGatherSeq.apply(x, dim, group)


class _AllGatherSeqReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.rank, ctx.size = dim, dist.get_rank(group), dist.get_world_size(group)
        return _gather_seq(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def all_gather_seq_replicated(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's x concatenated along `dim` in rank order, for a function that every rank then computes
    identically on the whole (the same loss of gathered per-token values on every rank of a CP group).

    Backward: this rank's slice of the gradient along `dim`, no communication. Every rank holds the same gradient of
    the whole, so each keeps what belongs to its own x; summing the copies over ranks (`all_gather_seq_autograd`'s
    reduce-scatter) would count the one loss once per rank.
    """
    return _AllGatherSeqReplicated.apply(x, dim, group)


class RingPassing:
    """Point-to-point traffic of a ring over `group` (a group that carries nothing else: `dedicated_cp_groups`).

    `exchange(t)` sends t to rank+1 and receives the same shape from rank-1 (modulo the group size), as one batched
    isend/irecv pair: on NCCL the pair is one group call, so the cycle of sends around the ring cannot deadlock.
    Every rank calls `exchange` the same number of times in the same order.
    """

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.log: list[str] | None = None

    def exchange(self, t: torch.Tensor, what: str = "kv") -> "PendingRing":
        staged = _needs_host_staging(t, self.group)
        send = t.detach().cpu() if staged else t.detach().contiguous()
        recv = torch.empty_like(send)
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [dist.P2POp(dist.isend, send, group=self.group, group_peer=nxt),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=prv)]
        if self.log is not None:
            self.log.append(f"ring {what} ->{nxt} <-{prv}")
        with torch.profiler.record_function(f"deltacp::ring {what}"):
            works = dist.batch_isend_irecv(ops)
        return PendingRing(works, send, recv, t.device)


class PendingRing:
    def __init__(self, works, send, recv, device):
        self.works, self.send, self.recv, self.device = works, send, recv, device

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.send = None
        return self.recv.to(self.device)


def all_gather_tokens(x_BS: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, s] int64 on every rank -> [B, S] (rank order); through host memory over gloo. Not differentiable: for
    token ids, positions and masks."""
    src = x_BS.cpu() if dist.get_backend(group) == "gloo" else x_BS.contiguous()
    parts = [torch.empty_like(src) for _ in range(cp)]
    dist.all_gather(parts, src.contiguous(), group=group)
    return torch.cat(parts, dim=1).to(x_BS.device)


def max_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """The largest value of a 0-dim tensor over the ranks of `group`, on x's device (through host memory over
    gloo). Not differentiable: for positions and counts."""
    src = x.detach().reshape(1)
    src = src.cpu() if dist.get_backend(group) == "gloo" else src.clone()
    dist.all_reduce(src, op=dist.ReduceOp.MAX, group=group)
    return src.to(x.device).reshape(())
