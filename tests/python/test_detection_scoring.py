"""bench/detection.py's scoring, on hand-written step_stats rows: what counts as a detection, how
many steps after the onset, which flags are false, and the run-level precision/recall/F1. No
training and no collector: the benchmark itself runs those."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "detection", Path(__file__).resolve().parents[2] / "bench" / "detection.py"
)
detection = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(detection)


def rows(*flags):
    """(step, outlier_ranks, replica_divergent_ranks, duplicate_groups, drifting_ranks,
    slow_ranks) for steps 0..9, with `flags` = (step, column, text) set on top of empty rows."""
    table = {s: [s, "", "", "", "", ""] for s in range(10)}
    col = {"outlier": 1, "replica": 2, "duplicate": 3, "drifting": 4, "slow": 5}
    for step, column, text in flags:
        table[step][col[column]] = text
    return [tuple(r) for r in table.values()]


def run(fault="noise100", rank=2, onset=4, partner=None):
    return {"fault": fault, "rank": rank, "onset": onset, "partner": partner}


def test_the_faulty_rank_named_after_the_onset_is_a_detection():
    s = detection.score_run(run(), rows((6, "outlier", "2"), (7, "outlier", "2")))
    assert (s["detected"], s["delay"], s["how"], s["false_flags"]) == (True, 2, "outlier", [])


def test_replica_divergence_counts_and_on_the_onset_step_the_delay_is_zero():
    s = detection.score_run(run("bitflip"), rows((4, "replica", "2")))
    assert (s["detected"], s["delay"], s["how"]) == (True, 0, "replica")


def test_flags_before_the_onset_or_on_other_ranks_are_false():
    s = detection.score_run(
        run(), rows((3, "outlier", "2"), (5, "outlier", "1,2"), (8, "duplicate", "0,3"))
    )
    assert s["detected"] and s["delay"] == 1
    assert s["false_flags"] == [(3, "outlier", [2]), (5, "outlier", [1]), (8, "duplicate", [0, 3])]


def test_drifting_and_slow_ranks_name_the_rank_and_can_be_false():
    s = detection.score_run(run("noise10"), rows((9, "drifting", "2"), (7, "slow", "2")))
    assert (s["detected"], s["delay"], s["how"], s["false_flags"]) == (True, 3, "slow", [])
    s = detection.score_run(run("straggler"), rows((3, "slow", "2"), (8, "drifting", "0,2")))
    assert (s["detected"], s["delay"], s["how"]) == (True, 4, "drifting")
    assert s["false_flags"] == [(3, "slow", [2]), (8, "drifting", [0])]
    clean = {"fault": "clean", "rank": None, "onset": None}
    assert detection.score_run(clean, rows((5, "slow", "1")))["false_flags"] == [(5, "slow", [1])]
    # Rows of the four older columns still score.
    assert detection.score_run(run(), [(6, "2", "", "")])["detected"]


def test_duplicates_need_the_exact_group():
    dup = run("duplicate", rank=3, onset=2, partner=1)
    s = detection.score_run(
        dup,
        rows(
            (2, "duplicate", "0,1,3"),
            (3, "duplicate", "1,3"),
            (4, "outlier", "3"),
            (5, "outlier", "0"),
        ),
    )
    assert (s["detected"], s["delay"], s["how"]) == (True, 1, "duplicate")
    # A group with a third rank is wrong; an outlier flag on a duplicated rank is not a false
    # flag (nor a detection), on another rank it is.
    assert s["false_flags"] == [(2, "duplicate", [0, 1, 3]), (5, "outlier", [0])]
    assert not detection.score_run(dup, rows((5, "outlier", "3")))["detected"]


def test_anything_in_a_clean_run_is_false():
    clean = {"fault": "clean", "rank": None, "onset": None}
    s = detection.score_run(clean, rows((9, "outlier", "0"), (9, "duplicate", "1,2;0,3")))
    assert not s["detected"]
    assert s["false_flags"] == [
        (9, "outlier", [0]),
        (9, "duplicate", [1, 2]),
        (9, "duplicate", [0, 3]),
    ]
    assert detection.score_run(clean, rows())["false_flags"] == []


def test_run_level_precision_recall_f1_and_median_delay():
    results = [
        {"fault": "noise100", "detected": True, "delay": 2, "false_flags": []},
        {"fault": "noise100", "detected": True, "delay": 5, "false_flags": [(1, "outlier", [0])]},
        {"fault": "noise10", "detected": False, "delay": None, "false_flags": []},
        {"fault": "clean", "detected": False, "delay": None, "false_flags": [(3, "outlier", [1])]},
        {"fault": "clean", "detected": False, "delay": None, "false_flags": []},
    ]
    s = detection.summarize(results)
    assert (s["runs"], s["tp"], s["fn"], s["fp"]) == (5, 2, 1, 2)
    assert s["precision"] == 0.5 and s["recall"] == 2 / 3
    assert abs(s["f1"] - 2 * 0.5 * (2 / 3) / (0.5 + 2 / 3)) < 1e-12
    assert s["median_delay"] == 3.5
    only_clean = detection.summarize(results[3:])
    assert (only_clean["precision"], only_clean["recall"], only_clean["f1"]) == (0.0, None, None)


def test_the_plan_is_a_function_of_the_seed_alone():
    a = detection.plan_run(17, 8, "duplicate", 3, 60)
    assert a == detection.plan_run(17, 8, "duplicate", 3, 60)
    assert a != detection.plan_run(18, 8, "duplicate", 3, 60)
    assert 15 <= a["onset"] <= 30 and a["partner"] != a["rank"] and 0 <= a["rank"] < 8
    clean = detection.plan_run(17, 4, "clean", 0, 60)
    assert clean["rank"] is None and clean["onset"] is None
