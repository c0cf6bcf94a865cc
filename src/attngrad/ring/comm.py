"""The ring's messages: non-blocking sends to the next rank, receives from the previous one;
and the collectives both schemes use (all_gather, broadcast, all-to-all, agreeing on flags).

Every wait has a deadline (`RingComm.timeout` seconds, passed to
``Work.wait(timeout=...)``); a message that does not arrive in time, or a
connection that breaks because a peer died, raises `RingTimeoutError` naming
this rank, the peer and the timeout, instead of hanging.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from attngrad.core.dropout import Dropout, draw_seed

__all__ = [
    "DEFAULT_TIMEOUT",
    "Exchange",
    "RingComm",
    "RingTimeoutError",
    "shared_dropout",
]

# Seconds one ring step may wait on a peer.  A step moves one k/v block
# (backward: k/v and dk/dv) while computing on another: seconds on a CPU even
# at N = 10^5, so a minute only trips on a dead, hung or missing peer.
DEFAULT_TIMEOUT = 60.0


class RingTimeoutError(RuntimeError):
    """A ring step did not complete within the timeout: a peer died, hangs or never called."""


class Exchange:
    """Messages in flight: `wait` returns the received tensors once every send and receive is done."""

    def __init__(
        self,
        comm: RingComm,
        works: list[dist.Work],
        sent: list[torch.Tensor],
        received: list[torch.Tensor],
    ):
        # the sent tensors stay referenced until their sends complete
        self._comm, self._works, self._sent, self._received = comm, works, sent, received

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            self._comm.wait(work, "sending to / receiving from its ring neighbours")
        self._works, self._sent = [], []  # a finished work still holds its tensors
        return self._received


class RingComm:
    """This rank's place in the ring of ``group``: rank r sends to r+1 and receives from r-1.

    Every rank must post the same sequence of exchanges: each message gets the
    next tag of a counter, so tags match across ranks and messages in flight
    at the same time never mix.
    """

    def __init__(self, group: dist.ProcessGroup, timeout: float):
        self.group, self.timeout = group, timeout
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self._tag = 0

    def wait(self, work: dist.Work, what: str) -> None:
        """``work.wait`` with the deadline; a failure becomes `RingTimeoutError`."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self._error(what, e) from e

    def _error(self, what: str, cause: BaseException) -> RingTimeoutError:
        return RingTimeoutError(
            f"ring_attention on rank {self.rank} of {self.world}: {what} did not complete "
            f"within timeout={self.timeout:g} s (previous rank {self._prev}, next rank "
            f"{self._next}): {cause}. A peer died, hangs, or never called ring_attention; "
            "check the other ranks' logs, or pass a larger timeout= if a step is that slow."
        )

    def send_recv(self, tensors: Sequence[torch.Tensor]) -> Exchange:
        """Send ``tensors`` to the next rank, receive as many of the same shapes from the previous.

        The sends and receives go out as one batch (`dist.batch_isend_irecv`):
        NCCL then posts them together, which it needs when the next and the
        previous rank are the same peer (P = 2) and both send first.
        """
        ops: list[dist.P2POp] = []
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        for sent, into in zip(tensors, received, strict=True):
            ops.append(dist.P2POp(dist.isend, sent, self._next, self.group, self._tag))
            ops.append(dist.P2POp(dist.irecv, into, self._prev, self.group, self._tag))
            self._tag += 1
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:  # a broken connection fails at posting already
            raise self._error("posting a send or receive", e) from e
        return Exchange(self, works, list(tensors), received)

    def all_gather(
        self, t: torch.Tensor, what: str = "gathering the shard shapes"
    ) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on all), in rank order."""
        out = [torch.empty_like(t) for _ in range(self.world)]
        t = t.contiguous()
        self._collective(lambda: dist.all_gather(out, t, group=self.group, async_op=True), what)
        return out

    def any(self, flags: Sequence[bool], device: torch.device, what: str) -> tuple[bool, ...]:
        """Each flag or-ed over the ranks (gathered on ``device``, the tensors' own): what
        every rank must do alike where some rank needs it (which tensors travel)."""
        mine = torch.tensor([bool(f) for f in flags], dtype=torch.uint8, device=device)
        gathered = torch.stack(self.all_gather(mine, what)).amax(0).cpu()
        return tuple(bool(f) for f in gathered.tolist())

    def all_to_all(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """Each t: [P, ...] (the same shapes on every rank): piece i goes to rank i; returns
        one [P, ...] per t whose piece i came from rank i (``dist.all_to_all_single``), every
        one posted before the first wait: their transfers overlap."""
        sends = [t.contiguous() for t in ts]
        outs = [torch.empty_like(t) for t in sends]
        trade = functools.partial(dist.all_to_all_single, group=self.group, async_op=True)
        works = [
            self._post(functools.partial(trade, out, t), what)
            for out, t in zip(outs, sends, strict=True)
        ]
        for work in works:
            self.wait(work, what)
        return outs

    def broadcast(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Group rank 0's ``t`` on every rank (written into ``t``, which is returned)."""
        src = dist.get_global_rank(self.group, 0)
        self._collective(lambda: dist.broadcast(t, src, group=self.group, async_op=True), what)
        return t

    def _collective(self, post: Callable[[], dist.Work | None], what: str) -> None:
        """Post one asynchronous collective and wait for it with the deadline."""
        self.wait(self._post(post, what), what)

    def _post(self, post: Callable[[], dist.Work | None], what: str) -> dist.Work:
        """Post one asynchronous collective; its Work."""
        try:
            work = post()
        except RuntimeError as e:  # a broken connection fails at posting already
            raise self._error(what, e) from e
        assert work is not None  # async_op=True always returns a Work
        return work


def shared_dropout(
    comm: RingComm, dropout_p: float, device: torch.device, generator: torch.Generator | None
) -> Dropout | None:
    """The call's dropout, one on every rank: each rank draws (seed, offset), rank 0's is used.

    Each rank's generator advances by the one draw `attention` makes, so ranks
    seeded alike stay alike; the broadcast makes the mask one even when they are not.
    """
    if dropout_p == 0:
        return None
    words = torch.tensor(draw_seed(device, generator), dtype=torch.int64, device=device)
    seed, offset = comm.broadcast(words, "sharing the dropout seed").tolist()
    return Dropout(float(dropout_p), int(seed), int(offset))
