"""A small LLaMA training run to record under `vmstoolkit record`, with Python frames on every event.

The bundled traces were recorded with ``context=None`` (no frames), so `compare`'s "where the peak
comes from" table has nothing to say about them. This program is what the frames trace records:

    vmstoolkit record --stacks python --out experiments/results/frames-h200/llama-small-frames.pickle.gz \
        -- python3 experiments/record_frames_gpu.py

A LLaMA-architecture causal LM (hidden 1024, 8 layers, 16 heads, FFN 2816, vocabulary 32000,
random weights, seed 0), AdamW, bf16 autocast, four steps at batch 4 and sequence lengths
{512, 1024, 768, 1024}: small enough that the snapshot stays a few MB.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for seq in (512, 1024, 768, 1024):
        ids = torch.randint(0, cfg.vocab_size, (4, seq), device="cuda")  # (B, T)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"seq {seq}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
