"""This process's GPU memory as NVML reports it, read through ctypes (never through the library
under test), once or polled: the independent reading every GPU script's usage marks use. A
process NVML does not list reads None, which the scripts count as a miss, never as 0."""

import ctypes
import os
import threading
import time


class NvmlUsage:
    """This process's used GPU memory from NVML, through ctypes (not through the library under
    test); None when NVML does not list the process."""

    class Proc(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                    ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

    def __init__(self):
        self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.nvml.nvmlInit_v2() == 0
        self.dev = ctypes.c_void_p()
        assert self.nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.dev)) == 0
        self.pid = os.getpid()

    def read(self):
        n = ctypes.c_uint(64)
        procs = (self.Proc * 64)()
        if self.nvml.nvmlDeviceGetComputeRunningProcesses_v3(self.dev, ctypes.byref(n), procs) != 0:
            return None
        for i in range(n.value):
            if procs[i].pid == self.pid:
                return int(procs[i].usedGpuMemory)
        return None


class Poller(threading.Thread):
    """Polls this process's usage every `period` seconds. `misses` counts polls NVML did not
    answer for this process; those before its first reading are expected (a poller starts before
    the process has a CUDA context), those after it (`misses_after_first`) are readings lost,
    which may have been the peak. `snapshot()` gives the peak so far."""

    def __init__(self, period=0.002):
        super().__init__(daemon=True)
        self.usage, self.period, self.peak, self.samples, self.misses, self.stop = NvmlUsage(), period, 0, 0, 0, False
        self.misses_after_first = 0

    def run(self):
        while not self.stop:
            u = self.usage.read()
            if u is None:
                self.misses += 1
                self.misses_after_first += self.samples > 0
            else:
                self.peak = max(self.peak, u)
                self.samples += 1
            time.sleep(self.period)

    def snapshot(self):
        """The peak read so far (None before the first reading)."""
        return self.peak if self.samples else None

    def finish(self):
        time.sleep(0.05)
        self.stop = True
        self.join()
