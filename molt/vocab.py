"""``vocab_fingerprint``: which token each id stands for, as one short hash.

The gateway tokenizes and the rollout pods generate token ids; both read a model directory of their own. If
the two vocabularies differ, every id the gateway sends means another token to the pod and every trajectory
trains on text nobody wrote, with no error anywhere. Pods report this fingerprint on ``/readyz`` and the
gateway routes only to pods whose fingerprint equals its own.
"""

from __future__ import annotations

import hashlib
from typing import Any


def vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 (first 16 hex digits) of the id -> token map, added tokens included. Chat templates and other
    tokenizer settings are left out: only what an id means has to agree between the gateway and a pod."""
    h = hashlib.sha256()
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{token}\n".encode())
    return h.hexdigest()[:16]
