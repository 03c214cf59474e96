"""megalite/overlap.py on its own, no process group: the order in which a ``Pair`` hands over, a
side that raises, and where the deferred weight gradients (W) may run (docs/moe.md, "Deferring
the experts' weight gradients")."""

import threading

import pytest
import torch

from megalite import overlap
from megalite.overlap import Clock, Pair, WeightGradStore


class FakeWork:
    """An issued exchange that completes after ``polls`` calls of ``is_completed``."""

    def __init__(self, log, name, polls=0):
        self.log, self.name, self.polls = log, name, polls

    def is_completed(self):
        self.polls -= 1
        return self.polls < 0

    def wait(self):
        self.log.append(f"wait {self.name}")


@pytest.fixture
def exchanges(monkeypatch):
    """``overlap.exchange`` over fake all-to-alls: each returns a FakeWork (async) or None."""
    log, polls = [], {}

    def all_to_all_single(output, input, out_splits, in_splits, group, tag, async_op=False):
        log.append(f"issue {tag}")
        return FakeWork(log, tag, polls.get(tag, 0)) if async_op else None

    monkeypatch.setattr(overlap.C, "all_to_all_single", all_to_all_single)
    return log, polls


def _exchange(tag):
    t = torch.zeros(2)
    overlap.exchange(t, t, None, None, None, tag)


def test_pair_hands_over_at_each_exchange_and_runs_one_side_at_a_time(exchanges):
    log, _ = exchanges
    running = []

    def side(name, n):
        def fn():
            for i in range(n):
                running.append(threading.get_ident())
                log.append(f"{name} computes {i}")
                _exchange(f"{name}{i}")
        return fn

    pair = Pair(("F2", "B1"))
    with overlap.overlapping(pair):
        pair.run(side("F", 3), side("B", 2))
    assert log == [
        "F computes 0", "issue F0",  # F issues, hands over before waiting
        "B computes 0", "issue B0",
        "wait F0", "F computes 1", "issue F1",
        "wait B0", "B computes 1", "issue B1",
        "wait F1", "F computes 2", "issue F2",
        "wait B1",  # B ends: F's last exchange has no one to hand over to
        "wait F2"]
    assert len(set(running)) == 2  # two threads, never both running (the log is one order)


def test_outside_a_pair_an_exchange_blocks_and_records_one_wait(exchanges):
    log, _ = exchanges
    got = []
    with overlap.overlapping(None, Clock("cpu"), lambda kind, start, end: got.append(kind)):
        _exchange("moe_dispatch")
    assert log == ["issue moe_dispatch"] and got == ["A"]


def test_a_raising_side_aborts_the_pair_before_the_other_side_runs(exchanges):
    log, _ = exchanges

    def forward():
        log.append("F computes")
        raise ValueError("boom\nsecond line")

    def backward():
        log.append("B computes")
        _exchange("B0")

    pair = Pair(("F2.0", "B1.0"))
    with pytest.raises(RuntimeError) as err, overlap.overlapping(pair):
        pair.run(forward, backward)
    assert str(err.value) == ("rank 0: F2.0 raised ValueError: boom; its pair with B1.0 was "
                              "aborted")
    assert isinstance(err.value.__cause__, ValueError)
    assert log == ["F computes"]  # B never ran, so it issued no collective


def test_a_side_that_raises_later_stops_the_other_at_its_hand_over(exchanges):
    log, _ = exchanges

    def forward():
        _exchange("F0")
        log.append("F goes on")  # never: B raised while F waited for its turn
        _exchange("F1")

    def backward():
        log.append("B computes")
        raise RuntimeError("expert backward failed")

    pair = Pair(("F2", "B1"))
    with pytest.raises(RuntimeError, match=r"^rank 0: B1 raised RuntimeError: expert backward "
                                           r"failed; its pair with F2 was aborted$"):
        with overlap.overlapping(pair):
            pair.run(forward, backward)
    assert log == ["issue F0", "B computes"]  # F0 was never waited for, F1 never issued


def test_weight_grads_run_first_in_first_out_only_while_an_exchange_is_in_flight(exchanges):
    log, polls = exchanges
    store = WeightGradStore(on_run=lambda label, s, e: log.append(f"W{label} recorded"),
                            clock=Clock("cpu"))

    def queue_w(label, n):
        with store.capture(label) as queue:
            for i in range(n):
                queue.append(lambda i=i: log.append(f"W{label}.{i}"))

    queue_w(0, 2)  # left over from an earlier pair's backward
    polls["F0"] = 2  # in flight for two polls: room for two W's, the third poll sees it done

    def forward():
        _exchange("F0")

    def backward():
        queue_w(1, 2)
        log.append("B ends")

    pair = Pair(fill=store)
    with overlap.overlapping(pair):
        pair.run(forward, backward)
    assert log == ["issue F0", "B ends", "W0.0", "W0 recorded", "W0.1", "W0 recorded",
                   "wait F0"]  # oldest first, and none once the exchange has completed
    log.clear()
    store.flush(before=1)  # a pair's end: only older backwards' W's
    assert log == []
    store.flush()  # before the next op outside a pair that computes gradients: all
    assert log == ["W1.0", "W1 recorded", "W1.1", "W1 recorded"]
    assert not store.run_one()


def test_no_weight_grad_runs_at_the_issue_or_without_a_fill_store(exchanges):
    log, polls = exchanges
    store = WeightGradStore()
    with store.capture(0) as queue:
        queue.append(lambda: log.append("W"))
    polls["F0"] = 5
    pair = Pair()  # no fill store: --delay-wgrad-compute off
    with overlap.overlapping(pair):
        pair.run(lambda: _exchange("F0"), lambda: log.append("B"))
    assert log == ["issue F0", "B", "wait F0"]
    assert store.run_one() and log[-1] == "W"


def test_an_unlabelled_capture_is_no_fifo_group():
    """Zero-bubble W ops run their own B's W's: a capture without a label is no queue group."""
    store = WeightGradStore()
    with store.capture() as queue:
        assert store.capturing
        queue.append(lambda: None)
    assert not store.capturing and not store.groups and len(queue) == 1


def test_overlapping_restores_the_previous_pair_and_recorder(exchanges):
    log, _ = exchanges
    got = []
    with overlap.overlapping(None, Clock("cpu"), lambda kind, start, end: got.append(kind)):
        pair = Pair()
        with overlap.overlapping(pair, Clock("cpu"), lambda kind, start, end: got.append(kind)):
            pair.run(lambda: _exchange("F0"), lambda: None)
        _exchange("moe_combine")  # the step's recorder again, no pair: blocking
    _exchange("moe_dispatch")  # nothing installed: blocking, unrecorded
    assert got == ["I", "A", "A"]
    assert log == ["issue F0", "wait F0", "issue moe_combine", "issue moe_dispatch"]
