"""Ring attention over ``torch.distributed``: a sequence too long for one device, sharded.

>>> # on each of P ranks (torchrun), with Q, K, V the full [..., H, N, d] tensors:
>>> # q, k, v = (shard(x, rank, P, "zigzag") for x in (Q, K, V))
>>> # o = ring_attention(q, k, v, is_causal=True, layout="zigzag")   # this rank's [..., H, N/P, d]
>>> # O = unshard(all_gathered_o, "zigzag")                            # if the full output is wanted

Dropout (``dropout_p``, ``generator``) and attention sinks (``sinks``) work
as in `attngrad.attention`: the ranks drop with rank 0's draw of the mask's
seed at global positions, so the result is the gathered call's under the
same seed; a sink is merged once per row, and a shared sink's gradient is
summed over the ranks by the caller (``dist.all_reduce``), like any
parameter's.

``scheme="all_to_all"`` shards by heads instead (DeepSpeed-Ulysses): an
all-to-all trades the sequence shards for H/P whole heads per rank, plain
`attngrad.attention` runs there with every keyword and derivative, and the
output is traded back (`attngrad.ring.all_to_all`).

`layout` cuts and reassembles the shards, `comm` moves the blocks (with a
timeout), `checks` validates the shards on each rank and across the ring,
`attention` computes: forward, backward and the public `ring_attention`;
`all_to_all` is the other scheme (and `packed_ring_attention`, packed documents
through it); `flex` runs `attngrad.flex_attention` through either scheme
(`flex_ring_attention`: a score_mod and a BlockMask; `shifted` and `flex_pairs` put them
at a local call's global heads or positions); `balance.balanced_layout`
balances the ring's work under a block-sparse mask, step by step.
"""

from attngrad.ring.all_to_all import packed_ring_attention
from attngrad.ring.attention import BLOCK_STRATEGIES, ring_attention
from attngrad.ring.balance import balanced_layout, rank_pairs, rank_work
from attngrad.ring.comm import DEFAULT_TIMEOUT, RingTimeoutError
from attngrad.ring.flex import flex_ring_attention
from attngrad.ring.layout import LAYOUTS, shard, unshard

__all__ = [
    "BLOCK_STRATEGIES",
    "DEFAULT_TIMEOUT",
    "LAYOUTS",
    "RingTimeoutError",
    "balanced_layout",
    "flex_ring_attention",
    "packed_ring_attention",
    "rank_pairs",
    "rank_work",
    "ring_attention",
    "shard",
    "unshard",
]
