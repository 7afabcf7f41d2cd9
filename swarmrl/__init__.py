"""swarmrl, the application: every `swarmrl` command, config loading, logging set-up and the Ray launcher
(actors, driver, local processes, run folder, live view). The library packages below it (protocol,
shardcast, verifier, inference_worker, trainer, orchestrator) have no command line and set up no logging.
"""
