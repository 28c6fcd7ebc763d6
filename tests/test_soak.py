"""The soak, 10 seconds: 64 clients of valid, invalid, oversized and hang-up requests; no 5xx, no wrong answer."""

from bench.reliability import soak


def test_ten_second_soak_has_no_5xx_and_no_wrong_answer(tiny_artifact):
    res = soak(tiny_artifact, seconds=10, clients=64, warmup_s=2)
    s = res.summary()
    assert s["requests"] > 500, s
    assert s["unexpected_5xx"] == 0 and s["wrong_answers"] == 0 and not s["unexpected"], s
    assert set(s["statuses"]) <= {"200", "400", "413", "429", "503", "504"}, s
    assert s["by_kind"]["invalid"] > 0 and s["by_kind"]["oversized"] > 0 and s["hang_ups"] > 0, s
    assert {"v1-json", "v1-binary", "v2-json", "v2-binary", "v1-ragged"} <= set(s["by_kind"]), s
    assert s["fds"]["end"] <= s["fds"]["start"] + 2, s  # every connection closed is given back
