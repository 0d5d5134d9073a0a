"""Simulator: predict each method's iteration time at scale from a measured or written profile.

``predict_iteration_time(profile, "acpsgd:rank=4", workers=64, network=NetworkModel.preset(
"10gbit"))`` returns a :class:`Prediction` (iteration time and breakdown). See
``docs/simulator.md`` for the profile format, the α-β formulas and the schedules.
"""

from __future__ import annotations

from lowcomm.sim.network import PRESETS, Link, NetworkModel, parse_network
from lowcomm.sim.predict import Prediction, predict_iteration_time, simulate
from lowcomm.sim.profile import ComputeCosts, LayerProfile, Profile
from lowcomm.sim.schedules import SCHEDULES, make_schedule, method_names

__all__ = [
    "PRESETS",
    "SCHEDULES",
    "ComputeCosts",
    "LayerProfile",
    "Link",
    "NetworkModel",
    "Prediction",
    "Profile",
    "make_schedule",
    "method_names",
    "parse_network",
    "predict_iteration_time",
    "simulate",
]
