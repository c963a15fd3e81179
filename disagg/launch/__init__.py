"""What starts the system or a tool: the top layer, imported by nothing in the core.

    cli          the ``disagg`` command (``serve``, ``demo``, ``generate``, ``bench``, ``sim``, ``plan``, ...)
    preflight    one-line checks before Ray starts (config, model, device, CPUs, port)
    local        a local Ray cluster + the Serve app (``disagg serve``), HAProxy front, console lines
    haproxy_dirs the front's run directories: owner files, orphan reaping
    deploy       ``ray up`` cluster files and Helm values from the typed config
    demo         the embedded default end to end (``disagg demo``)
    inprocess    the same workers in one process, no Ray (tests, the simulator's ground truth)
    multiproc    the Ray-free process backend (one engine per process; GPU benchmarks)
"""
