"""Two runs with one seed start from the same weights, whatever ran before them in the process."""

from __future__ import annotations

import subprocess
import sys

import torch

from lowcomm.runtime.config import TrainConfig


def _initial_weights(model: str) -> dict[str, torch.Tensor]:
    from lowcomm.runtime import trainer as trainer_module

    seen: dict[str, torch.Tensor] = {}
    build = trainer_module.build_model

    def spy(cfg, bundle):  # type: ignore[no-untyped-def]
        net = build(cfg, bundle)
        seen.update({k: v.detach().clone() for k, v in net.state_dict().items()})
        return net

    trainer_module.build_model = spy  # type: ignore[assignment]
    try:
        cfg = TrainConfig(model=model, data="mnist1d", nproc=1, batch_size=64, epochs=1, steps=1,
                          eval=False, progress=False, threads=1)
        t = trainer_module.Trainer(cfg)
        t.close()
    finally:
        trainer_module.build_model = build  # type: ignore[assignment]
    return seen


def test_a_second_run_in_the_process_starts_from_the_first_runs_weights() -> None:
    first, second = _initial_weights("mlp"), _initial_weights("mlp")
    assert first.keys() == second.keys()
    for k in first:
        assert torch.equal(first[k], second[k]), k


def test_importing_the_model_modules_draws_nothing_from_the_rng() -> None:
    code = ("import torch; torch.manual_seed(0); s = torch.random.get_rng_state().clone()\n"
            "import lowcomm.models as m; m.MODELS.get('mlp')  # imports every model module\n"
            "print(torch.equal(s, torch.random.get_rng_state()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stderr
