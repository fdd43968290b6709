"""The pytest warning policy (pyproject.toml): a DeprecationWarning attributed to our own modules fails the
test, one from a third-party module is ignored."""

import warnings

import pytest


@pytest.mark.parametrize("module", ["molt", "molt.schema", "services.gateway.core"])
def test_a_deprecation_warning_from_our_modules_is_an_error(module):
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("deprecated", DeprecationWarning, "x.py", 1, module=module)


@pytest.mark.parametrize("module", ["torch.distributed", "moltx", "servicesx.y"])
def test_a_deprecation_warning_from_a_third_party_module_is_ignored(module):
    warnings.warn_explicit("deprecated", DeprecationWarning, "x.py", 1, module=module)  # does not raise
