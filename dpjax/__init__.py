"""dpjax: sharded training on JAX/XLA with explicit, readable collectives."""

from dpjax import collectives
from dpjax.mesh import data_axes, make_mesh, parse_mesh_spec, simulate_cpu_devices

__all__ = ["collectives", "data_axes", "make_mesh", "parse_mesh_spec", "simulate_cpu_devices"]
__version__ = "0.1.0"
