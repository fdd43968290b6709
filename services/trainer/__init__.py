"""The trainer service: an FSDP2 learner over the trajectory stream, driving the RL loop.

``python -m services.trainer`` (under ``torchrun`` for N ranks). Layers, one file each:
``config`` (Molt's flags), ``batch`` (trajectories -> step-axis tensors), ``groups`` (group assembly,
dispatch gate), ``model`` (process group, loading, FSDP2), ``routing_replay`` (MoE R3), ``learner``
(experience + optimizer steps), ``checkpoint`` (atomic save/resume), ``controller`` (rank 0: stream,
dispatch, commits), ``dispatch`` (dataset + env-worker client), ``publish`` (weights to pods),
``trainer`` (the step loop), ``app``/``routes``/``metrics`` (HTTP + Prometheus). ``push`` is the
operator's weight-push CLI (weight-sync service).
"""
