"""Tiny random-init models with a locally trained tokenizer, for tests and the `tiny` recipe.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on a deterministic synthetic corpus
(words, numbers, arithmetic, JSON-ish tool calls), so every build with the same vocab size gives the
same ids: models built with different ``--seed`` are weight-swappable (same shapes, same tokenizer).
The chat template is ChatML with tool support (Hermes-style ``<tool_call>`` blocks), the format the
gateway parses tool calls from.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

Arch = Literal["qwen3", "qwen3_moe", "llama", "idefics3"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens: they survive decoding with skip_special_tokens=True, like Qwen3's.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# ChatML + tools. Each message renders independently of later ones, so appending messages only
# appends text: the gateway's delta rendering relies on this prefix property.
CHAT_TEMPLATE = (
    "{%- set nl = '\\n' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system' + nl }}"
    "{%- if messages[0].role == 'system' -%}{{ messages[0].content + nl + nl }}{%- endif -%}"
    "{{ 'You may call tools. Tools:' + nl }}"
    "{%- for tool in tools -%}{{ tool | tojson + nl }}{%- endfor -%}"
    "{{ 'To call one, reply <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>' + '<|im_end|>' + nl }}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{ '<|im_start|>system' + nl + messages[0].content + '<|im_end|>' + nl }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant' + nl + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set args = call.function.arguments -%}"
    "{{ '<tool_call>{\"name\": ' + call.function.name | tojson + ', \"arguments\": ' }}"
    "{{- args if args is string else args | tojson -}}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>' + nl }}"
    "{%- elif message.role == 'tool' -%}"
    "{{ '<|im_start|>tool' + nl + '<tool_response>' + message.content + '</tool_response><|im_end|>' + nl }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + nl + message.content + '<|im_end|>' + nl }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant' + nl }}{%- endif -%}"
)


_WORDS = (
    "the a an is are was be to of and in that have it for not on with he as you do at this but his by from they "
    "we say her she or will my one all would there their what so up out if about who get which go me when make "
    "can like time no just him know take people into year your good some could them see other than then now look "
    "only come its over think also back after use two how our work first well way even new want because any these "
    "give day most us answer question number sum add plus minus times equals yes ok true false hello world assistant "
    "user system tool call result error python print return def import value name arguments weather city search"
).split()


def _corpus(num_lines: int = 6000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        kind = i % 4
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        elif kind == 2:
            args = {"city": rng.choice(_WORDS), "n": rng.randint(0, 99)}
            lines.append(json.dumps({"name": rng.choice(_WORDS), "arguments": args}))
        else:
            lines.append(f"def f{i}(x):\n    return x * {rng.randint(0, 9)} + {rng.randint(0, 99)}\nprint(f{i}(3))")
    return lines


def build_tokenizer(vocab_size: int = 1024):
    """Byte-level BPE trained on the synthetic corpus, wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(arch: Arch, vocab_size: int, hidden: int, layers: int, tie: bool):
    """A small config for ``arch``; head_dim 32 because vLLM's CPU attention rejects 16."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 32, 1),
        num_key_value_heads=max(hidden // 64, 1),
        head_dim=32,
        intermediate_size=2 * hidden,
        max_position_embeddings=2048,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        # Larger than HF's 0.02 so a random model's next-token distribution is not flat.
        initializer_range=0.1,
        torch_dtype="float32",
    )
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    raise ValueError(f"unknown arch {arch!r}: choose qwen3, qwen3_moe or llama")


def build_tiny(
    out: str | Path,
    arch: Arch = "qwen3",
    seed: int = 0,
    vocab_size: int = 1024,
    hidden: int = 128,
    layers: int = 2,
    tie: bool = True,
) -> Path:
    """Write a tokenizer + random-init text model dir to ``out`` and return its path (the VLM: tiny_vl.py)."""
    assert arch != "idefics3", "molt.models.build_tiny dispatches the VLM to tiny_vl"
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = build_config(arch, len(tokenizer), hidden, layers, tie)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
