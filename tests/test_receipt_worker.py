"""server/receipt_worker.py: jobs run in order on one thread, `flush` waits for them, a
full queue holds the submitter back, a failing job does not stop the others, and nothing
submitted is dropped, before or after `close`."""

from __future__ import annotations

import threading
import time

import pytest

from wakefl.server.receipt_worker import ReceiptWorker


def test_jobs_run_in_order_on_one_thread_and_flush_waits_for_them():
    w = ReceiptWorker()
    ran: list[tuple[int, str]] = []
    for i in range(50):
        w.submit(lambda i=i: ran.append((i, threading.current_thread().name)))
    assert w.flush(10)
    assert [i for i, _ in ran] == list(range(50))
    assert {name for _, name in ran} == {"wakefl-receipts"}
    w.close()


def test_a_full_queue_holds_the_submitter_until_a_job_is_done():
    w = ReceiptWorker(max_queued=1)
    gate = threading.Event()
    w.submit(gate.wait)  # taken by the thread, which then blocks
    deadline = time.monotonic() + 5
    while not w.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    w.submit(lambda: None)  # fills the queue
    third = threading.Thread(target=w.submit, args=(lambda: None,))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # held back: one job queued, one running
    gate.set()
    third.join(5)
    assert not third.is_alive()
    assert w.flush(5)
    w.close()


def test_a_failing_job_is_logged_and_the_next_ones_still_run(caplog):
    w = ReceiptWorker()
    ran = []
    w.submit(lambda: 1 / 0)
    w.submit(lambda: ran.append("after"))
    assert w.flush(5)
    assert ran == ["after"]
    assert "folding an update into the round's receipts failed" in caplog.text
    w.close()


def test_close_runs_what_is_queued_and_later_jobs_run_in_the_caller():
    w = ReceiptWorker()
    ran = []
    for i in range(5):
        w.submit(lambda i=i: (time.sleep(0.01), ran.append(i)))
    w.close()
    assert ran == list(range(5))
    w.submit(lambda: ran.append(threading.current_thread().name))
    assert ran[-1] == threading.current_thread().name


def test_flush_times_out_while_a_job_runs():
    w = ReceiptWorker()
    gate = threading.Event()
    w.submit(gate.wait)
    assert w.flush(0.1) is False
    gate.set()
    assert w.flush(5)
    w.close()


def test_the_queue_bound_must_be_positive():
    with pytest.raises(ValueError, match="max_queued"):
        ReceiptWorker(max_queued=0)
