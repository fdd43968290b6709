"""Weight sync: the trainer refreshes every rollout pod's weights, bucketed, checked and atomic.

Layers (one file each): ``layout`` (tensors as bytes + dtype + shape in fixed-size buckets),
``manifest`` (HF names, what is sent vs kept, the pod's manifest check), ``wire`` (protobuf glue
for proto/weightsync.proto), ``core`` (pod side, transport-agnostic), ``server`` (its gRPC
adapter: ``start_weightsync_server``), ``client`` (a pod as seen by the trainer: gRPC or in-memory),
``collective`` (gloo/NCCL group for the broadcast data path), ``pusher`` (``WeightPusher``) and
``check`` (the trainer's probe logprobs for ``--train.check_weight_update_equal``).

Nothing heavy is imported here: ``from molt.weightsync import WeightPusher`` loads the pusher only.
"""

from __future__ import annotations

__all__ = ["WeightPushError", "WeightPusher", "PushReport", "start_weightsync_server"]


def __getattr__(name: str):
    if name in ("WeightPusher", "WeightPushError", "PushReport"):
        from molt.weightsync import pusher

        return getattr(pusher, name)
    if name == "start_weightsync_server":
        from molt.weightsync.server import start_weightsync_server

        return start_weightsync_server
    raise AttributeError(name)
