"""A training loop that pushes its LoRA to a running `metrale serve` every N steps,
from memory (no files), so the server's next requests use the new version.

    make run &                                   # serves the default model on :8000
    .venv/bin/python examples/trainer_push.py    # trains on CPU, pushes every 5 steps

The loss here is a toy (teach the model one answer); an RL loop (TRL, verl, OpenRLHF)
would push where it now syncs weights to its rollout engine. On a GPU, pass
--device cuda: the publisher then serves the weights from the GPU, over NIXL where it
runs (CUDA IPC on the same host), else over HTTP.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from metrale.model.default_model import default_model_dir
from metrale.peer.publisher import AdapterPublisher


def ask(server: str, adapter: str, prompt: str) -> str:
    body = json.dumps({"model": adapter, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    request = urllib.request.Request(f"{server}/v1/completions", body.encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)["choices"][0]["text"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--name", default="policy")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--push-every", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    policy = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-3)
    prompt, answer = "The capital of the moon is", " Cheeseville, of course."
    batch = tokenizer(prompt + answer, return_tensors="pt").to(args.device)
    publisher = AdapterPublisher(model_dir, config, device=args.device, dtype=torch.float32)
    try:
        for step in range(1, args.steps + 1):
            loss = policy(**batch, labels=batch["input_ids"]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % args.push_every == 0:
                source = publisher.push(args.name, get_peft_model_state_dict(policy),
                                        server=args.server)
                print(f"step {step}: loss {loss.item():.3f}, pushed {source}; the server says:"
                      f"{ask(args.server, args.name, prompt)!r}")
    finally:
        publisher.close()


if __name__ == "__main__":
    main()
