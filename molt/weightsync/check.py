"""The trainer's half of ``--train.check_weight_update_equal``: prompt logprobs of a fixed probe.

After a sync the pod computes the same probe's prompt logprobs with its engine and compares
(``WeightSyncCore.commit``); above ``max_abs_diff`` it refuses to promote. fp32 vLLM on CPU agrees
with transformers fp32 to ~1e-6, bf16 only to ~3e-2 (bf16 keeps 8 mantissa bits): pick the threshold by dtype.
"""

from __future__ import annotations

import torch

from molt._proto import weightsync_pb2 as pb

DEFAULT_PROBE = [1, 872, 264, 1273, 13, 576, 3974, 17, 2, 1, 9707, 11]


@torch.no_grad()
def prompt_logprobs(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1 under an HF causal LM (len(token_ids) - 1 floats)."""
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)
    logits = model(input_ids=ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


def probe_check(
    model: torch.nn.Module, token_ids: list[int] | None = None, max_abs_diff: float = 1e-3
) -> pb.ProbeCheck:
    """A Commit check from the trainer's model (vocab-clipped default probe)."""
    vocab = model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]  # nn.Module.__getattr__ types the HF model's methods as Tensor | Module
    ids = [t % vocab for t in (token_ids or DEFAULT_PROBE)]
    return pb.ProbeCheck(token_ids=ids, expected_logprobs=prompt_logprobs(model, ids), max_abs_diff=max_abs_diff)
