"""How busy the worker's device is, for Stats (and from there the SLO predictor's windows).

On CUDA: NVML's utilisation and memory in use of the worker's GPU (`nvidia-ml-py`). Without a
GPU, or when NVML is unavailable: this process's CPU time over wall time since the previous
reading, divided by the cores torch may use, and its resident memory, with the engine process's (`pids`)
added. Readings say which they are.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("cotserve.worker")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (from /proc; 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class UtilizationProbe:
    def __init__(self, device: str, cores: int | None = None, pids: tuple[int, ...] = ()) -> None:
        self.cores = max(1, cores or os.cpu_count() or 1)
        self.pids = pids
        self._nvml = None
        if device.startswith("cuda"):
            try:
                import pynvml

                pynvml.nvmlInit()
                index = int(device.split(":", 1)[1]) if ":" in device else 0
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
            except Exception as exc:  # noqa: BLE001 - any NVML failure means "measure the CPU instead"
                log.warning("NVML unavailable (%s): reporting CPU utilisation instead of the GPU's", exc)
        self._last = (time.monotonic(), self._cpu_s())

    def _cpu_s(self) -> float:
        """CPU seconds of this process and of `pids`."""
        return time.process_time() + sum(process_cpu_seconds(pid) for pid in self.pids)

    @staticmethod
    def _rss(pid: str) -> int:
        try:
            with open(f"/proc/{pid}/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def read(self) -> tuple[float, bool, int]:
        """(utilisation 0..1, is it the CPU's, memory in use in bytes)."""
        if self._nvml is not None:
            nvml, handle = self._nvml
            return nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0, False, int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        now = (time.monotonic(), self._cpu_s())
        wall, cpu = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        util = min(1.0, cpu / wall / self.cores) if wall > 0 else 0.0
        return util, True, self._rss("self") + sum(self._rss(str(p)) for p in self.pids)
