"""Random-weight Hugging Face checkpoints for the tests, built offline with transformers: one
small model per family jzero reads, every parameter re-randomised (default init leaves norms at
1 and biases at 0, which hides mapping mistakes), saved sharded with its reference outputs."""
from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB, HIDDEN, FF, LAYERS, CONTEXT = 300, 48, 80, 3, 64  # the tokenizer's 256 bytes, merges, 3 specials
ROWS, LENGTH = 4, 40  # the reference batch: tokens [ROWS, LENGTH + 1]


def _configs():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FF, num_hidden_layers=LAYERS,
                  max_position_embeddings=CONTEXT, eos_token_id=EOS, bos_token_id=None, pad_token_id=None)
    return {
        # grouped-query attention (6 query heads over 2 kv heads), an explicit head_dim, llama3 scaling
        "llama": LlamaConfig(**common, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 5e4, "factor": 4.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 16}),
        # multi-query attention, a window of 8 over 40 tokens
        "mistral": MistralConfig(**common, num_attention_heads=4, num_key_value_heads=1, sliding_window=8),
        # q/k/v biases, tied embeddings, windows on layers 1 and 2 only (max_window_layers 1)
        "qwen2": Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                             use_sliding_window=True, sliding_window=8, max_window_layers=1),
        # q/k RMSNorm, head_dim 16 != 48 / 4, YaRN
        "qwen3": Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                              "original_max_position_embeddings": 32}),
        "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=CONTEXT,
                           eos_token_id=EOS, bos_token_id=EOS),
    }


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
EOS = 0  # <|endoftext|>: the example's tokenizer puts its special tokens first
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Pack my box with five dozen liquor jugs!", "Ünïcödé text, emoji 🙂 and numbers 12345."]


def tokenizer_files(out: Path) -> None:
    """examples/hf_tiny_llama.py's tokenizer (byte-level BPE, ChatML template) at VOCAB ids."""
    from test_examples import load_example

    assert load_example("hf_tiny_llama").write_tokenizer(out, VOCAB, TEXTS) == EOS


def make(kind: str, out: Path, dtype: str = "float32") -> dict:
    """Save a random ``kind`` model under ``out`` (shards of ~40 KB and the index) and return its
    reference: tokens [ROWS, LENGTH + 1], the logits of tokens[:, :-1] and the mean next-token loss."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(FAMILIES.index(kind))
    model = AutoModelForCausalLM.from_config(_configs()[kind]).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if ("norm" in name or ".ln_" in name) and name.endswith("weight") else 0.0
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.5) + centre)
    model.to(getattr(torch, dtype)).save_pretrained(out, max_shard_size="40KB")
    tokenizer_files(Path(out))
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH + 1), generator=torch.Generator().manual_seed(7))
    # the reference reads the files back, as a user's transformers would (casting the model
    # itself back to fp32 would keep its rotary frequencies rounded to the checkpoint's dtype)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
        loss = model(tokens, labels=tokens).loss
    return {"dir": Path(out), "tokens": tokens.numpy().astype(np.int32), "logits": logits.numpy(),
            "loss": float(loss), "model": model}
