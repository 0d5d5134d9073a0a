"""``lowcomm bench --repeat R``: methods run in rounds, a row is the method's median run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowcomm.bench import harness, netns, report
from lowcomm.bench.repeats import combine, combine_rounds


def _row(method: str, t: float | None) -> dict[str, Any]:
    if t is None:
        return {"method": method, "status": "failed", "reason": "boom"}
    return {"method": method, "status": "ok", "iter_time_s_median": t, "tag": f"{method}@{t}"}


def test_a_row_is_the_median_run_with_every_time_in_round_order() -> None:
    row = combine([_row("ssgd", 2.9), _row("ssgd", 2.4), _row("ssgd", 2.6)])
    assert row["tag"] == "ssgd@2.6" and row["iter_time_s_median"] == 2.6
    assert row["repeat_iter_times_s"] == [2.9, 2.4, 2.6]
    assert row["repeat_spread"] == pytest.approx(0.5 / 2.6)
    assert row["repeat_failed"] == 0


def test_an_even_count_keeps_the_lower_middle_run_so_every_field_is_one_real_run() -> None:
    row = combine([_row("m", 4.0), _row("m", 1.0), _row("m", 3.0), _row("m", 2.0)])
    assert row["tag"] == "m@2.0"


def test_a_compute_reference_keeps_its_fastest_run() -> None:
    assert combine([_row("nocomm", 1.2), _row("nocomm", 1.0), _row("nocomm", 1.5)], pick="fastest")["tag"] == "nocomm@1.0"


def test_failed_runs_are_counted_and_only_failures_give_the_first_failure() -> None:
    row = combine([_row("m", None), _row("m", 2.0), _row("m", 3.0)])
    assert row["status"] == "ok" and row["repeat_failed"] == 1 and row["repeat_iter_times_s"] == [2.0, 3.0]
    failed = combine([_row("m", None), _row("m", None)])
    assert failed["status"] == "failed" and failed["repeat_failed"] == 2


def test_rounds_must_run_the_same_methods_in_the_same_order() -> None:
    with pytest.raises(ValueError, match="same methods"):
        combine_rounds([[_row("a", 1.0), _row("b", 1.0)], [_row("b", 1.0), _row("a", 1.0)]], references=set())
    rows = combine_rounds([[_row("nocomm", 1.0), _row("a", 3.0)], [_row("nocomm", 0.8), _row("a", 2.0)],
                           [_row("nocomm", 0.9), _row("a", 4.0)]], references={"nocomm"})
    assert [r["tag"] for r in rows] == ["nocomm@0.8", "a@3.0"]


def _launcher(times: dict[str, Any], launched: list[str]) -> Any:
    """A stand-in for the workers: writes the summary a trainer would, with the next time given."""
    def launch(worker_args: list[str], nproc: int, **kw: Any) -> int:
        method = worker_args[worker_args.index("--method") + 1]
        launched.append(method)
        it = next(times[method])
        Path(worker_args[worker_args.index("--json") + 1]).write_text(json.dumps(
            {"iter_time_s_median": it, "bytes_per_worker_per_iter": 8e6 if method != "nocomm" else 0.0,
             "breakdown_s": {"forward": it / 3, "backward": it / 3}}))
        return 0
    return launch


def _config(tmp_path: Path, repeat: int) -> harness.BenchConfig:
    return harness.BenchConfig(methods=["ssgd", "fp16"], nets=[netns.parse_net("none")], nproc=2, model="cnn1d",
                               batch_size=16, work_dir=str(tmp_path), quiet=True, predict=False, repeat=repeat)


def test_the_bench_interleaves_rounds_and_bounds_use_the_fastest_compute_only_run(tmp_path: Path) -> None:
    times = {"nocomm": iter([0.3, 0.2, 0.25]), "ssgd": iter([1.0, 1.4, 1.2]), "fp16": iter([0.6, 0.5, 0.9])}
    launched: list[str] = []
    result = harness.run_bench(_config(tmp_path, 3), launcher=_launcher(times, launched))
    # round after round, and no second nocomm run inside a round: the rounds are the repeats
    assert launched == ["nocomm", "ssgd", "fp16"] * 3
    rows = {r["method"]: r for r in result["runs"]}
    assert list(rows) == ["nocomm", "ssgd", "fp16"]
    assert rows["nocomm"]["iter_time_s_median"] == 0.2
    assert rows["ssgd"]["iter_time_s_median"] == 1.2 and rows["ssgd"]["repeat_iter_times_s"] == [1.0, 1.4, 1.2]
    assert rows["fp16"]["iter_time_s_median"] == 0.6
    assert all(r["compute_only_s"] == 0.2 for r in rows.values())
    assert rows["fp16"]["speedup_vs_ssgd"] == pytest.approx(1.2 / 0.6)
    assert result["repeat"] == 3
    md = report.markdown(result)
    assert "| run spread |" in md and "33% of 3" in md and "3 rounds" in md


def test_one_round_keeps_the_single_run_layout(tmp_path: Path) -> None:
    times = {"nocomm": iter([0.3, 0.2]), "ssgd": iter([1.0]), "fp16": iter([0.6])}
    launched: list[str] = []
    result = harness.run_bench(_config(tmp_path, 1), launcher=_launcher(times, launched))
    assert launched == ["nocomm", "ssgd", "fp16", "nocomm"]  # compute-only before and after, as before
    assert all("repeat_iter_times_s" not in r for r in result["runs"])
    assert "run spread" not in report.markdown(result)


@pytest.mark.parametrize(("argv", "message"), [
    (["--repeat", "0"], "--repeat must be an integer from 1"),
    (["--repeat", "2", "--epochs", "2"], "--repeat applies to timing runs"),
])
def test_cli_refuses_a_bad_repeat_with_exit_2(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from lowcomm.cli import main

    assert main(["bench", "--methods", "ssgd", "--net", "none", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
