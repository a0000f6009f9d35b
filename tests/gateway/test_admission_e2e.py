"""Admission through the real gateway and worker: queue deadlines, queue bounds, REALTIME bypass."""

from __future__ import annotations

import threading
import time

import pytest

from cotserve.sdk import Client, DeadlineExceeded, ResourceExhausted
from tests.conftest import start_gateway, stop_process, wait_worker_idle, worker_stats


def test_queued_batch_times_out_or_is_refused_without_reaching_the_worker(demo_worker):
    # No BATCH slot at all: every BATCH request queues (a long generation would be over in a
    # second on the demo model, so a held slot cannot be relied on).
    gw, address = start_gateway(demo_worker, extra=("--batch-limit", "0", "--max-queue-batch", "1"))
    try:
        with Client(address, timeout_s=60) as client:
            wait_worker_idle(demo_worker)
            before = worker_stats(demo_worker).num_requests_finished_total
            with pytest.raises(DeadlineExceeded):
                client.generate("3+4=", sla="batch", timeout_s=0.5)
            outcome: list[BaseException] = []

            def wait_in_queue() -> None:
                try:
                    client.generate("5+6=", sla="batch", timeout_s=3.0)
                except BaseException as exc:  # noqa: BLE001 - inspected below
                    outcome.append(exc)

            waiting = threading.Thread(target=wait_in_queue)
            waiting.start()
            time.sleep(0.5)  # it now fills the one-place BATCH queue
            with pytest.raises(ResourceExhausted) as err:
                client.generate("7+8=", sla="batch")
            assert "sla_class BATCH: the gateway queue for this worker is full (1 waiting)" in err.value.message
            assert err.value.retry_after_ms is not None and err.value.retry_after_ms >= 50
            # REALTIME is never queued in the gateway, whatever BATCH is doing
            assert client.generate("37+48-12=", sla="realtime", max_new_tokens=64).text.endswith("</think> 73")
            waiting.join(10)
            assert len(outcome) == 1 and isinstance(outcome[0], DeadlineExceeded)
            stats = wait_worker_idle(demo_worker)
            # the worker saw the REALTIME request and no BATCH one
            assert stats.num_requests_finished_total == before + 1
    finally:
        stop_process(gw)
