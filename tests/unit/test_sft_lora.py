"""LoRA adapters: the base model at the start, only adapters train, the merge equals the adapted forward,
Molt's pattern rule (whole dotted names), a pattern that matches nothing is an error naming the flag."""

import pytest
import torch
from torch import nn

from services.trainer import lora


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.up_proj, self.norm = nn.Linear(8, 8), nn.Linear(8, 16, bias=False), nn.LayerNorm(8)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(8, 5)

    def forward(self, x):
        for b in self.layers:
            x = b.norm(x + b.q_proj(x)) + b.up_proj(x)[..., :8]
        return self.lm_head(x)


def test_adapters_start_at_the_base_train_alone_and_merge_exactly():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(3, 8)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    before = model(x)
    names = lora.apply(model, rank=2, alpha=8.0, patterns=["*_proj"])
    assert names == ["layers.0.q_proj", "layers.0.up_proj", "layers.1.q_proj", "layers.1.up_proj"]
    assert torch.equal(model(x), before)  # B starts at zero
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{n}.lora_{ab}.weight" for n in names for ab in "AB")
    assert lora.scale_of(model) == 4.0 and lora.scale_of(Tiny()) is None

    with torch.no_grad():
        for n in names:
            model.get_submodule(n).lora_B.weight.normal_()
    merged = lora.merge(model.state_dict(), 4.0)
    assert merged.keys() == base_state.keys()
    assert torch.equal(merged["lm_head.weight"], base_state["lm_head.weight"])  # untargeted: untouched
    plain = Tiny()
    plain.load_state_dict(merged)
    assert torch.allclose(plain(x), model(x), atol=1e-5)


def test_patterns_match_whole_dotted_names_and_none_matching_is_an_error():
    assert lora.matches("model.layers.0.self_attn.q_proj", ["*_proj"])
    assert not lora.matches("model.layers.0.self_attn.q_proj", ["q_proj"])  # Molt: a bare leaf name is not enough
    assert lora.matches("model.layers.0.self_attn.q_proj", ["*.q_proj"])
    assert not lora.matches("lm_head", ["*_proj"])
    with pytest.raises(ValueError, match="--model.lora.target_modules q_proj: no linear layer"):
        lora.apply(Tiny(), rank=2, alpha=8.0, patterns=["q_proj"])
