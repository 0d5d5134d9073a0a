"""The flags of ``lowcomm elastic search`` and ``lowcomm elastic extract`` (shared, mostly).

Kept apart from :mod:`lowcomm.elastic.search_cli` so that the commands' logic reads on its own.
"""

from __future__ import annotations

import argparse


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--supernet", required=True, help="a file written by `lowcomm elastic train --out`")
    p.add_argument("--data-dir", default=None, help="where the supernet's data is (default: as in training)")
    p.add_argument("--latency-table", default=None,
                   help="JSON lookup table: read if it exists, else measured on this machine and written there")
    p.add_argument("--latency-shape", default=None, help="per-sample input shape for latency (default: the data's)")
    p.add_argument("--latency-repeats", type=int, default=10, help="timed runs per unit (and network) per round")
    p.add_argument("--latency-rounds", type=int, default=3,
                   help="rounds over all units (and networks), round-robin, so a slow spell of a shared "
                        "machine cannot bias one of them; the statistic is taken over all rounds")
    p.add_argument("--latency-stat", choices=("min", "median"), default="min",
                   help="statistic of the timed runs (min: timeit's advice on a shared machine)")
    p.add_argument("--latency-threads", type=int, default=1,
                   help="torch threads while timing (the target device's; 1 by default)")
    p.add_argument("--latency-fit", choices=("none", "offset", "scale", "affine"), default="none",
                   help="correct the table's sums by timing the largest and smallest networks whole")
    p.add_argument("--latency-samples", type=int, default=30,
                   help="random sub-networks whose units are timed up front (others are timed when first met)")
    p.add_argument("--threads", type=int, default=None, help="torch threads while measuring and evaluating")
    p.add_argument("--score", choices=("predictor", "direct"), default="predictor",
                   help="how the search scores sub-networks (default: OFA's accuracy predictor)")
    p.add_argument("--predictor-samples", type=int, default=100,
                   help="sub-networks scored on held-out data to train the accuracy predictor")
    p.add_argument("--population", type=int, default=100, help="evolution population (OFA: 100)")
    p.add_argument("--iterations", type=int, default=50, help="evolution iterations (OFA: 500)")
    p.add_argument("--valid-size", type=int, default=1000, help="held-out samples taken from the training set")
    p.add_argument("--bn-batches", type=int, default=10, help="batches for BN re-calibration of each sub-network")
    p.add_argument("--measure", action="store_true", help="also time each answer whole on this machine")
    p.add_argument("--latency-margin", type=float, default=0.05,
                   help="search under the predicted budget less this fraction (room for the table's error)")
    p.add_argument("--verify", type=int, default=5,
                   help="time the N best candidates whole and answer with the best that runs within the full "
                        "budget (then the next N, up to 4N); 0: trust the table, as OFA does")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--quiet", action="store_true")


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``lowcomm elastic search``."""
    p.add_argument("--latency-ms", required=True, help="budget(s) in ms, comma-separated")
    p.add_argument("--random", type=int, default=50, help="random sub-networks under each budget (baseline; 0: none)")
    _add_common(p)


def add_extract_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``lowcomm elastic extract``."""
    p.add_argument("--config", default=None, help="max, min, a JSON object or a JSON file")
    p.add_argument("--latency-ms", default=None, help="extract the search's answer under this budget instead")
    p.add_argument("--out", required=True, help="the sub-network file to write")
    _add_common(p)
    p.set_defaults(random=0)
