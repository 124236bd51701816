"""Benchmark sweeps for the paged attention kernels.

``python -m paged_video.bench sweep|plot|table|...``.

Every timed run is first checked against the float64 oracle in ``reference/``; timings go to a
long-format CSV, and plots and tables are drawn from that CSV by separate steps.
"""

if __name__ != "paged_video.bench":  # a bare `import bench` found this clone's folder
    from paged_video._clone import hand_over

    hand_over(__name__, __file__)
else:
    # First, before anything imports triton: without a GPU, importing the kernels switches Triton's
    # interpreter on, and triton 3.9 reads that switch when triton itself is imported.
    from paged_video import kernels  # noqa: F401
