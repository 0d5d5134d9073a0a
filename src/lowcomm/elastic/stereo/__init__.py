"""Elastic stereo matching (EASNet-style): the ``elastic_stereo`` supernet, its correlation cost
volume / aggregation / refinement parts, and the multi-scale loss with the EPE and D1 metrics.

``model`` registers ``elastic_stereo`` with :mod:`lowcomm.models`; ``loss`` is pure tensor math
(no model import), so evaluation code can use the metrics alone.
"""

from __future__ import annotations

from lowcomm.elastic.stereo.loss import d1, epe, error_sums, multiscale_loss, valid_mask
from lowcomm.elastic.stereo.model import ElasticStereoNet, StereoNet, elastic_stereo

__all__ = [
    "ElasticStereoNet",
    "StereoNet",
    "d1",
    "elastic_stereo",
    "epe",
    "error_sums",
    "multiscale_loss",
    "valid_mask",
]
