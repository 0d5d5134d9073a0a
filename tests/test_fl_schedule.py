"""The federated scheduler: runtime fits, even warm-up, longest job first, resume, --slowdown."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lowcomm.errors import UsageError
from lowcomm.fl.schedule import (
    Plan,
    RuntimeModel,
    Scheduler,
    even_split,
    fit_runtime,
    longest_job_first,
    parse_slowdown,
    slow_down,
)

# float64 least squares on a handful of points: a few dozen roundings of values ~1
FIT_TOL = 1e-9


def _round(rng: np.random.Generator, n: int = 60) -> tuple[np.ndarray, np.ndarray]:
    clients = np.sort(rng.choice(1000, size=n, replace=False)).astype(np.int64)
    samples = rng.integers(10, 200, size=n).astype(np.int64)
    return clients, samples


def _feed(s: Scheduler, plan: Plan, samples: np.ndarray, models: list[RuntimeModel]) -> None:
    """Report each worker's exact model times for its clients (noiseless)."""
    for w, m in enumerate(models):
        mine = samples[plan.clients_of(w)]
        s.observe(w, mine, m.predict(mine))


def _makespan(plan: Plan, samples: np.ndarray, models: list[RuntimeModel]) -> float:
    return max(float(m.predict(samples[plan.clients_of(w)]).sum()) for w, m in enumerate(models))


def _assert_valid(plan: Plan, n: int, workers: int) -> None:
    assert plan.assignment.shape == (n,) and plan.assignment.dtype == np.int64
    assert ((plan.assignment >= 0) & (plan.assignment < workers)).all()
    # every client exactly once: the positions of all workers partition 0..n-1
    positions = np.concatenate([plan.clients_of(w) for w in range(workers)])
    assert sorted(positions.tolist()) == list(range(n))


def test_fit_recovers_slope_and_intercept_from_noiseless_times() -> None:
    x = np.array([10, 20, 35, 80, 120], dtype=np.float64)
    m = fit_runtime(x, 0.004 * x + 0.05)
    assert m is not None
    assert math.isclose(m.a, 0.004, rel_tol=FIT_TOL) and math.isclose(m.b, 0.05, rel_tol=FIT_TOL)


def test_a_rare_spike_does_not_move_the_fit() -> None:
    # a worker's first client pays lazy initialisation: 100x the usual time, once
    rng = np.random.default_rng(6)
    x = rng.integers(10, 200, size=300).astype(np.float64)
    y = 0.004 * x + 0.05
    y[0] += 100 * y.mean()
    m = fit_runtime(x, y)
    assert m is not None
    assert math.isclose(m.a, 0.004, rel_tol=FIT_TOL) and math.isclose(m.b, 0.05, rel_tol=FIT_TOL)


def test_a_worker_slowing_down_mid_window_is_not_taken_for_spikes() -> None:
    x = np.tile(np.array([20.0, 40.0, 60.0, 80.0]), 10)
    y = 0.001 * x
    y[20:] *= 3  # the second half of the window: 3x slower
    m = fit_runtime(x, y)
    assert m is not None and math.isclose(float(m.predict(np.array([50.0]))[0]), 0.1, rel_tol=1e-6)


def test_equal_sizes_fall_back_to_a_time_per_sample_that_predicts_them_exactly() -> None:
    m = fit_runtime(np.full(6, 40), np.full(6, 0.2))
    assert m is not None and m.b == 0.0
    assert math.isclose(float(m.predict(np.array([40]))[0]), 0.2, rel_tol=FIT_TOL)
    assert float(m.predict(np.array([80]))[0]) > 0.2  # and scales with the size


def test_fits_never_predict_negative_times() -> None:
    # a steep line with a negative intercept, and a decreasing (noisy) one
    for x, y in [(np.array([10.0, 20.0, 30.0]), np.array([0.01, 0.5, 1.0])),
                 (np.array([10.0, 20.0, 30.0]), np.array([0.3, 0.2, 0.1]))]:
        m = fit_runtime(x, y)
        assert m is not None and m.a >= 0 and m.b >= 0
        assert (m.predict(np.array([0.0, 1.0, 5.0, 100.0])) >= 0).all()


def test_no_observations_fit_nothing() -> None:
    assert fit_runtime(np.zeros(0), np.zeros(0)) is None


def test_even_split_is_equal_counts_in_contiguous_blocks_of_sorted_ids() -> None:
    clients = np.array([50, 3, 9, 41, 7, 12, 30], dtype=np.int64)  # not sorted on purpose
    a = even_split(clients, 3)
    by_id = a[np.argsort(clients)]
    assert by_id.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert even_split(np.arange(2), 4).tolist() == [0, 1]  # more workers than clients


def test_warm_up_rounds_split_evenly_then_the_fitted_plan_takes_over() -> None:
    rng = np.random.default_rng(0)
    models = [RuntimeModel(0.001, 0.002), RuntimeModel(0.003, 0.006)]  # worker 1 is 3x slower
    s = Scheduler(2, warmup_rounds=2)
    kinds = []
    for r in range(4):
        clients, samples = _round(rng)
        plan = s.plan(r, clients, samples)
        _assert_valid(plan, len(clients), 2)
        kinds.append(plan.kind)
        if plan.kind == "even":
            assert plan.predicted_s is None and plan.predicted_makespan_s is None
            assert plan.assignment.tolist() == even_split(clients, 2).tolist()
        _feed(s, plan, samples, models)
    assert kinds == ["even", "even", "fitted", "fitted"]


def test_longest_job_first_beats_the_even_split_with_a_3x_slow_worker() -> None:
    rng = np.random.default_rng(1)
    models = [RuntimeModel(0.001, 0.002), RuntimeModel(0.003, 0.006)]
    s = Scheduler(2, warmup_rounds=1)
    clients, samples = _round(rng, 200)
    _feed(s, s.plan(0, clients, samples), samples, models)
    clients, samples = _round(rng, 200)
    fitted = s.plan(1, clients, samples)
    even = Plan(even_split(clients, 2), "even")
    assert fitted.kind == "fitted" and fitted.predicted_makespan_s is not None
    # noiseless observations: the prediction is the true makespan of the plan
    assert math.isclose(fitted.predicted_makespan_s, _makespan(fitted, samples, models), rel_tol=FIT_TOL)
    # ideal is 1.5x (3/4 of the work on the fast worker instead of 1/2); greedy gets close
    assert _makespan(even, samples, models) / fitted.predicted_makespan_s > 1.4
    assert fitted.clients_per_worker(2)[0] > fitted.clients_per_worker(2)[1]


def test_noisy_timings_still_give_a_plan_well_under_the_even_makespan() -> None:
    # 20 % multiplicative noise on every observed client time (load, caches, the OS): the fit
    # averages it out; judged on the true (noiseless) makespan, as the 1.3x target is
    rng = np.random.default_rng(5)
    truth = [RuntimeModel(0.001, 0.002), RuntimeModel(0.003, 0.006)]
    s = Scheduler(2, warmup_rounds=2)
    for r in range(2):
        clients, samples = _round(rng, 200)
        plan = s.plan(r, clients, samples)
        for w, m in enumerate(truth):
            mine = samples[plan.clients_of(w)]
            s.observe(w, mine, m.predict(mine) * rng.uniform(0.8, 1.2, size=mine.size))
    clients, samples = _round(rng, 200)
    fitted = s.plan(2, clients, samples)
    even = Plan(even_split(clients, 2), "even")
    assert _makespan(even, samples, truth) / _makespan(fitted, samples, truth) > 1.3


def test_even_policy_never_fits() -> None:
    rng = np.random.default_rng(2)
    s = Scheduler(2, policy="even", warmup_rounds=0)
    for r in range(3):
        clients, samples = _round(rng)
        plan = s.plan(r, clients, samples)
        assert plan.kind == "even"
        _feed(s, plan, samples, [RuntimeModel(0.001, 0.0), RuntimeModel(0.004, 0.0)])


def test_a_worker_that_slows_down_is_noticed_once_old_rounds_leave_the_window() -> None:
    rng = np.random.default_rng(3)
    s = Scheduler(2, warmup_rounds=1, window=2)
    fast = [RuntimeModel(0.001, 0.0), RuntimeModel(0.001, 0.0)]
    slow = [RuntimeModel(0.001, 0.0), RuntimeModel(0.004, 0.0)]
    for r in range(3):
        clients, samples = _round(rng)
        _feed(s, s.plan(r, clients, samples), samples, fast)
    for r in range(3, 5):
        clients, samples = _round(rng)
        _feed(s, s.plan(r, clients, samples), samples, slow)
    models = s.models()
    assert models[1] is not None and math.isclose(models[1].a, 0.004, rel_tol=FIT_TOL)


def test_recent_rounds_weigh_more_in_the_fit() -> None:
    s = Scheduler(1, warmup_rounds=1, window=5, decay=0.5)
    x = np.array([20.0, 40.0, 60.0])
    s.observe(0, x, 0.004 * x)  # a slow first round (cold caches)
    s.observe(0, x, 0.001 * x)
    m = s.models()[0]
    # weights 1/2 and 1 on the same sizes: a = (0.5 * 0.004 + 1 * 0.001) / 1.5
    assert m is not None and math.isclose(m.a, 0.002, rel_tol=FIT_TOL) and m.b < FIT_TOL


def test_an_idle_worker_borrows_the_pooled_fit() -> None:
    s = Scheduler(3, warmup_rounds=1)
    plan = s.plan(0, np.array([4, 8]), np.array([20, 30]))
    assert plan.clients_per_worker(3) == [1, 1, 0]
    _feed(s, plan, np.array([20, 30]), [RuntimeModel(0.01, 0.0)] * 3)
    nxt = s.plan(1, np.array([1, 2, 3]), np.array([30, 30, 30]))
    assert nxt.kind == "fitted" and sorted(nxt.assignment.tolist()) == [0, 1, 2]


def test_zero_cost_predictions_still_spread_the_clients() -> None:
    a, predicted = longest_job_first(np.array([5, 5, 5, 5]), [RuntimeModel(0.0, 0.0)] * 2)
    assert sorted(a.tolist()) == [0, 0, 1, 1] and predicted == [0.0, 0.0]


def test_state_dict_round_trip_gives_identical_plans() -> None:
    rng = np.random.default_rng(4)
    models = [RuntimeModel(0.0012, 0.003), RuntimeModel(0.0031, 0.001), RuntimeModel(0.002, 0.0)]
    a = Scheduler(3, warmup_rounds=1, window=2)
    for r in range(4):
        clients, samples = _round(rng)
        _feed(a, a.plan(r, clients, samples), samples, models)
    b = Scheduler(3, warmup_rounds=1, window=2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for r in range(4, 7):
        clients, samples = _round(rng)
        pa, pb = a.plan(r, clients, samples), b.plan(r, clients, samples)
        assert pa.kind == pb.kind == "fitted"
        assert pa.assignment.tolist() == pb.assignment.tolist() and pa.predicted_s == pb.predicted_s
        _feed(a, pa, samples, models)
        _feed(b, pb, samples, models)


def test_state_for_another_worker_count_is_refused() -> None:
    with pytest.raises(UsageError, match="--nproc"):
        Scheduler(3).load_state_dict(Scheduler(2).state_dict())


def test_plan_record_has_the_c5_keys() -> None:
    plan = Plan(np.array([0, 1, 0]), "fitted", [0.5, 0.25])
    rec = plan.record(np.array([10, 20, 30]), [0.6, 0.2], 2)
    assert rec == {"kind": "fitted", "clients_per_worker": [2, 1], "samples_per_worker": [40, 20],
                   "predicted_s_per_worker": [0.5, 0.25], "actual_s_per_worker": [0.6, 0.2]}
    assert plan.predicted_makespan_s == 0.5


@pytest.mark.parametrize("kwargs", [{"policy": "random"}, {"warmup_rounds": -1}, {"window": 0},
                                    {"decay": 0.0}, {"decay": 1.5}])
def test_bad_scheduler_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        Scheduler(2, **kwargs)


def test_parse_slowdown_reads_one_factor_per_worker() -> None:
    assert parse_slowdown("1,1,2,4", 4) == [1.0, 1.0, 2.0, 4.0]
    assert parse_slowdown(" 1 , 2.5 ", 2) == [1.0, 2.5]


@pytest.mark.parametrize("text,nproc", [("1,3", 3), ("1,0.5", 2), ("1,nan", 2), ("1,inf", 2),
                                        ("1,x", 2), ("", 1), ("1,,3", 3)])
def test_parse_slowdown_refuses_bad_factors_and_says_what_is_valid(text: str, nproc: int) -> None:
    with pytest.raises(UsageError, match=f"one factor >= 1 per worker.*{nproc} values for --nproc {nproc}"):
        parse_slowdown(text, nproc)


def test_slow_down_sleeps_factor_minus_one_times_the_compute() -> None:
    assert slow_down(1.0, 5.0) == 0.0
    assert slow_down(3.0, 0.0) == 0.0
    assert math.isclose(slow_down(3.0, 0.001), 0.002)
