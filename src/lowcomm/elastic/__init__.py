"""Elastic supernets (EASNet, Once-for-All): train once with progressive shrinking, extract
sub-networks without retraining, pick the best one under a latency limit.

``lowcomm elastic train|search|extract`` (docs/elastic.md) runs it. The building blocks
(:mod:`.ops`, :mod:`.blocks`), the search space (:mod:`.space`), the supernet API
(:class:`Supernet`: ``set_active``, ``sample_config``, ``extract``, ``sort_channels``,
``latency_units``), progressive shrinking on the ordinary trainer (:mod:`.shrinking`,
:mod:`.train`), the latency lookup table (:mod:`.latency`), the evolutionary search
(:mod:`.search`) and the accuracy predictor (:mod:`.predictor`) are usable on their own; the
names below load on first use, so the CLI's help and one-line errors stay cheap.
"""

from __future__ import annotations

from lowcomm.registry import lazy_exports


#: public name -> the module that defines it
_EXPORTS = {
    "SearchSpace": "lowcomm.elastic.space", "Dimension": "lowcomm.elastic.space",
    "Supernet": "lowcomm.elastic.supernet", "LatencyUnit": "lowcomm.elastic.supernet",
    "recalibrate_bn": "lowcomm.elastic.supernet",
    "MultiNet": "lowcomm.elastic.shrinking", "Phase": "lowcomm.elastic.shrinking",
    "parse_phases": "lowcomm.elastic.shrinking",
    "ElasticTrainer": "lowcomm.elastic.train", "run_elastic": "lowcomm.elastic.train",
    "ElasticConfig": "lowcomm.elastic.config",
    "LatencyTable": "lowcomm.elastic.latency", "measure_network": "lowcomm.elastic.latency",
    "evolution_search": "lowcomm.elastic.search", "random_search": "lowcomm.elastic.search",
    "AccuracyPredictor": "lowcomm.elastic.predictor",
    "load_supernet": "lowcomm.elastic.artifacts", "load_subnet": "lowcomm.elastic.artifacts",
    "save_supernet": "lowcomm.elastic.artifacts", "save_subnet": "lowcomm.elastic.artifacts",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
