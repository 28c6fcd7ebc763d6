"""The soak, 10 seconds: 64 clients of valid, invalid, oversized and hang-up requests; no 5xx, no wrong answer."""

from bench.reliability import soak


def test_ten_second_soak_has_no_5xx_and_no_wrong_answer(tiny_artifact):
    """No 5xx of any kind (503 and 504 included: a healthy server under 64 clients is neither at its connection
    limit nor past its request timeout); 429 (a full queue) is the one load refusal allowed. Every client was
    answered, however fast this machine is: no throughput is asserted."""
    clients = 64
    res = soak(tiny_artifact, seconds=10, clients=clients, warmup_s=2)
    s = res.summary()
    assert s["requests"] >= clients, s
    assert s["5xx"] == 0 and s["wrong_answers"] == 0 and not s["unexpected"], s
    assert set(s["statuses"]) <= {"200", "400", "413", "429"}, s
    assert s["by_kind"]["invalid"] > 0 and s["by_kind"]["oversized"] > 0 and s["hang_ups"] > 0, s
    assert {"v1-json", "v1-binary", "v2-json", "v2-binary", "v1-ragged"} <= set(s["by_kind"]), s
    assert s["fds"]["end"] <= s["fds"]["start"] + 2, s  # every connection closed is given back
