"""Ordered parallel map over threads (numba kernels, torch ops, pread and hashlib release the
GIL), with a bounded window so at most 2 * workers results are held at once."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor


def ordered_map(fn, items, workers: int, name: str = "beam-convert"):
    """map(fn, items) over `workers` threads, in order, at most 2 * workers results pending."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        window: deque = deque()
        for item in items:
            window.append(pool.submit(fn, item))
            if len(window) >= 2 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
