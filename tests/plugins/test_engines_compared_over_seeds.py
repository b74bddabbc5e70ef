"""benchmarks/engines_agree.py sets two engines' final rewards side by side: the signed difference of their
means (second engine minus first) with its standard error from each engine's own seed variance, and several
--save files summarised together as one set of runs (seeds run at different times)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import benchmark_module


@pytest.fixture
def bench():
    with benchmark_module("engines_agree") as module:
        yield module


def run(engine: str, seed: int, final: float, steps: int = 60) -> dict:
    rewards = [0.0] * (steps - 6) + [final] * 6  # the last tenth of the steps at ``final``
    return {"engine": engine, "seed": seed, "steps": steps, "seconds": 1.0, "reward": rewards,
            "exact": rewards, "logprob_gap": 0.0}  # fmt: skip


def test_the_difference_is_signed_second_minus_first_with_a_welch_standard_error(bench):
    local, vllm = [0.70, 0.80, 0.90], [0.85, 0.86, 0.87]
    runs = [run("local", i, x) for i, x in enumerate(local)] + [run("vllm", i, x) for i, x in enumerate(vllm)]
    out = bench.summary(runs, ["local", "vllm"], tolerance=3.0)
    assert out["difference"] == pytest.approx(0.06, abs=1e-4)  # vllm's mean over local's
    se = math.sqrt(0.01 / 3 + 0.0001 / 3)  # each engine's own sample variance over its seeds
    assert out["difference_se"] == pytest.approx(se, abs=1e-4)
    assert out["gap"] == pytest.approx(0.06, abs=1e-4)
    flipped = bench.summary(runs, ["vllm", "local"], tolerance=3.0)
    assert flipped["difference"] == pytest.approx(-0.06, abs=1e-4)


def test_one_seed_of_an_engine_gives_no_standard_error(bench):
    out = bench.summary([run("local", 0, 0.8), run("vllm", 0, 0.9), run("vllm", 1, 0.7)], ["local", "vllm"], 3.0)
    assert out["difference"] == pytest.approx(0.0, abs=1e-4)
    assert out["difference_se"] is None


@pytest.mark.slow
def test_load_summarises_the_runs_of_several_saved_files_together(bench, tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps([run("local", 0, 0.7), run("vllm", 0, 0.8)]))
    second.write_text(json.dumps([run("local", 1, 0.9), run("vllm", 1, 0.8)]))
    out = bench.main(["--load", f"{first},{second}"])
    assert out["seeds"] == [0, 1]
    assert out["local"]["final"] == [0.7, 0.9] and out["vllm"]["final"] == [0.8, 0.8]
    assert out["difference"] == pytest.approx(0.0, abs=1e-4)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out  # the printed line is the summary


def save(path, runs) -> str:
    path.write_text(json.dumps(runs))
    return str(path)


def test_a_run_of_the_same_engine_and_seed_in_two_loaded_files_is_refused_not_counted_twice(bench, tmp_path, capsys):
    first = save(tmp_path / "a.json", [run("local", 0, 0.7), run("vllm", 0, 0.8), run("local", 1, 0.9)])
    again = save(tmp_path / "b.json", [run("local", 0, 0.7), run("vllm", 1, 0.8)])  # local seed 0 once more
    with pytest.raises(SystemExit) as stop:
        bench.main(["--load", f"{first},{again}"])  # counted twice, it would shrink difference_se unseen
    assert stop.value.code != 0
    err = capsys.readouterr().err
    assert "local" in err and "seed 0" in err


def test_load_of_a_missing_file_names_it_in_an_error_not_a_traceback(bench, tmp_path, capsys):
    good = save(tmp_path / "a.json", [run("local", 0, 0.7), run("vllm", 0, 0.8)])
    missing = tmp_path / "missing.json"
    with pytest.raises(SystemExit) as stop:
        bench.main(["--load", f"{good},{missing}"])
    assert stop.value.code != 0
    assert str(missing) in capsys.readouterr().err


def test_load_of_a_file_that_is_not_json_names_it_in_an_error(bench, tmp_path, capsys):
    good = save(tmp_path / "a.json", [run("local", 0, 0.7), run("vllm", 0, 0.8)])
    broken = tmp_path / "broken.json"
    broken.write_text("not json")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--load", f"{good},{broken}"])
    assert stop.value.code != 0
    assert str(broken) in capsys.readouterr().err


def test_load_of_files_holding_no_runs_says_so(bench, tmp_path, capsys):
    empty = save(tmp_path / "empty.json", [])
    with pytest.raises(SystemExit) as stop:
        bench.main(["--load", empty])  # not an IndexError from inside summary
    assert stop.value.code != 0
    assert "no runs" in capsys.readouterr().err


def test_load_of_runs_of_different_lengths_is_refused(bench, tmp_path, capsys):
    short = save(tmp_path / "a.json", [run("local", 0, 0.7), run("vllm", 0, 0.8)])
    long = save(tmp_path / "b.json", [run("local", 1, 0.7, steps=100), run("vllm", 1, 0.8, steps=100)])
    with pytest.raises(SystemExit) as stop:
        bench.main(["--load", f"{short},{long}"])  # final rewards at step 60 and step 100 are not one sample
    assert stop.value.code != 0
    err = capsys.readouterr().err
    assert "60" in err and "100" in err


def test_load_names_the_engines_in_the_order_given_and_the_difference_follows_it(bench, tmp_path):
    saved = save(tmp_path / "a.json", [run("local", 0, 0.7), run("vllm", 0, 0.8), run("local", 1, 0.9),
                                       run("vllm", 1, 1.0)])  # fmt: skip
    assert bench.main(["--load", saved])["difference"] == pytest.approx(0.1, abs=1e-4)
    assert bench.main(["--load", saved, "--engines", "vllm,local"])["difference"] == pytest.approx(-0.1, abs=1e-4)


def test_load_with_png_still_summarises_when_an_engine_has_no_runs(bench, tmp_path, capsys):
    saved = save(tmp_path / "a.json", [run("local", 0, 0.7), run("local", 1, 0.9)])
    png = tmp_path / "curves.png"
    out = bench.main(["--load", saved, "--png", str(png)])  # not a ValueError from plot, the JSON line lost
    assert out["vllm"] is None and out["agree"] is None
    assert png.exists()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out


def test_the_drawing_leaves_out_the_runs_the_summary_leaves_out(bench, tmp_path, monkeypatch):
    import matplotlib.figure

    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    stopped = run("vllm", 0, 0.8)
    stopped["reward"] = stopped["exact"] = stopped["reward"][:30]  # stopped after 30 of 60 steps
    saved = save(tmp_path / "a.json", [run("local", 0, 0.7), stopped, run("local", 1, 0.9), run("vllm", 1, 0.8)])
    out = bench.main(["--load", saved, "--png", str(tmp_path / "curves.png")])
    assert out["incomplete"] == [{"engine": "vllm", "seed": 0, "steps_done": 30}]
    lines = {line.get_label(): len(line.get_xdata()) for line in drawn[0].axes[0].get_lines()}
    assert lines == {"local (mean of 2 seeds)": 60, "vllm (mean of 1 seeds)": 60}  # not cut short at step 30


@pytest.mark.parametrize(
    "field",
    [{"seed": "zero"}, {"seed": 1.5}, {"steps": None}, {"engine": 3}, {"reward": "high"}],
    ids=["seed-word", "seed-fraction", "steps-null", "engine-number", "reward-not-a-list"],
)
def test_load_of_a_hand_edited_run_with_a_bad_field_names_the_file_not_a_traceback(bench, tmp_path, capsys, field):
    edited = save(tmp_path / "edited.json", [{**run("local", 0, 0.7), **field}, run("vllm", 0, 0.8)])
    with pytest.raises(SystemExit) as stop:
        bench.main(["--load", edited])
    assert stop.value.code != 0
    err = capsys.readouterr().err
    assert edited in err and "not a --save file" in err


def test_load_of_a_run_with_a_nan_reward_is_refused_not_averaged(bench, tmp_path, capsys):
    bad = run("local", 0, 0.7)
    bad["reward"][-1] = float("nan")  # json.dumps writes NaN; averaged, it would make every mean NaN
    path = save(tmp_path / "nan.json", [bad, run("vllm", 0, 0.8)])
    with pytest.raises(SystemExit) as stop:
        bench.main(["--load", path])
    assert stop.value.code != 0
    assert "finite rewards" in capsys.readouterr().err
