"""Sharding rules for any model: parameter-path patterns and flax's logical axis names.

A dpjax model declares a table keyed by leaf name (`dpjax.sharding.specs_from_table`); a
user's own flax model needs another way to say where each parameter lives. Two, both
resolved to a tree of PartitionSpec and then to a `dpjax.sharding.Layout` by `layout`:

- path rules, `[(pattern, spec), ...]`: a parameter's path is its keys joined by "/"
  ("params/Conv_0/kernel" in Linen's variables, "conv1/kernel" in an NNX state), and the
  first pattern matching the whole path (`re.fullmatch`) gives its spec, as big_vision's
  sharding rules and MaxText's do. A parameter no rule matches is an error naming it;
  end with `(".*", P())` (or pass `default=P()`) to replicate the rest.
- logical names: flax's partitioning metadata names each dimension of a parameter
  (`nn.with_partitioning(init, ("embed", "mlp"))`, `nnx.with_partitioning`), and logical
  rules `[("mlp", "model"), ("embed", None)]` map names to mesh axes, first match first
  (flax's `logical_axis_rules`, MaxText's `logical_axis_rules`). A name without a rule is
  an error naming it and the parameter; a parameter without metadata is replicated.

A spec that names the data axes is fully sharded data parallelism (ZeRO-3) on that
dimension: the parameter is all-gathered just before use (`Layout.gather`, inside the
step) and its gradient reduce-scattered. `layout(params, mesh, fsdp=True)` splits every
parameter that way, on its largest dimension that divides: FSDP for an unchanged flax
model in one call.
"""

from __future__ import annotations

import re
import sys

import jax
from jax.sharding import PartitionSpec as P

from dpjax.errors import UserError
from dpjax.sharding import Layout, layout_from_specs


def path_name(path) -> str:
    """'params/Conv_0/kernel' for a jax key path (a Variable's own `.value` left out)."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path
            if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]
    return "/".join(str(k) for k in keys)


def _is_boxed(x) -> bool:
    """A value that may carry flax partitioning metadata: a Linen box (nn.Partitioned) or an
    nnx.Variable (flax is not imported for code that uses neither)."""
    meta, nnx = sys.modules.get("flax.core.meta"), sys.modules.get("flax.nnx")
    return (meta is not None and isinstance(x, meta.AxisMetadata)) or (nnx is not None and isinstance(x, nnx.Variable))


def unbox(tree):
    """The raw arrays of a tree that may hold Linen boxes or NNX Variables."""
    return jax.tree.map(lambda x: (x.unbox() if hasattr(x, "unbox") else x.get_value()) if _is_boxed(x) else x,
                        tree, is_leaf=_is_boxed)


def specs_from_rules(tree, rules, *, default: P | None = None):
    """A PartitionSpec per leaf of `tree` from path rules (see the module docstring).
    Raises UserError naming the first leaf that no rule matches when `default` is None."""
    compiled = []
    for pattern, spec in rules:
        try:
            compiled.append((re.compile(pattern), spec))
        except re.error as e:
            raise UserError(f"sharding rule {pattern!r} is not a regular expression: {e}") from None

    def one(path, x):
        name = path_name(path)
        for regex, spec in compiled:
            if regex.fullmatch(name):
                return spec
        if default is not None:
            return default
        raise UserError(f"parameter {name} {tuple(jax.numpy.shape(x))} matches no sharding rule "
                        f"({len(compiled)} patterns: {', '.join(repr(p) for p, _ in rules[:4])}"
                        f"{', ...' if len(rules) > 4 else ''}); add a rule for it, or end the rules with "
                        f"('.*', P()) to replicate the rest")

    return jax.tree_util.tree_map_with_path(one, unbox(tree))


def _names(x) -> tuple | None:
    """The logical names of a boxed leaf (None: no metadata)."""
    if hasattr(x, "names"):  # Linen's nn.Partitioned
        return tuple(x.names)
    meta = x.get_metadata() if hasattr(x, "get_metadata") else {}
    names = meta.get("out_sharding") or meta.get("sharding")
    return tuple(names) if names else None


def specs_from_logical(tree, rules):
    """A PartitionSpec per leaf of `tree` (boxed by nn.with_partitioning or
    nnx.with_partitioning) from logical rules (see the module docstring)."""
    table: dict = {}
    for name, axes in rules:
        table.setdefault(name, axes)  # first rule wins

    def one(path, x):
        names = _names(x) if _is_boxed(x) else None
        if names is None:
            return P()
        missing = [n for n in names if n is not None and n not in table]
        if missing:
            raise UserError(f"parameter {path_name(path)} has logical axis {missing[0]!r}, which no logical rule "
                            f"maps to a mesh axis (rules for: {', '.join(map(repr, table)) or 'none'}); add "
                            f"({missing[0]!r}, 'model') or ({missing[0]!r}, None)")
        return P(*[None if n is None else table[n] for n in names])

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_boxed)


def layout(params, mesh, rules=None, *, logical=None, default: P | None = None, fsdp: bool = False,
           algorithm: str = "ring", fsdp_algorithm: str = "ring") -> Layout:
    """The layout of a user's parameters on `mesh`: specs from path `rules`, else from
    the parameters' `logical` names and rules, else replicated; `fsdp` also splits every
    parameter over the data axes. `layout.specs` is a tree like `unbox(params)`;
    inside the step, `layout.gather(params)` gives the model its parameters whole.
    Raises UserError (one line) for a parameter no rule matches, a logical name no rule
    maps, or a split that does not divide."""
    if rules is not None and logical is not None:
        raise UserError("give sharding rules by path or by logical names, not both")
    raw = unbox(params)
    if rules is not None:
        specs = specs_from_rules(raw, rules, default=default)
    elif logical is not None:
        specs = specs_from_logical(params, logical)
    else:
        specs = jax.tree.map(lambda _: P(), raw)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), raw)
    return layout_from_specs(abstract, specs, mesh, algorithm=algorithm, fsdp=fsdp, fsdp_algorithm=fsdp_algorithm)
