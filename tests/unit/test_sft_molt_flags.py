"""SFT refuses ``--fsdp.sequence_parallel`` unless ``--fsdp.tp_size`` is over 1, with the message docs/sft.md
quotes, and accepts Molt's ``--data.dataloader_num_workers`` and ``--local_rank`` (docs/sft.md, "What is
refused, and why").

Through the same parse and validation the SFT CLI runs at start-up (``parse_settings`` + ``validate_sft``).
"""

from __future__ import annotations

import pytest

from molt.config import parse_settings
from services.trainer.sft_config import SftSettings, validate_sft

BASE = ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"]


def _s(*flags: str) -> SftSettings:
    return parse_settings(SftSettings, BASE + list(flags), prog="t")


@pytest.mark.parametrize("on_gpu", [False, True])
def test_sequence_parallel_without_tensor_parallelism_is_refused_with_the_documented_message(on_gpu):
    # Sequence parallelism shards activations across the TP group: with tp_size 1 there is no group, so the
    # flag would be silently ignored. Refused on GPU too, where tp_size > 1 would otherwise be allowed.
    with pytest.raises(ValueError, match=r"^--fsdp\.sequence_parallel needs --fsdp\.tp_size > 1$"):
        validate_sft(_s("--fsdp.sequence_parallel"), on_gpu=on_gpu)


def test_sequence_parallel_with_tensor_parallelism_on_gpu_is_accepted():
    # The refusal is about the missing TP group only: with one (on GPU, where TP runs) the pair passes.
    validate_sft(_s("--fsdp.sequence_parallel", "--fsdp.tp_size", "2"), on_gpu=True)


def test_molt_launch_flags_with_nothing_to_act_on_are_accepted():
    # Molt's launch scripts pass these; rows are tokenised up front and ranks come from torchrun's environment,
    # so they are read and kept, not refused as unknown flags.
    s = _s("--data.dataloader_num_workers", "4", "--local_rank", "0")
    validate_sft(s)
    assert s.data.dataloader_num_workers == 4 and s.local_rank == 0
