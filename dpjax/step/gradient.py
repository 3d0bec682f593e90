"""A worker's gradient inside the step's shard_map: how each device differentiates its
rows, how A micro-batches accumulate (A backward passes, one exchange) and how the
gradient is averaged over the worker's own devices before the rule exchanges it between
workers. Kept apart from the program builder (`dpjax.step.builder`) because this is the
arithmetic of the step, per device:

    for each of the A micro-batches:        loss, g = value_and_grad(loss)(params, micro)
    g = sum / A                             (accumulation: A backward passes, one exchange)
    g = mean over the worker's own devices  (FSDP: already done by the reduce-scatter in the
                                             backward; else dpjax's fused allreduce over the
                                             inner data axes)

and the builder only wraps it into programs. The rule's own step (`dpjax.updates`) then
exchanges between the workers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dpjax import scopes
from dpjax.compression import Exchange, Form, sharded
from dpjax.mesh import EXPERT
from dpjax.plan import Plan
from dpjax.sharding import Layout
from dpjax.tasks import tokens


def local_grad(loss_fn, plan: Plan, par, value_and_grad):
    """(value_and_grad(params, batch_BdxT1) -> this device's loss and gradient, zeros(params)
    -> a zero gradient to accumulate into). FSDP through random-k differentiates with
    respect to the gathered parameters, unreduced: its rule (wrapped, `sharded.wrap`)
    reduces."""
    layout = plan.layout
    loss_and_grad = functools.partial(value_and_grad or jax.value_and_grad(loss_fn), par=par)
    zeros_grad = lambda p: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
    if plan.exchange.form is Form.FSDP:
        assert value_and_grad is None, "dpjax.plan refuses a stage axis here"
        loss_and_grad = sharded.local_value_and_grad(loss_fn, par, sharded.dp(layout))
        zeros_grad = lambda p: sharded.full_zeros(p, layout.gather_dims, sharded.dp(layout))  # noqa: E731

    def named(p, b):
        with scopes.phase("forward_backward"):  # names only (dpjax.scopes): the program is the same
            return loss_and_grad(p, b)

    return named, zeros_grad


def worker_grad(plan: Plan, value_and_grad, zeros_grad):
    """grad_fn(params, batch_AxBdxT1) -> the worker's loss and gradient: A micro-batches
    accumulated, then averaged over the worker's own devices (`inner_mean`)."""
    passes, mean = plan.passes, inner_mean(plan.layout, plan.exchange)

    def grad_fn(params, batch_AxBdxT1):
        assert tokens(batch_AxBdxT1).shape[0] == passes, (tokens(batch_AxBdxT1).shape, passes)
        first = lambda: jax.tree.map(lambda x: x[0], batch_AxBdxT1)  # noqa: E731  every leaf of a task's batch
        if passes == 1:
            loss, g = value_and_grad(params, first())
        else:
            def micro(carry, batch_BdxT1):
                loss, g = value_and_grad(params, batch_BdxT1)
                return (jax.tree.map(jnp.add, carry[0], loss), jax.tree.map(jnp.add, carry[1], g)), None

            shapes = jax.eval_shape(value_and_grad, params, first())[0]  # the loss, or (loss, stats)
            zero = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), zeros_grad(params))
            (loss, g), _ = lax.scan(micro, zero, batch_AxBdxT1)
            loss, g = jax.tree.map(lambda x: x / passes, (loss, g))
        return loss, mean(g)

    return grad_fn


def inner_mean(layout: Layout, exchange: Exchange):
    """The mean of a worker's gradient over its own devices: dpjax's fused allreduce over
    the inner data axes (none under FSDP: its reduce-scatter in the backward pass already
    averaged over them) and the context axis (each of its devices took the gradient of
    its own tokens' loss; the mean over them is the gradient of the sequences' mean)."""
    axes = (layout.inner_axes if not layout.fsdp else ()) + layout.context_axes  # (dpjax.plan refuses a
    # nested algorithm, which reads two axes as levels, with a context axis)
    inside = exchange.inside()  # exact where only the exchange between workers is compressed

    def mean_over(over):
        return lambda g: inside.mean(g, over)[0]

    if not layout.expert_split:
        return mean_over(axes)
    # A device's experts got, through the all-to-all's transpose, the gradient of every
    # token routed to them from the whole expert axis: of the loss summed over its n
    # devices. The mean over the other axes and a division by n make it the mean's. FSDP
    # never gathers the experts, so no reduce-scatter averaged them: their axes are the
    # inner data axes even under FSDP.
    inner = tuple(a for a in layout.inner_axes if a != EXPERT) + layout.context_axes
    n, mean, experts_mean = layout.mesh.shape[EXPERT], mean_over(axes), mean_over(inner)
    return lambda g: by_leaf(g, layout.expert_leaves(), lambda ls: [x / n for x in experts_mean(ls)], mean)


def by_leaf(tree, mask, if_true, if_false):
    """`tree` with the list of its leaves where `mask` (a tree of bools like it) is true
    replaced by if_true(that list), and the others by if_false(theirs)."""
    leaves, treedef = jax.tree.flatten(tree)
    flags = jax.tree.leaves(mask)
    assert len(flags) == len(leaves), (len(flags), len(leaves))
    picked = {True: [x for x, f in zip(leaves, flags) if f], False: [x for x, f in zip(leaves, flags) if not f]}
    done = {True: iter(if_true(picked[True]) if picked[True] else []),
            False: iter(if_false(picked[False]) if picked[False] else [])}
    return jax.tree.unflatten(treedef, [next(done[bool(f)]) for f in flags])
