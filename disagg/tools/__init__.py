"""Offline tools over the serving core: nothing here runs in a serving process.

    bench    agentic traces, the HTTP replay client, metrics, reports (``disagg bench``, ``disagg trace``)
    sim      the discrete-event cluster simulator (``disagg sim``)
    plan     capacity planning from hardware and model shapes (``disagg plan``)

They import the core (``disagg.router``, ``disagg.config``, ...), never the Serve
application (``deployments``) or the launchers; ``tools/check_imports.py`` checks it.
"""
