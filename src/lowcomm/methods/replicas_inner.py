"""``inner=SPEC`` of the semi-synchronous methods: replicas of several GPUs.

Why: DiLoCo's "workers" are islands of devices (torchft's replica groups): inside a node the
inner steps are ordinary synchronous data-parallel training over the fast link, and only the
outer sync crosses the slow inter-node link. With ``inner=SPEC`` the replicas are the nodes of
the topology (``--gpus-per-node`` / torchrun's ``LOCAL_WORLD_SIZE``,
:class:`~lowcomm.comm.topology.Topology`): the method ``SPEC`` (any synchronous method:
``ssgd``, ``fp16``, ``(topk:density=0.01)``, ``wfbp``, ``dear``...) is built on the node's
intra group, so every inner step is synchronous inside the node and the ranks of a node hold
the same weights. The outer sync then runs among the nodes' *leaders* (local rank 0, on their
inter group), which broadcast the result inside their node: the inter-node bytes are those of
a flat sync over ``nodes`` workers, counted once per node instead of once per GPU.

This module checks the spec (one-line refusals) and builds the groups and the inner method's
context; :class:`lowcomm.methods.localsgd.OuterMethod` forwards the trainer's hooks to it.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.comm.topology import NodeGroups, Topology, node_groups
from lowcomm.errors import UsageError
from lowcomm.methods.base import Method, MethodContext, strip_parens

#: the one-line fix of an ``inner=`` run on one node
NEEDS_NODES = (
    "needs >= 2 nodes of >= 2 GPUs; give --gpus-per-node G or run under torchrun "
    "with LOCAL_WORLD_SIZE"
)


def inner_spec(value: str, method: str) -> str | None:
    """``inner=`` as a method spec (None for ``none``), refused in one line when it names an
    unknown method, a semi-synchronous one, or a model-axis one (it changes the model the
    outer sync averages)."""
    from lowcomm.methods import method_class, split_spec

    spec = strip_parens(str(value)).strip()
    if spec.lower() in ("", "none"):
        return None
    name = split_spec(spec)[0].lower()
    try:
        cls = method_class(name)
    except UsageError as e:
        raise UsageError(
            f"inner={name!r} of method {method!r} must be a synchronous method ({e})"
        ) from None
    if getattr(cls, "semi_synchronous", False):
        raise UsageError(
            f"inner={name!r} of method {method!r} is semi-synchronous itself; "
            "give a synchronous method (ssgd, fp16, wfbp, dear, ...)"
        )
    if cls.prepare is not Method.prepare:
        raise UsageError(
            f"inner={name!r} of method {method!r} changes the model (model axis); "
            "give a synchronous method (ssgd, fp16, wfbp, dear, ...)"
        )
    return spec


def make_inner(value: str, method: str) -> Method | None:
    """The inner method of ``inner=value`` with its options (None for ``none``)."""
    from lowcomm.methods import create

    spec = inner_spec(value, method)
    return None if spec is None else create(spec)


def replica_groups(ctx: MethodContext, method: str) -> tuple[Topology, NodeGroups]:
    """This process's topology and node groups (collective on first use), refused in one line
    on one node, with nodes of one GPU, or with a process group other than the world."""
    if ctx.process_group is not None:
        raise UsageError(
            f"{method}: inner= runs on the world group (its nodes come from the topology)"
        )
    topo = accounting.topology() or Topology.from_env()
    if not (dist.is_available() and dist.is_initialized()) or not topo.hierarchical:
        raise UsageError(
            f"{method}: inner= {NEEDS_NODES} (got {topo.nodes} node(s) of {topo.local_size})"
        )
    return topo, node_groups(topo)


def inner_context(ctx: MethodContext, topo: Topology, groups: NodeGroups) -> MethodContext:
    """The inner method's context: the node's intra group, its size and this rank in it."""
    return dataclasses.replace(
        ctx, process_group=groups.intra, world_size=topo.local_size, rank=topo.local_rank
    )


__all__ = ["NEEDS_NODES", "inner_context", "inner_spec", "make_inner", "replica_groups"]
