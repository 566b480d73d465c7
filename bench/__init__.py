"""The benchmark harness behind ``scripts/bench`` (see scripts/bench.md).

    procs.py        what the harness starts, and the one place that ends it (Owned)
    targets.py      the moto S3 server, an acache node + mount, an rclone mount
    fio.py          fio runs (cases 1-2) and the DCP-like 4 KiB read pattern
    ckpt.py         checkpoint workers (case 3), ckpt_worker.py is the worker process
    cases.py        the cases, each interleaved with its baselines
    report.py       medians, ratios, the rich tables and the JSON file
    main.py         the command line
"""
