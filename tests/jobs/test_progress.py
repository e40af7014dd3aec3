"""jobs.progress: a job's count in its own units and the time left at the rate measured since its step began."""

from __future__ import annotations

from jobs.progress import Pace, read_count, time_left_text


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_time_left_is_the_steps_own_rate_times_what_is_left_of_its_count():
    clock = Clock()
    pace = Pace(clock=clock)
    # a score's last step fills the bar from 0.1 to 1.0: 4 sequences in 10 s, 24 left
    assert pace.say(0.1 + 0.9 * 4 / 32, "scoring: 4 of 32 sequences") == "scoring: 4 of 32 sequences"
    clock.t += 10.0
    assert pace.say(0.1 + 0.9 * 8 / 32, "scoring: 8 of 32 sequences") == "scoring: 8 of 32 sequences · about 60 s left"
    clock.t += 10.0
    assert pace.say(0.1 + 0.9 * 12 / 32, "scoring: 12 of 32 sequences") == (
        "scoring: 12 of 32 sequences · about 50 s left")
    clock.t += 10.0
    assert pace.say(1.0, "scoring: 32 of 32 sequences") == "scoring: 32 of 32 sequences"  # done: nothing left


def test_a_step_another_follows_says_its_time_is_this_steps_and_a_new_step_starts_its_own_clock():
    clock = Clock()
    pace = Pace(clock=clock)
    pace.say(0.05, "reference: 4 of 32 sequences")  # the reference fills 0.05 .. 0.3 of the bar
    clock.t += 300.0
    said = pace.say(0.05 + 0.25 * 28 / 32, "reference: 28 of 32 sequences")
    assert said == "reference: 28 of 32 sequences · about 50 s left in this step"
    # the scoring step that follows: its first count starts its own measure, not the reference's rate
    clock.t += 1.0
    assert pace.say(0.35, "scoring: 2 of 32 sequences") == "scoring: 2 of 32 sequences"
    clock.t += 1.0  # too little measured yet (a first batch carries warm-up)
    assert pace.say(0.4, "scoring: 4 of 32 sequences") == "scoring: 4 of 32 sequences"
    clock.t += 3.0
    assert pace.say(0.45, "scoring: 6 of 32 sequences").endswith("· about 26 s left")  # 1 s a sequence, 26 left


def test_what_follows_the_count_may_change_and_a_count_that_restarts_starts_the_measure_again():
    clock = Clock()
    pace = Pace(clock=clock)
    pace.say(0.1, "GEMM case 2 of 40: N=576 K=576 M=1 int8_row")
    clock.t += 4.0
    assert pace.say(0.2, "GEMM case 4 of 40: N=576 K=1536 M=16 fp8_row").endswith("· about 72 s left")
    clock.t += 4.0
    assert pace.say(0.2, "GEMM case 1 of 40: N=576 K=576 M=1 int8_row") == "GEMM case 1 of 40: N=576 K=576 M=1 int8_row"


def test_messages_without_a_count_or_with_an_estimate_of_their_own_pass_as_they_are():
    clock = Clock()
    pace = Pace(clock=clock)
    for message in ("loading smol", "reference log-probs from the cache (compact)",
                    "model.layers.3.mlp.down_proj (40 of 121, about 3 min left)"):
        pace.say(0.3, message)
        clock.t += 10.0
        assert pace.say(0.5, message) == message


def test_counts_and_times_read_as_a_person_writes_them():
    assert read_count("calibrated 12/32 sequences") == (12, 32, "sequences")
    assert read_count("streamed, block 3/30") == (3, 30, "")
    assert read_count("scoring: 12 of 32 sequences (whole model)") == (12, 32, "sequences")
    assert read_count("N=576 K=576 M=1") is None and read_count("9 of 3") is None
    assert [time_left_text(s) for s in (0.2, 40, 89, 200, 5400, 7200)] == ["1 s", "40 s", "89 s", "3 min", "1.5 h",
                                                                         "2.0 h"]
