"""Large results are marked for transparent huge pages before the kernels first write them
(convgen.runtime.memory): read back from the kernel's own record of the mapping, /proc/self/smaps."""

import ctypes
import mmap
import sys
from pathlib import Path

import pytest

from convgen.runtime import memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(),
                                reason="transparent huge pages are Linux's, where the kernel has them")


def _huge_page_advised(address: int) -> bool:
    """Whether the mapping holding `address` carries MADV_HUGEPAGE's flag ("hg" in its VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(v, 16) for v in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


def test_a_large_region_is_advised_and_a_small_one_is_not():
    size = memory.MIN_BYTES + 4 * memory.HUGE_PAGE
    region = mmap.mmap(-1, size)  # fresh anonymous memory, no flags of its own
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    middle = address + size // 2
    assert not _huge_page_advised(middle)
    memory.advise_huge_pages(address, memory.MIN_BYTES - 1)  # below the threshold: nothing asked
    assert not _huge_page_advised(middle)
    memory.advise_huge_pages(address, size)
    assert _huge_page_advised(middle)
    memory.advise_huge_pages(0, 0)  # nothing at all: no error


def test_convgen_torch_advises_the_large_results_it_makes():
    """PyTorch's allocator does not mark its tensors (NumPy's does): convgen.torch marks a result
    of MIN_BYTES or more, from the eager ops and from a fused model."""
    torch = pytest.importorskip("torch")
    import convgen.torch as cgt

    x = torch.ones(1, 1, 1024, 1024)
    w = torch.ones(16, 1, 1, 1)  # a 64 MiB result
    with torch.no_grad():
        y = cgt.conv2d(x, w)
        fused = cgt.fuse(torch.nn.Sequential(torch.nn.Conv2d(1, 16, 1), torch.nn.ReLU()).eval(),
                         memory_format="preserve").model(x)
    for result in (y, fused):
        assert result.numel() * 4 >= memory.MIN_BYTES
        assert _huge_page_advised(result.data_ptr() + result.numel() * 2)
    plain = torch.empty(16 << 20)  # PyTorch's own: not marked (else this test could not fail)
    assert not _huge_page_advised(plain.data_ptr() + plain.numel() * 2)
