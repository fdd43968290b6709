"""``python -m molt.cli.train_rl_ray FLAGS``, Molt's RL entry point: the same as ``molt train-rl FLAGS`` (the local
stack, or ``--emit helm-values FILE``), so a Molt launch script's command line runs as it is."""

import sys

from molt.cli import train_rl

if __name__ == "__main__":
    sys.exit(train_rl(sys.argv[1:], prog="python -m molt.cli.train_rl_ray"))
