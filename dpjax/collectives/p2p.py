"""Point-to-point sends: one call that moves a buffer along given (source, target) pairs.

A pipeline passes activations to the next stage and gradients to the previous one; that
is no collective over the whole axis, but it is sent the way every collective's steps
are: through the one point-to-point helper (`ranks.permute`). So an emulated slow link
charges it (`dpjax.links`: the call waits for its wire, Hockney's alpha-beta: latency +
bytes / bandwidth), and the compiled program names it
`dpjax:send(name=activations,axis=stage,n=S,bytes=B)` (`dpjax.scopes`), which a timeline
reads back as a call of its own on every device that runs it.
"""

from __future__ import annotations

import math

from dpjax import links, scopes
from dpjax.collectives.ranks import axis_size, permute


def send(x, axis_name, pairs, *, name: str = "send"):
    """`x` moved along `pairs` (source, target ranks of `axis_name`): each target gets its
    source's `x`, a rank no pair targets gets zeros (`lax.ppermute`). `name` says what is
    sent (a timeline shows it: "send activations stage")."""
    n = axis_size(axis_name, "send")
    nbytes = math.prod(x.shape) * x.dtype.itemsize
    with scopes.collective("send", name=name, axis=axis_name, n=n, bytes=nbytes):
        return _send(x, axis_name, pairs)


@links.timed
def _send(x, axis_name, pairs):
    return permute(x, axis_name, list(pairs))
