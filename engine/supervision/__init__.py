"""The TP worker processes and what watches them: spawning and stopping the workers
(`workers`), a worker's process (`tp_worker`), heartbeats (`heartbeat`), the ``--dist-timeout``
watchdog (`watchdog`) and the shutdown on a failure (`supervisor`)."""
