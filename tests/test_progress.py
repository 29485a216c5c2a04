"""store_backends.Progress: the one progress line of `ucm` and `ucm-bench`."""

from __future__ import annotations

import io
import threading

from store_backends import Progress
from store_backends import progress as progress_module


def test_a_known_total_draws_a_bar_with_the_count_and_share():
    stream = io.StringIO()
    bar = Progress(True, "verify", total=4, stream=stream)
    bar.advance(3)
    assert stream.getvalue() == "\rverify: [" + "#" * 18 + " " * 6 + "] 3/4 keys (75%)"


def test_an_unknown_total_draws_the_count_alone_in_the_unit_given():
    stream = io.StringIO()
    Progress(True, "listing", unit="calls", stream=stream).advance(5)
    assert stream.getvalue() == "\rlisting: 5 calls"


def test_redraws_come_at_most_five_times_a_second(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()
    bar = Progress(True, "stats", stream=stream)
    bar.advance(1)
    bar.advance(1)
    clock[0] += progress_module.REDRAW_INTERVAL_S
    bar.advance(1)
    assert stream.getvalue().split("\r")[1:] == ["stats: 1 keys", "stats: 3 keys"]


def test_add_only_counts_and_the_main_thread_draws_the_total_of_every_thread():
    stream = io.StringIO()
    bar = Progress(True, "put store", total=8 * 1000, unit="calls", stream=stream)

    def work() -> None:
        for _ in range(1000):
            bar.add()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stream.getvalue() == ""
    bar.draw(force=True)
    assert stream.getvalue().endswith("8000/8000 calls (100%)")


def test_a_shorter_line_covers_the_longer_one_before_it():
    stream = io.StringIO()
    bar = Progress(True, "a long label", stream=stream)
    bar.advance(1)
    bar.label = "short"
    bar.draw(force=True)
    first, second = stream.getvalue().split("\r")[1:]
    assert second.startswith("short: 1 keys") and len(second) == len(first)


def test_close_wipes_a_drawn_line_and_writes_nothing_otherwise():
    stream = io.StringIO()
    bar = Progress(True, "deleting", stream=stream)
    bar.close()
    assert stream.getvalue() == ""
    bar.advance(2)
    drawn = stream.getvalue()
    bar.close()
    assert stream.getvalue() == drawn + "\r" + " " * len("deleting: 2 keys") + "\r"


def test_a_disabled_report_counts_but_never_writes():
    stream = io.StringIO()
    bar = Progress(False, "verify", total=2, stream=stream)
    bar.advance(2)
    bar.draw(force=True)
    bar.close()
    assert bar.count == 2 and stream.getvalue() == ""


def test_it_writes_to_the_stderr_of_the_moment_by_default(capsys):
    Progress(True, "verify").advance(1)
    assert capsys.readouterr().err == "\rverify: 1 keys"
