"""benchmarks/first_call.py: one program's trial, the ratios and the generated table."""
from __future__ import annotations

from benchmarks import first_call


def test_a_trial_times_both_first_calls_and_says_where_tfmems_went(tmp_path) -> None:
    record = first_call.trial("knn_inner_product", steps=1, plan_cache=str(tmp_path))
    assert record["stock"]["first_seconds"] > 0 and record["tfmem"]["step_seconds"] > 0
    assert set(record["stages"]) == {"trace", "rewrite", "xla check", "compile and run"}
    assert record["budget_bytes"] == record["unchanged_estimate_bytes"] // 2 and record["splits"] >= 1
    assert record["plan_from_cache"] == "" and list(tmp_path.iterdir())  # the plan was kept
    again = first_call.trial("knn_inner_product", steps=1, plan_cache=str(tmp_path))
    assert again["plan_from_cache"]  # found in the same process too: same trace, config, budget
    assert set(first_call.ratios(record)) == {"first", "step"}


def test_the_table_summarises_the_ratios_it_was_given() -> None:
    def record(name: str, first: float, step: float) -> dict:
        return {"program": name, "budget_bytes": 2**20, "stock": {"first_seconds": 1.0, "step_seconds": 1.0},
                "tfmem": {"first_seconds": first, "step_seconds": step}, "stages": {}, "splits": 1, "fits": True,
                "xla_checked": first > 2}

    data = {"date": "d", "commit": "c", "machine": "m",
            "programs": [record("a", 1.0, 1.0), record("b", 3.0, 1.2), record("c", 1.1, 0.9),
                         {"program": "d", "status": "timeout", "error": "slow"}]}
    text = first_call.markdown(data)
    assert "| first | 3 | 1.10 | 3.00 | 3.00 |" in text
    assert "| step | 3 | 1.00 | 1.20 | 1.20 |" in text
    assert "XLA's plan was asked for (one extra compilation) in 1 of 3 programs." in text
    assert "| d | | | | | | | | | | | | timeout: slow |" in text
