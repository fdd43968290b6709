"""``python -m services.trainer [flags]`` or ``torchrun --nproc_per_node N -m services.trainer [flags]``.

Every rank parses the same flags; rank 0 also serves /healthz, /readyz and /metrics, reads the
stream and (``--train.dispatch``) drives the env workers. SIGTERM/SIGINT: rank 0 finishes the current
step, saves and commits, then every rank exits together (the other ranks ignore the signal).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from molt.config import parse_settings
from molt.serve import configure_logging, freeze_before_exit, preflight
from services.trainer.checks import check_datasets, validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.device import trainer_on_gpu

PROG = "python -m services.trainer"


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    hints: list[str] = []
    on_gpu = trainer_on_gpu()  # what this machine's loader refuses is refused at parse time, --dry-run too
    rank = int(os.environ.get("RANK", "0"))

    def validate(s: TrainerSettings) -> None:
        hints.extend(validate_settings(s, on_gpu=on_gpu))
        # Before the model loads, a bad dataset is one line with status 2. Rank 0 is the one that reads the
        # datasets: on several nodes, the others' file systems need not hold them.
        if rank == 0:
            check_datasets(s)

    settings = parse_settings(TrainerSettings, sys.argv[1:] if argv is None else argv, prog=PROG, validate=validate)
    port = settings.metrics.port if settings.metrics.port is not None else settings.server.port
    flag = "--metrics.port" if settings.metrics.port is not None else "--server.port"
    preflight(
        PROG,
        ports=[(flag, settings.server.host, port)] if rank == 0 else [],
        models=[
            (f"--{name}.model_name_or_path", path)
            for name, path in (
                ("actor", settings.actor.model_name_or_path),
                ("ref", settings.ref.model_name_or_path),
                ("critic", settings.critic.model_name_or_path),
            )
            if name == "actor" or path
        ],
        redis_url=settings.redis.url,
        redis_wait_s=settings.redis.startup_wait_s,
    )
    configure_logging(settings.server.log_level, rank=rank)
    log = logging.getLogger("molt.trainer")
    for hint in hints if rank == 0 else []:
        log.info("hint: %s", hint)

    import torch.distributed as dist

    from services.trainer.dispatch import DispatchError
    from services.trainer.errors import CheckpointWriteError
    from services.trainer.model import init_distributed
    from services.trainer.publish import PodDiscoveryError
    from services.trainer.trainer import Trainer

    info = init_distributed()
    try:
        trainer = Trainer(settings, info)
    except ValueError as exc:
        sys.exit(f"{PROG}: error: {exc}")
    if info.is_main:
        trainer.start_server()
        signal.signal(signal.SIGTERM, trainer.request_stop)
        signal.signal(signal.SIGINT, trainer.request_stop)
    else:  # torchrun / Ctrl-C signal every rank: rank 0 decides when to stop and tells the others
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        summary = trainer.run()
    except (PodDiscoveryError, CheckpointWriteError, DispatchError) as exc:  # named in one line, no traceback
        sys.exit(f"{PROG}: error: {exc}")
    finally:
        trainer.close()
    if info.is_main:
        log.info("done: %s", summary)
    dist.barrier()
    dist.destroy_process_group()
    freeze_before_exit()


if __name__ == "__main__":
    main()
