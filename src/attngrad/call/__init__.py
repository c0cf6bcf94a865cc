"""One attention call, built once and run eagerly or through torch.compile's custom ops.

`Call` (`attngrad.call.call`) holds a validated `attngrad.attention` call:
its sizes, strategy, scale, score modifiers, dropout, sinks, tile sizes.
`attngrad.call.eager.run` applies the strategy's autograd.Function to it;
`attngrad.call.compiled.run` hands it to the two opaque ops that
torch.compile traces.
"""

from __future__ import annotations

from attngrad.call.call import Call

__all__ = ["Call"]
