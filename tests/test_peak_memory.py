"""``peak_memory_bytes`` (every logged record) is the run's high-water mark since start-up, also
after the memory-measured iteration (memory.PeakTensorMemory) measured its own peak."""

import torch

from megalite.memory import PeakTensorMemory
from megalite.parallel_state import peak_memory_bytes


class FakeCudaAllocator:
    """torch.cuda's allocated-bytes counters, driven by hand (this test runs without a GPU)."""

    def __init__(self):
        self.live = self.peak = 0

    def alloc(self, n):
        self.live += n
        self.peak = max(self.peak, self.live)

    def free(self, n):
        self.live -= n

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.live


def test_cuda_peak_survives_the_measured_iteration(monkeypatch):
    fake = FakeCudaAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    dev = torch.device("cuda", 0)
    fake.alloc(1000)  # start-up (e.g. a checkpoint load) peaks at 1000 bytes
    fake.free(800)
    assert peak_memory_bytes(dev) == 1000
    with PeakTensorMemory(dev) as probe:  # the measured iteration: 200 live, peaks at 500
        fake.alloc(300)
        fake.free(300)
    assert probe.peak_bytes == 500  # the iteration's own peak
    assert peak_memory_bytes(dev) == 1000  # still the run's
    fake.alloc(1300)  # a later iteration goes higher
    assert peak_memory_bytes(dev) == 1500


def test_cpu_peak_survives_the_measured_iteration():
    """On CPU the record is the process's peak RSS, which the measurement (profiler-based) never
    resets: the same contract."""
    before = peak_memory_bytes(torch.device("cpu"))
    with PeakTensorMemory("cpu") as probe:
        x = torch.ones(1 << 16)
        del x
    assert probe.peak_bytes >= 4 << 16
    assert peak_memory_bytes(torch.device("cpu")) >= before > 0
