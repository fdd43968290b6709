"""``torchrun ... -m molt.cli.train_sft FLAGS``, Molt's SFT entry point: the same as ``molt train-sft FLAGS``
(services/trainer/sft.py), so a Molt launch script's command line runs as it is."""

if __name__ == "__main__":
    from services.trainer.sft import main

    main(prog="python -m molt.cli.train_sft")
