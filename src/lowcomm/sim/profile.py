"""What the simulator needs to know about one model on one device, as a JSON document.

A profile lists the model's parameterized modules ("layers") in **forward order** with the
seconds each spends in forward and backward and the shapes of its parameters. Backward
visits the layers in reverse order, and a layer's gradients become ready when its backward
time has elapsed. Time spent outside parameterized modules (activations, pooling, the loss)
is credited to the preceding layer, so the layer times add up to the whole pass.

It may be measured (``lowcomm profile``) or written by hand from published timings; see
``docs/simulator.md`` for the format. ``costs`` holds per-element constants for compression
work (measured by simple tensor ops on the same device); ``factorized`` optionally holds the
profile of the Pufferfish-factorized model, used by the ``pufferfish`` schedule.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lowcomm.errors import UsageError

FORMAT_VERSION = 1


@dataclass
class LayerProfile:
    """One layer's measured forward and backward time and its parameter shapes."""
    name: str
    forward_s: float
    backward_s: float
    param_shapes: list[list[int]]

    @property
    def numel(self) -> int:
        """Parameters of the layer."""
        return sum(math.prod(s) for s in self.param_shapes)


@dataclass
class ComputeCosts:
    """Seconds per unit of the kernels compression methods are built from.

    * ``elementwise_s_per_elem`` — one fused read-modify-write pass over fp32 elements
      (error-feedback add, sign, scale, cast, unpack-and-add of one sign vector);
    * ``matmul_s_per_flop`` — a tall-skinny matmul (M·Q with rank-r Q), per multiply-add·2;
    * ``orthogonalize_s_per_elem`` — QR / Gram-Schmidt of an m×r factor, per element of it;
    * ``topk_s_per_elem`` — ``torch.topk`` selection at density 0.01, per input element;
    * ``scatter_s_per_elem`` — scatter-add of one (value, index) pair.
    """

    elementwise_s_per_elem: float = 0.0
    matmul_s_per_flop: float = 0.0
    orthogonalize_s_per_elem: float = 0.0
    topk_s_per_elem: float = 0.0
    scatter_s_per_elem: float = 0.0

    @property
    def is_zero(self) -> bool:
        """No constants measured: compression work would be counted as free (and is flagged)."""
        return not any(vars(self).values())


@dataclass
class Profile:
    """A model measured on one device: everything the schedules replay at any scale."""
    model: str
    batch_size: int
    layers: list[LayerProfile]
    device: str = "unknown"
    optimizer_s: float = 0.0
    bytes_per_elem: int = 4
    costs: ComputeCosts = field(default_factory=ComputeCosts)
    #: Optional measured encode/decode seconds per compressor (from ``lowcomm.compress``).
    compressors: dict[str, dict[str, float]] = field(default_factory=dict)
    factorized: Profile | None = None
    notes: str = ""
    #: the optimizer's own step inside ``optimizer_s`` (a calibrated profile's ``optimizer_s`` is
    #: all the host-side rest of an iteration: :func:`lowcomm.sim.calibrate.calibrate_phases`);
    #: None: ``optimizer_s`` is the step
    optimizer_step_s: float | None = None

    # -- derived --------------------------------------------------------------------------
    @property
    def forward_s(self) -> float:
        """Forward time of the whole model."""
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        """Backward time of the whole model."""
        return sum(layer.backward_s for layer in self.layers)

    @property
    def compute_s(self) -> float:
        """One worker's iteration with no communication at all."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def numel(self) -> int:
        """Parameters of the model."""
        return sum(layer.numel for layer in self.layers)

    @property
    def param_shapes(self) -> list[list[int]]:
        """Every parameter's shape, layers in forward order (the gradients codecs are timed on)."""
        return [s for layer in self.layers for s in layer.param_shapes]

    @property
    def grad_bytes(self) -> int:
        """Bytes of one full gradient."""
        return self.numel * self.bytes_per_elem

    # -- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON form (``format_version`` 1)."""
        d: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "batch_size": self.batch_size,
            "device": self.device,
            "optimizer_s": self.optimizer_s,
            **({"optimizer_step_s": self.optimizer_step_s} if self.optimizer_step_s is not None else {}),
            "bytes_per_elem": self.bytes_per_elem,
            "costs": asdict(self.costs),
            "compressors": self.compressors,
            "notes": self.notes,
            "layers": [
                {"name": layer.name, "forward_s": layer.forward_s, "backward_s": layer.backward_s,
                 "param_shapes": [list(s) for s in layer.param_shapes]}
                for layer in self.layers
            ],
        }
        if self.factorized is not None:
            d["factorized"] = self.factorized.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "profile") -> Profile:
        """Parse and validate a profile document; ``where`` names the place in errors."""
        if not isinstance(d, dict):
            raise UsageError(f"{where}: a profile must be a JSON object")
        version = d.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise UsageError(f"{where}: format_version {version} not supported (want {FORMAT_VERSION})")
        for key in ("model", "batch_size", "layers"):
            if key not in d:
                raise UsageError(f"{where}: missing required key {key!r} "
                                 "(required: model, batch_size, layers)")
        layers = []
        for i, ld in enumerate(d["layers"]):
            lw = f"{where}: layers[{i}]"
            try:
                shapes = ld.get("param_shapes")
                if shapes is None and "numel" in ld:
                    shapes = [[int(ld["numel"])]]
                layer = LayerProfile(name=str(ld.get("name", f"layer{i}")),
                                     forward_s=float(ld["forward_s"]),
                                     backward_s=float(ld["backward_s"]),
                                     param_shapes=[[int(x) for x in s] for s in shapes])
            except (KeyError, TypeError, ValueError) as e:
                raise UsageError(f"{lw}: needs forward_s, backward_s and param_shapes "
                                 f"(or numel): {e}") from None
            if layer.forward_s < 0 or layer.backward_s < 0:
                raise UsageError(f"{lw}: times must be >= 0")
            layers.append(layer)
        if not layers:
            raise UsageError(f"{where}: 'layers' is empty")
        known = {f for f in ComputeCosts.__dataclass_fields__}
        costs_d = d.get("costs") or {}
        unknown = set(costs_d) - known
        if unknown:
            raise UsageError(f"{where}: unknown costs keys {sorted(unknown)}; valid: {sorted(known)}")
        fact = d.get("factorized")
        return cls(
            model=str(d["model"]),
            batch_size=int(d["batch_size"]),
            layers=layers,
            device=str(d.get("device", "unknown")),
            optimizer_s=float(d.get("optimizer_s", 0.0)),
            bytes_per_elem=int(d.get("bytes_per_elem", 4)),
            costs=ComputeCosts(**{k: float(v) for k, v in costs_d.items()}),
            compressors={k: {kk: float(vv) for kk, vv in v.items()}
                         for k, v in (d.get("compressors") or {}).items()},
            factorized=cls.from_dict(fact, where=f"{where}.factorized") if fact else None,
            notes=str(d.get("notes", "")),
            optimizer_step_s=None if d.get("optimizer_step_s") is None else float(d["optimizer_step_s"]),
        )

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile JSON, refusing a missing or invalid file in one line."""
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"profile file {str(p)!r} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"profile {str(p)!r} is not valid JSON: {e}") from None
        return cls.from_dict(data, where=str(p))


#: Where the shipped GPU profiles live (package data; built by ``lowcomm.sim.gpu_profiles``).
SHIPPED_DIR = Path(__file__).with_name("profiles")


def shipped_profiles() -> list[str]:
    """Names of the shipped profiles (``a100-resnet50``, ...), sorted."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))


def resolve_profile(spec: str) -> Path:
    """A shipped profile's name or a path to a profile JSON -> the file to load.

    A path that exists wins (so a measured ``a100-resnet50.json`` in the working directory is
    used as given); otherwise the name (with or without ``.json``) must be a shipped one.
    """
    p = Path(spec)
    if p.is_file():
        return p
    name = p.name[:-5] if p.name.endswith(".json") else p.name
    shipped = SHIPPED_DIR / f"{name}.json"
    if str(p.parent) in ("", ".") and shipped.is_file():
        return shipped
    raise UsageError(f"profile {spec!r} does not exist as a file and is not a shipped profile; shipped: "
                     f"{', '.join(shipped_profiles()) or '(none installed)'} "
                     "(or measure one: lowcomm profile --device cuda)")


def load_profile(spec: str) -> Profile:
    """:func:`resolve_profile` then :meth:`Profile.load`."""
    return Profile.load(resolve_profile(spec))

