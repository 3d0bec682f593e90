"""Horovod's training helpers on optax: `DistributedOptimizer`, `broadcast_parameters`,
`broadcast_optimizer_state`."""

from __future__ import annotations

import optax

from dpjax import data_parallel
from dpjax.collectives.ranks import axis_size
from dpjax.horovod.collectives import Adasum, Average
from dpjax.horovod.compression import Compression
from dpjax.horovod.ranks import global_process_set, set_groups, world_axis
from dpjax.wrap.checks import splits_nothing


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         process_set=global_process_set, *, axis_name=None, algorithm=None, fusion_mb=64):
    """Horovod's DistributedOptimizer on an optax optimizer (named_parameters is
    accepted and unused: JAX gradients are pytrees). op=Adasum combines each rank's
    update with Adasum (`dpjax.DistributedOptimizer`). The axes are the data axes of
    the mesh the update runs in."""
    algorithm = algorithm or ("butterfly" if op == Adasum else "ring")

    def build(axis, **groups):
        return data_parallel.DistributedOptimizer(optimizer, axis, algorithm=algorithm, fusion_mb=fusion_mb,
                                                  compression=compression, op=op,
                                                  backward_passes_per_step=backward_passes_per_step,
                                                  gradient_predivide_factor=gradient_predivide_factor, **groups)

    template = build("data")  # checks the arguments now; init does not depend on the axes

    def update(grads, state, params=None):
        axis = world_axis(axis_name, "DistributedOptimizer")
        groups = set_groups(process_set, axis_size(axis, "DistributedOptimizer"), partition=False)
        return build(axis, **({} if groups is None else {"groups": groups})).update(grads, state, params)

    return optax.GradientTransformation(template.init, update)


@splits_nothing
def broadcast_parameters(params, root_rank=0, *, axis_name=None, algorithm="tree"):
    """Every rank ends with root_rank's parameters (any pytree); returns them."""
    return data_parallel.broadcast_params(params, world_axis(axis_name, "broadcast_parameters"), root=root_rank,
                                          algorithm=algorithm)


broadcast_optimizer_state = broadcast_parameters
