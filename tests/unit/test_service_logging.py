"""Every service logs through ``molt.serve.configure_logging``: httpx's per-request INFO lines stay out below
debug, and dependency noise no user can act on is dropped while the rest of the same loggers passes."""

import logging
import warnings

import pytest

from molt.serve import configure_logging

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"


@pytest.fixture
def restore_loggers():
    names = ("httpx", "httpcore", "torchao", "torch.utils._pytree", LAYERWISE)
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in names}
    yield
    for n, (level, filters) in saved.items():
        logging.getLogger(n).setLevel(level)
        logging.getLogger(n).filters[:] = filters


def passes(name: str, msg: str, level: int = logging.WARNING) -> bool:
    logger = logging.getLogger(name)
    return logger.isEnabledFor(level) and bool(logger.filter(logger.makeRecord(name, level, "f.py", 1, msg, (), None)))


def test_httpx_request_lines_are_kept_out_below_debug(restore_loggers):
    configure_logging("info")
    assert not passes("httpx", 'HTTP Request: POST http://x/v1/sessions "HTTP/1.1 201 Created"', logging.INFO)
    assert passes("httpx", "a warning")
    configure_logging("debug")
    assert logging.getLogger("httpx").level == logging.WARNING  # already set: debug does not lower it again


def test_debug_leaves_httpx_at_its_own_level(restore_loggers):
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    configure_logging("debug")
    assert logging.getLogger("httpx").level == logging.NOTSET


def test_dependency_noise_is_dropped_and_nothing_else(restore_loggers):
    configure_logging("info")
    configure_logging("info")  # twice: one filter per logger
    assert len(logging.getLogger("torchao").filters) == 1
    # This machine has no GPU: torchao's CUDA-only kernels failing to load is expected, not news.
    assert not passes("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    assert passes("torchao", "Skipping import of cpp extensions due to incompatible torch version")
    assert not passes("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively")
    assert passes("torch.utils._pytree", "any other pytree warning")
    assert not passes(LAYERWISE, "RotaryEmbedding: Failed to load weights")
    assert passes(LAYERWISE, "another reload warning")


def test_vllms_touch_of_a_deprecated_torch_alias_is_dropped_and_nothing_else(restore_loggers):
    msg = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"

    def shown(module: str, text: str = msg) -> bool:
        with warnings.catch_warnings(record=True) as seen:
            configure_logging("info")  # inside: the filter it adds goes when the block ends
            warnings.warn_explicit(text, FutureWarning, "f.py", 1, module=module, registry={})
        return any(str(w.message) == text for w in seen)  # not a stray warning (a socket's gc) that came too

    assert not shown("vllm.triton_utils.dispatcher")
    assert shown("my_training_script")  # the user's own use of the alias is theirs to hear about
    assert shown("vllm.triton_utils.dispatcher", "another FutureWarning")
