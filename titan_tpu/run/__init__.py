"""The run, resolved once: the config checked as a whole (setup.py: `prepare_run -> RunSetup`) and
every value derived from it for the world it runs on (resolved.py: `resolve_run -> ResolvedRun`).

The trainer (components/), the planner (plan/) and `titan-tpu compile` read these records; none
derives their values again, and nothing writes into the config after `prepare_run`.
"""
