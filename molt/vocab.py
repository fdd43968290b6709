"""``vocab_fingerprint``: which token each id stands for, as one short hash.

The gateway tokenizes and the rollout pods generate token ids; both read a model directory of their own. If
the two vocabularies differ, every id the gateway sends means another token to the pod and every trajectory
trains on text nobody wrote, with no error anywhere. Pods report this fingerprint on ``/readyz`` and the
gateway routes only to pods whose fingerprint equals its own.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 (first 16 hex digits) of the id -> token map, added tokens included. Chat templates and other
    tokenizer settings are left out: only what an id means has to agree between the gateway and a pod."""
    h = hashlib.sha256()
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{token}\n".encode())
    return h.hexdigest()[:16]


def model_vocab(model_dir: str | Path) -> str:
    """The fingerprint of ``model_dir``'s tokenizer, loaded as the gateway loads it (transformers'
    AutoTokenizer): what the ids mean is the directory's tokenizer, whichever one an engine detokenizes with.
    "" (no check) when it has none that loads."""
    from transformers import AutoTokenizer

    try:
        return vocab_fingerprint(AutoTokenizer.from_pretrained(str(model_dir)))
    except (OSError, ValueError) as exc:
        log.warning(
            "%s: no tokenizer to fingerprint (%s); gateways cannot check this pod's vocabulary", model_dir, exc
        )
        return ""
