"""What every soak run in CI must show (bench/soak.py's summary): the faults it was told to fire and no other exit,
all steps done, every prompt trained exactly once and in order, no trajectory twice or unaudited, staleness within
the tiny recipe's --train.async_queue_size (2), no 500 from the gateway, RSS sampled for every service."""


def assert_soak_kept_its_promise(summary: dict, steps: int, killed: list[str]) -> None:
    from bench import soak

    assert summary["failure"] is None, summary["failure"]
    assert [e["killed"] for e in summary["events"] if "killed" in e] == killed, summary["events"]
    assert not [e for e in summary["events"] if "exited" in e], summary["events"]  # no exit we did not cause
    assert summary["steps_done"] == summary["steps_requested"] == steps
    assert summary["prompts_trained_once"] == summary["prompts_expected"] == steps * soak.PROMPTS_PER_STEP, summary
    assert summary["prompts_trained_twice_or_more"] == summary["prompts_never_trained"] == 0, summary
    assert summary["prompts_trained_out_of_order"] == 0, summary
    assert summary["trajectories_trained_twice"] == summary["trajectories_not_audited"] == 0, summary
    assert summary["staleness_max"] <= 2, summary
    assert "500" not in summary["gateway_requests_by_code"], summary["gateway_requests_by_code"]
    assert set(summary["rss_mib"]) == set(soak.SERVICES)
