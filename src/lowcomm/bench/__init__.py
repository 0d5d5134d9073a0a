"""Measurement on one machine: an emulated cluster (netns + tc), a link probe, the
``lowcomm bench`` harness that runs each method through the trainer, and its reports."""
