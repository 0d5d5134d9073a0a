"""Public entry point: attach a compression method to a DDP model.

>>> state = lowcomm.hooks.register(ddp_model, "powersgd", rank=4, start_iter=10)
>>> ckpt = state.state_dict(); ...; state.load_state_dict(ckpt)

Momentum correction (Lin et al., DGC, 2018): with your own SGD at momentum ``mu``, pass
``momentum=mu`` and build the optimizer with momentum 0 and weight decay ``wd / (1 - mu)``:

>>> state = lowcomm.hooks.register(ddp_model, "topk", density=0.01, momentum=0.9)
>>> opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.0, weight_decay=5e-4 / (1 - 0.9))

Durations (``start_iter="2ep"`` or ``"5%"``) need the run's length:
``steps_per_epoch=`` / ``total_steps=``.

Multi-GPU nodes: ``hierarchical=True`` runs every all-reduce as an intra-node reduce-scatter,
an inter-node all-reduce and an intra-node all-gather (``"hybrid"``: flat or hierarchical per
bucket by the α-β model); the nodes come from ``gpus_per_node=`` or torchrun's
``LOCAL_WORLD_SIZE`` (docs/hierarchical.md):

>>> state = lowcomm.hooks.register(ddp_model, "fp16", hierarchical=True, gpus_per_node=8)

Methods: ``ssgd`` and every compressor of :data:`lowcomm.compress.codec.CODECS` (see
:func:`methods`, and docs/compression.md for options, byte formulas and the NaN policy).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch.distributed as dist
from torch import nn

from lowcomm.compress.codec import Aggregation

from lowcomm.comm.hooks import HOOKS, CodecHook, HookKind, run_hook
from lowcomm.errors import UsageError


def options_for(method: str, **options: Any) -> Any:
    """Validated options dataclass of ``method`` (UsageError lists what is valid)."""
    cls = hook_class(method)
    fields = {f.name for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(options) - fields)
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise UsageError(f"unknown option {unknown[0]!r} for method {method!r}; valid: {valid}")
    try:
        return cls.Options(**options)
    except TypeError as e:
        raise UsageError(f"invalid options for method {method!r}: {e}") from None


def hook_class(method: str) -> HookKind:
    """How to build ``method``'s hook (UsageError with a suggestion for unknown names)."""
    try:
        return HOOKS[method]
    except KeyError:
        close = difflib.get_close_matches(method, list(HOOKS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"unknown compression method {method!r}{hint}; valid: {', '.join(sorted(HOOKS))}") from None


def register(ddp_model: nn.Module, method: str, *, process_group: dist.ProcessGroup | None = None,
             steps_per_epoch: int | None = None, total_steps: int | None = None,
             hierarchical: bool | str = False, gpus_per_node: int | None = None,
             link_costs: Any = None, compile_now: bool = True, **options: Any) -> CodecHook:
    """Register ``method``'s comm hook on ``ddp_model``; return its state (checkpointable).

    ``method`` is a name or a ``name:key=value,...`` spec; keyword options win over the spec.

    ``momentum=mu``: your SGD momentum, moved into the codec (momentum correction, for codecs
    with error feedback and ``momentum_correction`` on): the codec compresses the velocity
    ``u <- mu*u + g``. Then use SGD with momentum 0 and weight decay ``wd / (1 - mu)`` (the
    decay's gain through the momentum). Default 0: no velocity, keep your optimizer's. (For
    ``signum``, whose own option is called ``momentum``, it is that option.)

    ``steps_per_epoch`` / ``total_steps``: the run's length, needed by options given as
    durations (``start_iter="2ep"`` needs ``steps_per_epoch``, ``"5%"`` needs ``total_steps``).
    Without them such an explicit value is a UsageError; a relative *default* falls back to
    a fixed number of steps (``start_iter``: 10).

    ``compile_now``: compile the codec's numba kernels here (:mod:`lowcomm.compress.warm`), so
    the first compressed steps do not take seconds on a machine whose kernel cache is empty;
    False when the caller sets the momentum afterwards and compiles then.

    ``hierarchical``: False (plain all-reduce), True or ``"hier"`` (every all-reduce
    hierarchical), ``"hybrid"`` (per bucket, flat or hierarchical by the α-β model of
    ``link_costs``, a :class:`lowcomm.comm.hierarchical.LinkCosts`; probed when None, which is
    collective) or ``"flat"``. ``gpus_per_node``: workers per node (default: torchrun's
    ``LOCAL_WORLD_SIZE``), for ``hierarchical`` and for codecs with node-scoped messages (hitopk). Codecs whose payloads are gathered (top-k, sign, ...) are refused:
    there is no sum to run hierarchically (use the ``hitopk`` method).
    """
    if ":" in method:
        from lowcomm.methods.base import parse_options

        method, _, text = method.partition(":")
        parsed = parse_options(method, hook_class(method).Options, text)
        options = {**dataclasses.asdict(parsed), **options}
    state = create(ddp_model, method, process_group=process_group, steps_per_epoch=steps_per_epoch,
                   total_steps=total_steps, **options)
    if gpus_per_node is not None and process_group is None:
        from lowcomm.comm.topology import Topology

        state.use_topology(Topology.from_env(gpus_per_node))  # scoped codec messages (hitopk) too
    if hierarchical is not False:
        state.reducer = hierarchical_reducer(ddp_model, state, hierarchical, process_group=process_group,
                                             gpus_per_node=gpus_per_node, link_costs=link_costs)
    ddp_model.register_comm_hook(state, run_hook)  # type: ignore[operator]
    if compile_now and state.codec is not None:
        from lowcomm.compress.warm import compile_kernels

        compile_kernels(state.codec, ddp_model.parameters())
    return state


def hierarchical_reducer(ddp_model: nn.Module, state: CodecHook, hierarchical: bool | str, *,
                         process_group: dist.ProcessGroup | None = None, gpus_per_node: int | None = None,
                         link_costs: Any = None) -> Any:
    """The :class:`~lowcomm.comm.hierarchical.HierarchicalReducer` for ``state`` (None when the
    topology is one node or the mode is ``flat``: the plain all-reduce). Collective."""
    from lowcomm.comm import accounting
    from lowcomm.comm.hierarchical import MODES, HierarchicalReducer, probe_link_costs
    from lowcomm.comm.topology import Topology

    mode = "hier" if hierarchical is True else str(hierarchical).strip().lower()
    if mode not in MODES:
        raise UsageError(f"hierarchical={hierarchical!r}: valid: True, False, {', '.join(map(repr, MODES))}")
    if state.codec is not None and state.codec.aggregation is not Aggregation.SUM:
        raise UsageError(f"hierarchical=True cannot carry {state.name}: its payloads are gathered, not summed, "
                         "so there is no all-reduce to run hierarchically; use method 'hitopk' or a summing "
                         "codec (fp16, bf16, powersgd, ...)")
    if process_group is not None:
        raise UsageError("hierarchical=True needs the default (world) process group: the node groups are "
                         "subgroups of the world")
    if gpus_per_node is not None:
        topo = Topology.from_env(gpus_per_node)
    else:
        topo = accounting.topology() or Topology.from_env()
    if mode == "flat" or not topo.hierarchical:
        return None
    device = next(ddp_model.parameters()).device  # the probe's tensors: where the gradients are
    if mode == "hybrid" and link_costs is None:
        link_costs = probe_link_costs(topo, device=device, tag=f"{state.name}.probe")
    return HierarchicalReducer(topo, mode=mode, costs=link_costs)


def create(ddp_model: nn.Module, method: str, *, process_group: dist.ProcessGroup | None = None,
           steps_per_epoch: int | None = None, total_steps: int | None = None, **options: Any) -> CodecHook:
    """``method``'s hook state with validated options, not registered (for callers that wrap
    :func:`~lowcomm.comm.hooks.run_hook` in a hook of their own); ``momentum=``,
    ``steps_per_epoch``, ``total_steps``: as for :func:`register`."""
    kind = hook_class(method)
    momentum = 0.0
    if "momentum" in options and "momentum" not in {f.name for f in dataclasses.fields(kind.Options)}:
        momentum = options.pop("momentum")
    state = kind(ddp_model, options_for(method, **options), process_group=process_group)
    if state.codec is None:
        if momentum:
            raise UsageError(f"method {method!r} has no codec to keep the momentum: pass momentum=0 and keep it "
                             "in your optimizer")
        return state
    state.codec.set_momentum(momentum)
    state.codec.set_run(steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    return state


def methods() -> list[str]:
    """Every method a hook can be registered for: ``ssgd`` and every registered codec."""
    return sorted(HOOKS)


#: the hook state's class (the name earlier releases exported)
HookState = CodecHook

__all__ = ["CodecHook", "HookState", "create", "methods", "options_for", "register"]
