"""Training runs of two model families the allocators were never tuned on, to record under
`vmstoolkit record` and replay here (issue 36's held-out rates: `vms` against `pytorch-caching`).

Issue 36 measured `vms` on held-out OPT (full fine-tuning) and GPT-NeoX (LoRA) snapshots that the
project does not have. These are two such runs, recorded the same way as the bundled traces:

    vmstoolkit record --out opt-full.pickle.gz -- python3 experiments/record_heldout_gpu.py opt-full
    vmstoolkit record --out neox-lora.pickle.gz -- python3 experiments/record_heldout_gpu.py neox-lora

The shapes were fixed by a rule written before anything was measured: each family's published
configuration nearest 1.3B parameters (OPT-1.3b; Pythia-1.4b for GPT-NeoX), random weights
(seed 0, nothing downloaded), bf16 autocast, AdamW, batch 4, sequence lengths cycling through
{512, 1024, 768, 1024} for OPT and {1024, 2048, 1536, 2048} for NeoX, 6 steps. LoRA is peft's
(rank 16, alpha 32, on ``query_key_value`` and ``dense``).
"""

from __future__ import annotations

import sys

import torch


def build(name: str) -> tuple[torch.nn.Module, int, tuple[int, ...]]:
    if name == "opt-full":
        from transformers import OPTConfig, OPTForCausalLM
        cfg = OPTConfig(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
                        vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048)
        return OPTForCausalLM(cfg), cfg.vocab_size, (512, 1024, 768, 1024)
    if name == "neox-lora":
        from peft import LoraConfig, get_peft_model
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
        cfg = GPTNeoXConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
                            vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25)
        model = GPTNeoXForCausalLM(cfg)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=["query_key_value", "dense"], lora_dropout=0.0)
        return get_peft_model(model, lora), cfg.vocab_size, (1024, 2048, 1536, 2048)
    raise SystemExit(f"unknown run {name!r}: expected opt-full or neox-lora")


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "opt-full"
    torch.manual_seed(0)
    model, vocab, seqs = build(name)
    model = model.cuda()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for step in range(6):
        seq = seqs[step % len(seqs)]
        ids = torch.randint(0, vocab, (4, seq), device="cuda")  # (B, T)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"{name} step {step} seq {seq}: loss {loss.item():.4f}, "
              f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
