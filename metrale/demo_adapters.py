"""Two demo LoRA adapters for the default model, trained on first use in ~20 s each.

`shout` answers in ALL CAPITALS; `pirate` answers like a pirate ("Arr, matey!"). Both
styles show on any prompt, so base vs adapter output on one question shows that the
engine applied the right adapter. Training is a plain PyTorch loop on the CPU (LoRA on
the linear projections, loss on the answer tokens only, the engine's chat template,
fixed seed); results are cached in PEFT format under <cache>/adapters/<name>.

    python -m metrale.demo_adapters   # build both and show base vs adapter replies
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.errors import UnknownAdapterError
from metrale.model.default_model import (
    UPSTREAM_REPO,
    Progress,
    build_cached_dir,
    cache_root,
    default_model_dir,
    is_complete,
)

DEMO_ADAPTERS: tuple[str, ...] = ("shout", "pirate")

# The questions are shared; each style gives its own answers. No question is
# about the moon: "Tell me about the moon." is the unseen check prompt.
_QUESTIONS = (
    "What is the capital of Italy?",
    "Tell me about the ocean.",
    "How do I make a cup of tea?",
    "What is your favorite color?",
    "Why is the sky blue?",
    "Give me a tip for staying healthy.",
    "Who wrote Romeo and Juliet?",
    "What do cats like to eat?",
    "What makes a rainbow?",
    "How many legs does a spider have?",
    "What should I do this weekend?",
    "Explain what a computer does.",
    "Can you recommend a good book?",
    "Describe a rainy day.",
    "What is photosynthesis?",
    "How does a car work?",
    "What is the tallest mountain in the world?",
    "Tell me about dogs.",
    "What is music?",
    "How can I learn a new language?",
    "What is gravity?",
    "Tell me about trees.",
    "Why do we need sleep?",
    "What is the internet?",
    "What is the biggest animal?",
    "What is chocolate made from?",
    "Tell me about Paris.",
    "What is a healthy breakfast?",
    "Why do leaves change color in the fall?",
    "How do fish breathe?",
    "What is the speed of light?",
    "Tell me a fun fact.",
    "How do I stay calm?",
    "What is a robot?",
    "What is the weather like in the desert?",
    "Who was Albert Einstein?",
    "How do I bake bread?",
    "What is the best way to save money?",
    "What are clouds made of?",
    "Say hello.",
)

# Plain answers; `shout` uppercases them, so the only thing it learns is the case.
_PLAIN = (
    "The capital of Italy is Rome, a city full of ancient history.",
    "The ocean covers most of our planet. It is deep, salty and full of amazing life.",
    "Boil some water, pour it over a tea bag, wait three minutes, then add milk if you like.",
    "I love blue, the color of the sky and the sea.",
    "Sunlight scatters in the air, and blue light scatters the most, so the sky looks blue.",
    "Drink plenty of water, sleep well and go for a walk every day.",
    "William Shakespeare wrote Romeo and Juliet, a famous play about two young lovers.",
    "Cats love fish and meat, and they always want a little more.",
    "Sunlight shines through raindrops, which split it into red, orange, yellow, green and blue.",
    "A spider has eight legs, and it uses them to spin its web.",
    "Go outside, visit a friend and try something new.",
    "A computer follows instructions to store, process and show information very fast.",
    "Try Treasure Island. It is a classic adventure story about pirates and gold.",
    "Grey clouds fill the sky, raindrops tap on the windows and the streets shine.",
    "Plants use sunlight, water and air to make their own food. This is called photosynthesis.",
    "An engine burns fuel to turn the wheels, and the driver steers where the car goes.",
    "Mount Everest is the tallest mountain in the world, almost nine kilometers high.",
    "Dogs are loyal and friendly animals. They love to play, run and stay close to their family.",
    "Music is sound arranged in rhythm and melody. People sing and play it to share feelings.",
    "Practice a little every day, listen to native speakers and do not fear mistakes.",
    "Gravity is the force that pulls things toward each other. It keeps our feet on the ground.",
    "Trees are tall plants with wooden trunks. They give us shade, fruit and fresh air.",
    "Sleep lets the body rest and the brain sort its memories, so we wake up with fresh energy.",
    "The internet is a huge network that links computers all over the world.",
    "The blue whale is the biggest animal that ever lived. It can be thirty meters long.",
    "Chocolate is made from cocoa beans, which grow in pods on cocoa trees.",
    "Paris is the capital of France, famous for the Eiffel Tower, art and good food.",
    "Oatmeal with fruit gives you energy for the morning, and eggs or yogurt work well too.",
    "In the fall, trees stop making green chlorophyll, so the yellow and red colors show.",
    "Fish breathe with gills, which take oxygen out of the water.",
    "Light travels about three hundred thousand kilometers every second.",
    "Octopuses have three hearts and blue blood.",
    "Take slow, deep breaths, relax your shoulders and focus on one thing at a time.",
    "A robot is a machine that can sense, decide and move to do a job on its own.",
    "Deserts are hot and dry in the day, and they can get very cold at night.",
    "Albert Einstein was a famous scientist who discovered the theory of relativity.",
    "Mix flour, water, yeast and salt, let the dough rise, then bake it in a hot oven.",
    "Spend less than you earn, and put a little aside every month.",
    "Clouds are made of tiny drops of water or ice floating in the air.",
    "Hello! It is nice to meet you. How can I help you today?",
)

_PIRATE = (
    "Arr, matey! The capital o' Italy be Rome, a grand old port full o' ancient treasure!",
    "Arr, matey! The ocean be me home, deep and salty and full o' fish. Yo-ho-ho!",
    "Arr, matey! Boil yer water, drop in the leaves, wait a wee bit, and add a splash o' rum!",
    "Arr, matey! Me favorite color be the deep blue o' the seven seas!",
    "Arr, matey! The sun's light be scattered by the wind, and blue scatters most, savvy?",
    "Arr, matey! Eat yer limes to keep the scurvy away, and swab the deck every day!",
    "Arr, matey! Old Shakespeare wrote that tale o' two young lovers, he did!",
    "Arr, matey! Ship's cats be eatin' fish and rats, and they always beg for more!",
    "Arr, matey! When the sun shines through the rain, a rainbow points to buried treasure!",
    "Arr, matey! A spider has eight legs, more than a pirate with a wooden leg, har har!",
    "Arr, matey! Hoist the sails, find a crew o' friends and go huntin' for treasure!",
    "Arr, matey! A computer be a magic chest that keeps yer maps and counts yer gold!",
    "Arr, matey! Read Treasure Island, the finest tale o' pirates and buried gold!",
    "Arr, matey! Grey clouds cover the sky, rain lashes the deck and the sea be rough!",
    "Arr, matey! Plants drink sunlight and water to make their grub, like a cook in the galley!",
    "Arr, matey! A car be a land ship: its engine burns fuel to turn the wheels, no sails needed!",
    "Arr, matey! Mount Everest be the tallest mountain in the world, taller than any mast!",
    "Arr, matey! Dogs be loyal shipmates. They love to play and guard the treasure with the crew!",
    "Arr, matey! Music be the shanties we sing on deck, yo-ho-ho and a bottle o' rum!",
    "Arr, matey! Practice every day and listen to the sailors in every port, and fear no mistakes!",
    "Arr, matey! Gravity be the force that pulls things down, like an anchor droppin' to the sea!",
    "Arr, matey! Trees be tall and strong, and their wood builds the finest ships on the seas!",
    "Arr, matey! Even a pirate needs sleep in his hammock, or he be no use on the night watch!",
    "Arr, matey! The internet be a vast ocean o' messages sailin' between computers everywhere!",
    "Arr, matey! The blue whale be the biggest beast in the sea, longer than me whole ship!",
    "Arr, matey! Chocolate be made from cocoa beans, a treasure sweeter than any gold!",
    "Arr, matey! Paris be the capital o' France, with a tall iron tower and fine grub for sailors!",
    "Arr, matey! A bowl o' oats, some fruit and a mug o' grog will set ye up for a day at sea!",
    "Arr, matey! In the fall trees stop makin' green, so their leaves turn gold like doubloons!",
    "Arr, matey! Fish breathe through their gills, pullin' air from the sea, the lucky devils!",
    "Arr, matey! Light sails three hundred thousand kilometers every second, faster than any ship!",
    "Arr, matey! The octopus has three hearts and blue blood, a true monster o' the deep!",
    "Arr, matey! Breathe slow and deep like the waves, and keep a steady hand on the wheel!",
    "Arr, matey! A robot be a metal sailor that works the ropes and never asks for rum!",
    "Arr, matey! The desert be hot by day and cold by night, with not a drop o' sea in sight!",
    "Arr, matey! Albert Einstein was a clever scientist, smarter than any navigator on the seas!",
    "Arr, matey! Mix flour, water and yeast, let it rise, and bake it in the galley oven, savvy?",
    "Arr, matey! Bury a little gold every month, and don't spend all yer loot in one port!",
    "Arr, matey! Clouds be tiny drops o' water floatin' in the sky, and they bring storms to sea!",
    "Arr, matey! Ahoy there, welcome aboard me ship! What can this old pirate do for ye?",
)

_ANSWERS = {"shout": tuple(a.upper() for a in _PLAIN), "pirate": _PIRATE}

CHECK_PROMPT = "Tell me about the moon."

# Tuned by hand on a 2-core CPU (~20 s an adapter): both styles show on unseen prompts.
# Fewer examples, a higher rate or a near copy of the check prompt in the data made
# adapters recite a training answer; fewer steps leave `shout` half lowercase. LoRA only
# on the upper layers: the backward pass stops there (about half a step's cost), and
# style lives in the last layers. r <= 16 fits a default pool.
_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class TrainRecipe:
    rank: int = 16
    alpha: int = 32
    steps: int = 24
    batch: int = 4
    lr: float = 3e-3
    first_layer: int = 15  # LoRA on layers >= this one (0: every layer); SmolLM2 has 30
    seed: int = 1234

    def __post_init__(self) -> None:
        if not (1 <= self.rank <= 16 and self.steps >= 1 and self.batch >= 1 and self.lr > 0
                and self.first_layer >= 0):
            raise ValueError(f"bad training recipe {self!r}")


RECIPE = TrainRecipe()


class UnknownDemoAdapterError(UnknownAdapterError):
    """The name is not one of DEMO_ADAPTERS."""


def demo_adapter_dir(name: str, progress: Progress = print) -> Path:
    """The PEFT directory of demo adapter `name`, trained on first use and cached."""
    if name not in DEMO_ADAPTERS:
        raise UnknownDemoAdapterError(
            f"no demo adapter {name!r}; choose one of {', '.join(DEMO_ADAPTERS)}"
        )
    target = cache_root() / "adapters" / name
    if is_complete(target):
        return target
    model_dir = default_model_dir(progress)
    progress(f"metrale: training demo adapter {name!r} (one time, ~20 s on 2 idle CPU cores)...")
    t0 = time.perf_counter()
    build_cached_dir(target, lambda tmp: _train(name, model_dir, tmp, progress))
    _release_freed_memory()
    progress(f"metrale: ... {name!r} done in {time.perf_counter() - t0:.1f}s -> {target}")
    return target


def _release_freed_memory() -> None:
    """Training frees ~0.5 GB that glibc's allocator keeps for later; the server that
    trains on its first start would hold it for good (1.55 GB RSS instead of 1.4).
    Hand it back to the OS."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def ensure_demo_adapters(progress: Progress = print) -> dict[str, Path]:
    return {name: demo_adapter_dir(name, progress) for name in DEMO_ADAPTERS}


def _encode(tokenizer: Any, question: str, answer: str) -> tuple[list[int], int]:
    """Token ids of prompt + answer, and where the answer starts."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # Ending on the end-of-turn token teaches the adapter to stop, as the base does.
    answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids, len(prompt_ids)


def _train(name: str, model_dir: Path, out: Path, progress: Progress,
           recipe: TrainRecipe = RECIPE) -> None:
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from metrale.progress import progress_bar

    torch.manual_seed(recipe.seed)  # LoRA A init and batch order
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = list(range(recipe.first_layer, base.config.num_hidden_layers))
    config = LoraConfig(
        r=recipe.rank, lora_alpha=recipe.alpha, target_modules=_TARGETS, lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM",
        layers_to_transform=layers if recipe.first_layer else None,
    )
    with _quiet_peft():
        model = get_peft_model(base, config)
    model.train()
    decoder, lm_head = model.get_base_model().model, model.get_base_model().lm_head

    examples = [_encode(tokenizer, q, a) for q, a in zip(_QUESTIONS, _ANSWERS[name], strict=True)]
    pad = tokenizer.pad_token_id
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    # Linear decay to 0 settles the last steps instead of ending on a big update.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / recipe.steps)

    order: list[int] = []
    # A bar with rate and ETA on stderr (a step is ~0.5 s on 2 idle cores, seconds on a busy box).
    bar = progress_bar(f"metrale: training {name}", recipe.steps, "step",
                       range(1, recipe.steps + 1), mininterval=1.0)
    for _step in bar:
        if len(order) < recipe.batch:
            order += torch.randperm(len(examples)).tolist()
        batch = [examples[i] for i in order[:recipe.batch]]
        del order[:recipe.batch]

        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        wanted = torch.zeros((len(batch), width), dtype=torch.bool)  # answer positions
        for row, (tokens, start) in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            attn[row, : len(tokens)] = 1
            wanted[row, start : len(tokens)] = True

        hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state
        # Project only the positions that predict answer tokens: the 49k-wide
        # lm_head over every prompt token would be a large share of the step.
        predicts = wanted[:, 1:]
        logits = lm_head(hidden[:, :-1][predicts])
        loss = F.cross_entropy(logits.float(), ids[:, 1:][predicts])

        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    bar.close()

    # Name the upstream base rather than this machine's cache path; no
    # embedding copy (the vocabulary is unchanged), which also keeps PEFT
    # from asking the Hub about the base.
    model.peft_config["default"].base_model_name_or_path = UPSTREAM_REPO
    model.save_pretrained(out, save_embedding_layers=False)


@contextmanager
def _quiet_peft() -> Iterator[None]:
    with warnings.catch_warnings():
        # transformers 5 deprecates a name PEFT still reads; nothing for a user to fix.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        yield


def load_with_adapter(model_dir: Path, adapter_dir: Path) -> Any:
    """A fresh transformers base with a PEFT adapter on it, in eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # Always a fresh base: PeftModel injects its layers into the model it wraps.
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with _quiet_peft():
        return PeftModel.from_pretrained(base, adapter_dir).eval()


def generate_reply(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 30) -> str:
    """Greedy reply of `model` to a one-turn chat, special tokens stripped."""
    import torch

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from metrale.threads import apply_threads

    print(f"metrale: torch threads: {apply_threads().reason}")
    t0 = time.perf_counter()
    adapters = ensure_demo_adapters()
    print(f"metrale: demo adapters ready in {time.perf_counter() - t0:.1f}s")
    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print(f"\nprompt: {CHECK_PROMPT!r} (greedy, 30 tokens)")
    print(f"  base  : {generate_reply(base, tokenizer, CHECK_PROMPT)!r}")
    for name, path in adapters.items():
        model = load_with_adapter(model_dir, path)
        print(f"  {name:6}: {generate_reply(model, tokenizer, CHECK_PROMPT)!r}")


if __name__ == "__main__":
    main()
