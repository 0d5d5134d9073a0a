"""The simulator and the advisor know lee18's model-parallel FC layers (``lee18:fc=...``)."""

from __future__ import annotations

from lowcomm.parallel.fc import data_parallel_bytes, model_parallel_bytes
from lowcomm.sim.advise import advise, model_parallel_fc
from lowcomm.sim.gpu_profiles import build_profile
from lowcomm.sim.network import NetworkModel
from lowcomm.sim.predict import predict_iteration_time
from lowcomm.sim.profile import LayerProfile, Profile
from lowcomm.sim.schedules.lee18_fc import model_parallel_layers

NET = NetworkModel.preset("1gbit")
VGG_FC = [(25088, 4096), (4096, 4096), (4096, 1000)]


def test_vgg16_at_batch_8_on_4_workers_sends_the_counted_bytes_and_beats_ddp() -> None:
    prof = build_profile("v100", "vgg16", batch_size=8)
    pred = {
        fc: predict_iteration_time(prof, f"lee18:fc={fc}", workers=4, network=NET)
        for fc in ("model_parallel", "data_parallel")
    }
    ssgd = predict_iteration_time(prof, "ssgd", workers=4, network=NET)
    mp_fc = sum(model_parallel_bytes(i, o, 8, 4) for i, o in VGG_FC)
    dp_fc = sum(data_parallel_bytes(i, o, 4) for i, o in VGG_FC)
    dp, mp = (
        pred["data_parallel"].wire_bytes_per_worker,
        pred["model_parallel"].wire_bytes_per_worker,
    )
    # the same bytes the training code counts (test_lee18_fc), up to the shard padding of lee18's groups
    assert abs((dp - mp) - (dp_fc - mp_fc)) <= 4 * 4 * len(VGG_FC)
    assert dp >= 5 * mp
    assert pred["model_parallel"].iter_time_s < ssgd.iter_time_s
    assert pred["model_parallel"].iter_time_s < pred["data_parallel"].iter_time_s


def head_profile(batch: int, width: int) -> Profile:
    """A conv layer and one width x width Linear head, 1 ms per pass each."""
    layers = [
        LayerProfile("conv", 1e-3, 1e-3, [[64, 3, 3, 3]]),
        LayerProfile("fc", 1e-3, 1e-3, [[width, width], [width]]),
    ]
    return Profile(model="toy", batch_size=batch, layers=layers, optimizer_s=1e-4)


def test_advise_says_model_parallel_fc_wins_for_wide_layers_at_small_batches_only() -> None:
    wide = model_parallel_fc(head_profile(8, 4096), workers=4, network=NET)
    assert wide is not None and wide["wins"] and wide["auto_layers"] == ["fc"]
    assert "lee18 with model-parallel FC" in wide["advice"]
    narrow = model_parallel_fc(head_profile(512, 256), workers=4, network=NET)
    assert narrow is not None and not narrow["wins"] and narrow["auto_layers"] == []
    assert "fc=data_parallel" in narrow["advice"]
    assert (
        model_parallel_fc(head_profile(8, 4094), workers=4, network=NET) is None
    )  # 4094 rows: no even split
    adv = advise(
        build_profile("v100", "vgg16", batch_size=8),
        workers=4,
        network=NET,
        methods=["ssgd", "lee18"],
        semi_sync=False,
    ).as_dict()
    assert adv["model_parallel_fc"]["wins"] and adv["recommended"] == "lee18:tune=true"  # with its fusion tuner, as dear


def test_the_engine_keeps_one_data_parallel_layer_and_auto_follows_the_batch() -> None:
    only_fc = Profile(
        model="toy", batch_size=8, layers=[LayerProfile("fc", 1e-3, 1e-3, [[4096, 4096]])]
    )
    assert model_parallel_layers(only_fc, 4, "model_parallel", 8) == []
    prof = head_profile(8, 4096)
    assert model_parallel_layers(prof, 4, "auto", 8) == [1]
    assert model_parallel_layers(prof, 4, "auto", 4096) == []
    assert model_parallel_layers(prof, 4, "data_parallel", 8) == []
